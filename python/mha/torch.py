"""mha for PyTorch users: a trainable MultiheadAttention module, and mha's attention as
PyTorch operators.

    mha.torch.MultiheadAttention(embed_dim, num_heads, ...)  # nn.MultiheadAttention's drop-in

is a torch.nn.MultiheadAttention (a subclass: the same constructor, parameters,
initialisation and state_dict) whose forward is mha's module, differentiable
through mha_module_backward (see MultiheadAttention).  ``import mha.torch`` also registers

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
from typing import Any, Optional, Tuple

import torch

from ._attention import _NO_WINDOW, scaled_dot_product_attention
from ._arguments import activations_argument
from ._functional import ModuleCache, _Call, forward
from ._module import _check_device

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


class MultiheadAttention(torch.nn.MultiheadAttention):
    """torch.nn.MultiheadAttention computed by mha's module, trainable.

    A subclass of torch.nn.MultiheadAttention: the same constructor, the same
    nn.Parameters (in_proj_weight or q/k/v_proj_weight, in_proj_bias,
    out_proj), initialised as PyTorch initialises them (the same values after
    the same torch.manual_seed), the same state_dict; isinstance checks for
    torch's class hold.  forward is mha.multi_head_attention_forward over the
    parameters: in training mode (module.train()) dropout applies and, with
    autograd on, loss.backward() fills the parameters' .grad (and the inputs')
    through mha_module_backward, so an optimizer trains it as torch's.

    The library module keeps its own float32 copy of the weights: it is
    copied again only when a parameter has changed (an optimizer step, a
    load_state_dict, a new .data), told by the tensors' version counters.
    add_bias_kv and add_zero_attn raise NotImplementedError; device must be
    the CPU.  bfloat16 and float16 parameters and inputs (module.bfloat16())
    compute in float32 on their values: the results come in query's dtype,
    every gradient in its tensor's, rounded once -- or, with the keyword
    activations="input", with Q, K, V and the heads' outputs rounded to
    query's dtype as torch's module in that dtype keeps them (its attention
    then runs in bfloat16: about twice as fast on AMX CPUs; the gradients
    stay the float32 activations').  float64 parameters
    (module.double()) compute without autograd only (rounded to float32); with
    grad they raise TypeError (their precision would be lost).
    Copies (copy.deepcopy) and pickles (torch.save) are torch's; the
    library module is made again on their first call.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: Optional[int] = None, vdim: Optional[int] = None,
                 batch_first: bool = False, device: Any = None, dtype: Any = None, *,
                 activations: str = "float32") -> None:
        activations_argument(activations)
        if add_bias_kv:
            raise NotImplementedError("add_bias_kv=True: mha's module has no bias_k and bias_v "
                                      "(a learned key and value appended to the sequence)")
        if add_zero_attn:
            raise NotImplementedError("add_zero_attn=True: mha's module does not append a batch "
                                      "of zeros to key and value")
        _check_device(device)
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, kdim=kdim, vdim=vdim,
                         batch_first=batch_first, device=device, dtype=dtype)
        self._mha_cache = ModuleCache()
        self.activations = activations

    def reload_weights(self) -> None:
        """Copies the parameters into the library again at the next call.  Changes made
        through tensor operations (an optimizer step, `load_state_dict`, `with
        torch.no_grad(): p.mul_(...)`) and writes through `.data` that change most of a
        weight are seen without it; a write through `.data` to a few elements may not be."""
        self._mha_cache = ModuleCache()

    @classmethod
    def from_torch(cls, module: Any, *, activations: str = "float32") -> "MultiheadAttention":
        """A copy of `module`, a torch.nn.MultiheadAttention: its constructor's arguments, its
        weights (float32 CPU parameters) and its training mode; activations as in the
        constructor."""
        if not isinstance(module, torch.nn.MultiheadAttention):
            raise TypeError(f"module must be a torch.nn.MultiheadAttention, not "
                            f"{type(module).__name__}")
        result = cls(module.embed_dim, module.num_heads, dropout=module.dropout,
                     bias=module.in_proj_bias is not None,
                     add_bias_kv=module.bias_k is not None,
                     add_zero_attn=bool(module.add_zero_attn), kdim=module.kdim,
                     vdim=module.vdim, batch_first=bool(module.batch_first),
                     activations=activations)
        result.load_state_dict(module.state_dict())
        return result.train(module.training)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False, *, dropout_seed: Optional[int] = None,
                window_size: Tuple[int, int] = _NO_WINDOW, sinks: Optional[torch.Tensor] = None,
                softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(output, attention weights or None), as torch.nn.MultiheadAttention.forward.

        query [L, B, E] (batch_first: [B, L, E]), key [S, B, kdim], value
        [S, B, vdim], or unbatched [L, E], [S, kdim], [S, vdim]; masks,
        need_weights, average_attn_weights and is_causal as in
        mha.multi_head_attention_forward (is_causal applies the causal mask
        itself).  The same tensor as query, key and value (or as key and
        value) is self-attention: its gradient is the sum, as in PyTorch.

        Training: in training mode dropout drops the attention weights by
        mha's counter-based rule with dropout_seed (None: drawn from Python's
        `random`), and the backward regenerates the same mask.  The gradients
        flow to the inputs, the parameters and sinks; the attention weights of
        need_weights=True (PyTorch's default) are computed by the path that
        materialises them and are not differentiable (the output is): pass
        need_weights=False for the fused path when they are not used.

        mha's keywords: dropout_seed, window_size, sinks, softcap and
        alibi_slopes, as in mha.multi_head_attention_forward.
        """
        batch_first = self.batch_first and len(query.shape) == 3
        if batch_first:  # views, with the identities of self-attention kept (as torch)
            if key is value:
                if query is key:
                    query = key = value = query.swapaxes(0, 1)
                else:
                    query, key = (x.swapaxes(0, 1) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.swapaxes(0, 1) for x in (query, key, value))
        separate = not self._qkv_same_embed_dim
        call = _Call(query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight,
                     self.in_proj_bias, self.bias_k, self.bias_v, self.add_zero_attn,
                     self.dropout, self.out_proj.weight, self.out_proj.bias, self.training,
                     key_padding_mask, attn_mask, separate,
                     self.q_proj_weight if separate else None,
                     self.k_proj_weight if separate else None,
                     self.v_proj_weight if separate else None, None, None, is_causal,
                     window_size, sinks, softcap, alibi_slopes,
                     self.__dict__.get("activations", "float32"))
        call.forward_options(need_weights, average_attn_weights, dropout_seed)
        cache = self.__dict__.get("_mha_cache")
        if cache is None:  # a module unpickled from torch's own class
            cache = self._mha_cache = ModuleCache()
        out, weights = forward(call, cache)
        if batch_first:
            out = out.swapaxes(0, 1)
        return out, weights
