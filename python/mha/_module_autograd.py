"""multi_head_attention_forward under torch's autograd: a torch.autograd.Function whose
forward is mha_module_forward and whose backward is mha_module_backward (which recomputes the
forward from the saved inputs and weights).  Both take float32, bfloat16 and float16 tensors
as they are (widened as they are read): the output comes in query's dtype and each gradient
in its tensor's, written by the library (rounded once), so autograd converts nothing.

Imported by mha._functional only when a tensor that requires grad reaches it while autograd
is on, so torch is imported only where the caller already has.
"""
import weakref

import torch

from ._functional import LibraryModule
from ._once import once_differentiable
from ._saved import save_inputs, saved_inputs

# Arguments that never have a gradient: a tensor of them that requires grad is refused.
_NO_GRADIENT = ("key_padding_mask", "attn_mask", "alibi_slopes")

# The dtypes of query, key, value and the weights that take part in autograd (sinks:
# float32 only, as mha_module_forward_params takes them).
_GRADIENT_DTYPES = ("float32", "bfloat16", "float16")


def forward_with_grad(call, library):
    """multi_head_attention_forward's checked call (a mha._functional._Call) recorded for
    autograd; returns (output, weights or None)."""
    differentiable = {**call.inputs, **call.weights, "sinks": call.sinks}
    requiring = [name for name, x in differentiable.items()
                 if isinstance(x, torch.Tensor) and x.requires_grad]
    for name in _NO_GRADIENT:
        x = getattr(call, name)
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise ValueError(f"{name} requires grad, but mha's module has no gradient for it "
                             "(only for query, key, value, the weights, the biases and sinks): "
                             "detach it, or call under torch.no_grad()")
    culprit = requiring[0]  # one of them does: mha._functional came here for it
    if not isinstance(call.query, torch.Tensor):  # the results follow query's framework
        raise TypeError(f"query must be a torch tensor when {culprit} requires grad (the "
                        f"gradients flow through torch's autograd), not "
                        f"{type(call.query).__name__}")
    for name, x in differentiable.items():
        if x is None:
            continue
        dtype = str(getattr(x, "dtype", "")).replace("torch.", "")
        # The library computes in float32 on these values and rounds each gradient once
        # into its tensor's dtype; float64 would lose its precision: refused.
        allowed = ("float32",) if name == "sinks" else _GRADIENT_DTYPES
        if dtype not in allowed:
            because = "requires grad" if name == culprit else f"{culprit} requires grad"
            raise TypeError(
                f"{name} is {dtype} and {because}: mha's module computes its gradients in "
                "float32, for float32, bfloat16 and float16 query, key, value and weights "
                "(float32 sinks); convert it, or call under torch.no_grad()")
    names = tuple(differentiable)
    results = _ModuleAttention.apply(_Plan(call, library, names), *differentiable.values())
    if call.need_weights:
        return results
    return results, None


class _Plan:
    """What the Function needs besides its differentiable inputs: the call (its options,
    masks and shapes), the library module and the names of the inputs in order.

    The library module is held weakly: a torch module's (mha.torch.MultiheadAttention's
    cache) lives as long as that module, a call's own is made again for the backward (it
    costs a copy of the weights).  Nothing of the extension is then kept by torch's graph,
    which PyTorch never frees when it is still alive at the interpreter's exit (nanobind
    would report leaked instances)."""

    __slots__ = ("call", "_library", "names")

    def __init__(self, call, library, names):
        self.call = call
        self._library = weakref.ref(library)
        self.names = names

    def library(self):
        library = self._library()
        return library if library is not None else LibraryModule(self.call.config)


class _ModuleAttention(torch.autograd.Function):
    """(out[, weights]) = the module applied to query, key, value with the weights, biases and
    sinks given after them (in plan.names' order, None where missing); the weights are not
    differentiable."""

    @staticmethod
    def forward(ctx, plan, *arrays):
        call = plan.call
        # The output in query's layout (query has E features too): a batch-first module's
        # transposed view gives a batch-first output.  The results in query's dtype (float32,
        # bfloat16 or float16: forward_with_grad checked it), which the library writes
        # rounded once.
        out = torch.empty_like(call.query)
        weights = None
        if call.need_weights:
            weights = call.query.new_empty(call.shapes.weights(call.average_attn_weights))
        inputs = dict(zip(plan.names, arrays))
        library = plan.library()
        call.load(library, _weights_of(call, inputs))
        library.module.forward(*call.forward_arguments(out, weights))
        # (An optimizer step between the forward and the backward is caught.)
        save_inputs(ctx, (), arrays + (call.key_padding_mask, call.attn_mask,
                                       call.alibi_slopes))
        ctx.plan = plan
        if weights is None:
            return out
        ctx.mark_non_differentiable(weights)
        return out, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_weights=None):
        plan = ctx.plan
        call = plan.call
        saved = saved_inputs(ctx, 0)
        count = len(plan.names)
        arrays = dict(zip(plan.names, saved[:count]))
        masks = saved[count:]
        wants = dict(zip(plan.names, ctx.needs_input_grad[1:]))
        inputs = {name: arrays[name] for name in ("query", "key", "value")}
        # Inputs that were one tensor at the forward (self-attention, key = value) are one
        # again: the library sums their gradients into one.
        for name, original in call.inputs.items():
            for other in ("query", "key"):
                if other == name:
                    break
                if call.inputs[other] is original:
                    inputs[name] = inputs[other]
                    break
        wanted = {name for name, want in wants.items() if want}

        def allocate(like, shape):
            # Each gradient in its tensor's dtype, as autograd wants it: the library rounds
            # a half-precision one once (a self-attention input's, the sum).
            if not isinstance(like, torch.Tensor):
                return torch.empty(shape, dtype=torch.float32)
            if tuple(shape) == tuple(like.shape):
                return torch.empty_like(like, memory_format=torch.preserve_format)
            return torch.empty(shape, dtype=like.dtype)

        gradients = call.allocate_gradients(wanted, allocate, inputs, arrays["sinks"])
        library = plan.library()
        call.load(library, _weights_of(call, arrays))
        sinks, slopes = arrays["sinks"], masks[2]
        library.module.backward(*call.backward_arguments(
            grad_out, gradients.library, inputs, (masks[0], masks[1], sinks, slopes)))
        results = dict(gradients.results)
        # An input given again gets its gradient once (the sum, in its first place).
        seen = set()
        for name in ("query", "key", "value"):
            if name in results:
                if id(results[name]) in seen:
                    results[name] = None
                else:
                    seen.add(id(results[name]))
        return (None,) + tuple(results.get(name) for name in plan.names)


def _weights_of(call, arrays):
    """{argument name: array} of the call's weights, taken from `arrays` (the Function's)."""
    return {name: arrays[name] for name in call.weights}
