"""The checks every differentiable attention call makes before it records anything for
torch's autograd (ValueError naming the argument)."""
import torch


def requiring_grad(differentiable, without_gradient, have_gradients):
    """The name of the first array of `differentiable` ({name: array}) that requires grad,
    after refusing any of `without_gradient` ({name: array}) that does; have_gradients: the
    arguments that have one, for the message."""
    for name, x in without_gradient.items():
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise ValueError(f"{name} requires grad, but mha has no gradient for it (only for "
                             f"{have_gradients}): detach it, or call under torch.no_grad()")
    return next(name for name, x in differentiable.items()
                if isinstance(x, torch.Tensor) and x.requires_grad)


def refuse_out(out, culprit):
    """out= is refused while `culprit` requires grad, as PyTorch's out= functions refuse it."""
    if out is not None:
        raise ValueError(f"out cannot be given while {culprit} requires grad (PyTorch's "
                         "functions with out= do not support autograd either): leave out=None, "
                         "or call under torch.no_grad()")
