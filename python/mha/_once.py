"""once_differentiable that refuses create_graph=True.

torch's once_differentiable makes a backward's gradients raise when differentiated
again through .backward(), but the error hangs off a new leaf: torch.autograd.grad and
torch.autograd.functional.hessian, which follow only the paths to their inputs, never
reach it and got zeros for the second derivatives.  mha computes none, so a backward
asked to record a graph (create_graph=True) raises at once.
"""
import functools

import torch


def once_differentiable(fn):
    """Runs the backward without recording a graph; refuses create_graph=True."""

    @functools.wraps(fn)
    def wrapper(ctx, *args):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "mha computes no second derivatives: its backward (marked "
                "@once_differentiable) cannot run with create_graph=True")
        return fn(ctx, *args)

    return wrapper
