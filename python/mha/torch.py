"""mha's attention as PyTorch operators: ``import mha.torch`` registers

    torch.ops.mha.sdpa(query, key, value, attn_mask=None, dropout_p=0.0,
                       is_causal=False, scale=None, enable_gqa=False) -> Tensor
    torch.ops.mha.sdpa_with_lse(...same...) -> (Tensor, Tensor)

with torch.nn.functional.scaled_dot_product_attention's arguments and meaning
(see mha.scaled_dot_product_attention; sdpa_with_lse also returns the float32
log-sum-exp [..., L] of each row, which has no gradient).  Each has a CPU
implementation (mha's kernels) and a fake one for meta tensors, which gives
the outputs' shapes and dtypes without computing, as tracing (torch.compile,
torch.export) needs.

On PyTorch 2.4 and later the operators are made with torch.library.custom_op
and register_fake, without a gradient yet (torch refuses their backward; use
mha.scaled_dot_product_attention to train); on older versions with
torch.library.Library's define and impl: CPU, Meta as the fake
implementation, and Autograd, through which the operators have
mha.scaled_dot_product_attention's gradients.  The module exists only where
torch can be imported; importing it twice registers once (Python imports a
module once).
"""
import torch

from ._attention import scaled_dot_product_attention

_ARGUMENTS = ("Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
              "float dropout_p=0.0, bool is_causal=False, float? scale=None, "
              "bool enable_gqa=False")

# The operators' schemas without their names: (arguments) -> results.
SCHEMAS = {
    "sdpa": f"({_ARGUMENTS}) -> Tensor",
    "sdpa_with_lse": f"({_ARGUMENTS}) -> (Tensor, Tensor)",
}


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                        scale, enable_gqa)


def _sdpa_with_lse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
    return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                        scale, enable_gqa, return_lse=True)


def _fake_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    return query.new_empty(query.shape[:-1] + value.shape[-1:])


def _fake_sdpa_with_lse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                        scale=None, enable_gqa=False):
    lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
    return _fake_sdpa(query, key, value), lse


# name: (the CPU implementation, the fake one)
IMPLEMENTATIONS = {
    "sdpa": (_sdpa, _fake_sdpa),
    "sdpa_with_lse": (_sdpa_with_lse, _fake_sdpa_with_lse),
}


def _register(library):
    """Registers the operators through `library` (torch.library); returns which API it
    used, "custom_op" or "Library", and the objects that keep the operators alive."""
    if hasattr(library, "custom_op") and hasattr(library, "register_fake"):
        handles = []
        for name, (implementation, fake) in IMPLEMENTATIONS.items():
            handles.append(library.custom_op(f"mha::{name}", implementation, mutates_args=(),
                                             device_types="cpu", schema=SCHEMAS[name]))
            library.register_fake(f"mha::{name}", fake)
        return "custom_op", handles
    namespace = library.Library("mha", "DEF")
    for name, (implementation, fake) in IMPLEMENTATIONS.items():
        namespace.define(name + SCHEMAS[name])
        namespace.impl(name, implementation, "CPU")
        # The gradient: the Autograd kernel is the same function, which records the
        # call with mha's autograd.Function when an input requires grad (and calls
        # the library directly otherwise); the CPU kernel runs only below autograd.
        # Without it, 1.13's fallthrough would reach the CPU kernel with autograd on
        # (which happens to work); later versions' fallback warns or refuses there.
        namespace.impl(name, implementation, "Autograd")
        # AutogradMeta too: before 2.0 it has no fallthrough to Meta.
        for key in ("Meta", "AutogradMeta"):
            namespace.impl(name, fake, key)
    return "Library", [namespace]


API, _handles = _register(torch.library)
