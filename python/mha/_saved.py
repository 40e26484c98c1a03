"""What an autograd.Function's forward keeps for its backward: tensors through
save_for_backward (which checks that none was changed in place before the backward: an
optimizer step or a write between the two raises), arrays of other frameworks and None as
they are."""
import torch


def save_inputs(ctx, results, inputs):
    """Keeps the tensors `results` and the arrays `inputs` (None allowed) on ctx."""
    ctx.save_for_backward(*results, *(x if isinstance(x, torch.Tensor) else None
                                      for x in inputs))
    ctx.others = tuple(None if isinstance(x, torch.Tensor) else x for x in inputs)


def saved_inputs(ctx, results):
    """(the `results` tensors..., the inputs...) as save_inputs kept them."""
    saved = ctx.saved_tensors
    return tuple(saved[:results]) + tuple(
        x if x is not None else other for x, other in zip(saved[results:], ctx.others))


def keep_for_backward(ctx, out, lse, inputs, options):
    """An attention Function's forward: its result and LSE (not differentiable), the inputs
    its backward reads and its options."""
    save_inputs(ctx, (out, lse), inputs)
    ctx.options = options
    ctx.mark_non_differentiable(lse)
