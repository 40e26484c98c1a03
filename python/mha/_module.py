"""mha.MultiheadAttention: PyTorch's nn.MultiheadAttention for inference, computed by mha."""
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from . import _mha
from ._arguments import activations_argument, flag, integer, real
from ._attention import _window_argument
from ._arrays import (Array, array_argument, empty_like_framework, optional_array_argument,
                      output_dtype, shape_of, torch_module)
from ._state_dict import IncompatibleKeys, checked_weights, weight_shapes


class MultiheadAttention:
    """Multi-head attention as torch.nn.MultiheadAttention computes it in eval mode.

    Project query, key and value (in_proj_weight, or q/k/v_proj_weight when kdim
    or vdim differ from embed_dim, plus in_proj_bias), split into num_heads
    heads, attend, concatenate, project (out_proj).  The constructor takes
    nn.MultiheadAttention's arguments:

    embed_dim: E, a multiple of num_heads; num_heads: H.
    dropout: recorded (state of a module being ported) but never applied:
        this module is for inference, like a PyTorch module in eval mode.
    bias: in_proj_bias and out_proj.bias exist (PyTorch's default).
    add_bias_kv, add_zero_attn: must be False: mha's module has neither
        (NotImplementedError otherwise).
    kdim, vdim: the features of key and value (None: embed_dim).
    batch_first: inputs and output are [B, L, E] (True) or [L, B, E] (False,
        PyTorch's default).
    device: None or the CPU; dtype: None or float32 (the only ones mha's
        module computes in).
    activations (keyword-only, mha's): "float32" (the default) or "input": a
        bfloat16 or float16 query's projections and heads rounded to its
        dtype, as PyTorch's module in that dtype computes
        (mha.multi_head_attention_forward).

    The weights start as zeros: load them with load_state_dict(), or make the
    module with MultiheadAttention.from_torch(torch_module).  The module keeps
    a float32 copy of them for state_dict(); the library keeps its own.
    Several threads may call one module at once (the GIL is released while it
    computes); loading weights waits until no call of the module runs.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: Optional[int] = None, vdim: Optional[int] = None,
                 batch_first: bool = False, device: Any = None, dtype: Any = None, *,
                 activations: str = "float32") -> None:
        embed_dim = integer(embed_dim, "embed_dim", 1)
        num_heads = integer(num_heads, "num_heads", 1)
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be a multiple of num_heads "
                             f"({num_heads})")
        dropout = real(dropout, "dropout")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), not {dropout}")
        if flag(add_bias_kv, "add_bias_kv"):
            raise NotImplementedError("add_bias_kv=True: mha's module has no bias_k and bias_v "
                                      "(a learned key and value appended to the sequence)")
        if flag(add_zero_attn, "add_zero_attn"):
            raise NotImplementedError("add_zero_attn=True: mha's module does not append a batch "
                                      "of zeros to key and value")
        _check_device(device)
        _check_dtype(dtype)
        self._embed_dim = embed_dim
        self._num_heads = num_heads
        self._kdim = embed_dim if kdim is None else integer(kdim, "kdim", 1)
        self._vdim = embed_dim if vdim is None else integer(vdim, "vdim", 1)
        self._bias = flag(bias, "bias")
        self._dropout = dropout
        self.batch_first = flag(batch_first, "batch_first")
        self._shapes = weight_shapes(embed_dim, self._kdim, self._vdim, self._bias)
        self._module = _mha.Module(embed_dim, num_heads, self._kdim, self._vdim, self._bias,
                                   dropout, activations_argument(activations))
        self._weights = {key: np.zeros(shape, dtype=np.float32)
                         for key, shape in self._shapes.items()}

    @property
    def embed_dim(self) -> int:
        """E, the features of query and of the output."""
        return self._embed_dim

    @property
    def num_heads(self) -> int:
        """H, the number of heads."""
        return self._num_heads

    @property
    def head_dim(self) -> int:
        """E / H, the features of one head."""
        return self._embed_dim // self._num_heads

    @property
    def kdim(self) -> int:
        """The features of key."""
        return self._kdim

    @property
    def vdim(self) -> int:
        """The features of value."""
        return self._vdim

    @property
    def dropout(self) -> float:
        """The dropout probability the module was made with (never applied)."""
        return self._dropout

    @classmethod
    def from_torch(cls, module: Any, *, activations: str = "float32") -> "MultiheadAttention":
        """The mha module computing what `module`, a torch.nn.MultiheadAttention, computes
        in eval mode: its constructor's arguments and a float32 copy of its weights;
        activations as in the constructor."""
        torch = torch_module()
        if torch is None or not isinstance(module, torch.nn.MultiheadAttention):
            raise TypeError(f"module must be a torch.nn.MultiheadAttention, not "
                            f"{type(module).__name__}")
        result = cls(module.embed_dim, module.num_heads, dropout=module.dropout,
                     bias=module.in_proj_bias is not None,
                     add_bias_kv=module.bias_k is not None,
                     add_zero_attn=bool(module.add_zero_attn), kdim=module.kdim,
                     vdim=module.vdim, batch_first=bool(module.batch_first),
                     activations=activations)
        result.load_state_dict(module.state_dict())
        return result

    def load_state_dict(self, state_dict: Mapping[str, Array],
                        strict: bool = True) -> IncompatibleKeys:
        """Copies the weights of a PyTorch state_dict (names as nn.MultiheadAttention's,
        values PyTorch tensors or NumPy arrays of a floating dtype, rounded to float32).

        strict: every weight of the module must be there and nothing else (as
        PyTorch's); False loads those present and ignores unknown names.  Every
        entry is checked before any is loaded: TypeError for a value that is not
        a floating-point array, ValueError for a wrong shape or (strict) missing
        or unexpected names, NotImplementedError for bias_k/bias_v.  Returns
        (missing_keys, unexpected_keys), as PyTorch does.
        """
        weights, incompatible = checked_weights(state_dict, self._shapes,
                                                flag(strict, "strict"))
        self._module.set_weights(weights)
        self._weights.update(weights)
        return incompatible

    def eval(self) -> "MultiheadAttention":
        """Returns the module: it always computes as PyTorch's in eval mode (for code that
        calls module.eval() before inference)."""
        return self

    def train(self, mode: bool = True) -> "MultiheadAttention":
        """train(False) returns the module, as eval(); train(True) raises NotImplementedError:
        this module never applies dropout and has no gradients (mha.torch.MultiheadAttention
        is the nn.Module to train)."""
        if flag(mode, "mode"):
            raise NotImplementedError("mha.MultiheadAttention computes in eval mode only (no "
                                      "dropout, no gradients): train with "
                                      "mha.torch.MultiheadAttention")
        return self

    def __getstate__(self) -> Dict[str, Any]:
        """What pickle and copy.deepcopy keep: the constructor's arguments and a copy of the
        weights (the library's module is made again from them)."""
        return {"embed_dim": self._embed_dim, "num_heads": self._num_heads,
                "dropout": self._dropout, "bias": self._bias, "kdim": self._kdim,
                "vdim": self._vdim, "batch_first": self.batch_first,
                "weights": self.state_dict()}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        arguments = {key: value for key, value in state.items() if key != "weights"}
        self.__init__(**arguments)
        self.load_state_dict(state["weights"])

    def state_dict(self) -> Dict[str, np.ndarray]:
        """{name: float32 NumPy array}, copies of the weights, named and ordered as PyTorch's
        nn.MultiheadAttention.state_dict() (torch.from_numpy makes them tensors)."""
        return {key: self._weights[key].copy() for key in self._shapes}

    def forward(self, query: Array, key: Array, value: Array,
                key_padding_mask: Optional[Array] = None, need_weights: bool = True,
                attn_mask: Optional[Array] = None, average_attn_weights: bool = True,
                is_causal: bool = False, *, window_size: Tuple[int, int] = (-1, -1),
                sinks: Optional[Array] = None, softcap: float = 0.0,
                alibi_slopes: Optional[Array] = None) -> Tuple[Array, Optional[Array]]:
        """(output, attention weights or None), as nn.MultiheadAttention.forward in eval mode.

        query [L, B, E] (batch_first: [B, L, E]), key [S, B, kdim], value [S, B,
        vdim] -- or unbatched [L, E], [S, kdim], [S, vdim] -- float32,
        bfloat16 or float16 NumPy arrays or PyTorch tensors with any strides,
        read in place (half-precision values are widened to float32 as the
        library's projections read them: every product is float32), the
        results written in query's dtype, rounded once.
        key_padding_mask: [B, S] ([S] unbatched), bool (True = the key is
            ignored) or float32 or query's dtype (added to the scores).
        need_weights: also return the attention weights, in the output's
            dtype, [B, L, S] averaged over the heads (average_attn_weights) or
            [B, H, L, S] ([L, S] or [H, L, S] unbatched).  This is the path
            that computes the L x S weights; need_weights=False is the fused
            one.
        attn_mask: [L, S] or [B*H, L, S] ([H, L, S] unbatched), bool (True =
            not allowed, PyTorch's convention) or float32 or query's dtype
            (added).
        is_causal: query i sees keys j <= i.  Unlike PyTorch (where it is a hint
            that attn_mask is causal, and needs one), it applies the causal mask
            itself; an attn_mask given with it applies too.

        mha's attention variants, keyword-only, as scaled_dot_product_attention's
        (H = num_heads, B = the batch, L and S the query and key lengths):
        window_size: (left, right), FlashAttention-2's sliding window aligned
            to the bottom-right corner: key j takes part in query i's row iff
            i + S - L - left <= j <= i + S - L + right; -1 leaves a side
            unbounded.
        sinks: float32 [H], per-head logits that join each row's softmax
            denominator without a value row (gpt-oss); -inf is no sink.  The
            weights are then the true probabilities: a row sums to 1 minus the
            sink's share.
        softcap: scores become softcap * tanh(score / softcap) before ALiBi
            and the masks (Gemma 2); 0 is off.
        alibi_slopes: float32 [H] or [B, H]: adds -slope * |i + S - L - j| to
            the scores (FlashAttention-2's convention).

        The output is float32 (or query's half-precision dtype) in query's
        framework (NumPy in, NumPy out; torch in, torch out), shaped like query
        with E features.  Unlike PyTorch, a
        row in which no key takes part gives zero weights (its output is
        out_proj.bias), not NaN.  Raises ValueError for arrays of the wrong rank
        or shape (PyTorch's rules), TypeError for arguments of the wrong type
        (a dtype mha has no name for, such as float64 or uint8, included),
        mha.Error when the library refuses the call (a dtype it does not take
        there, such as an int8 query or a float16 mask for a bfloat16 query, a
        window side below -1, a negative softcap, sinks or slopes of the wrong
        shape or with NaN: the message names them as params->sinks and so on).
        """
        query = array_argument(query, "query")
        key = array_argument(key, "key")
        value = array_argument(value, "value")
        key_padding_mask = optional_array_argument(key_padding_mask, "key_padding_mask")
        attn_mask = optional_array_argument(attn_mask, "attn_mask")
        need_weights = flag(need_weights, "need_weights")
        average_attn_weights = flag(average_attn_weights, "average_attn_weights")
        is_causal = flag(is_causal, "is_causal")
        window_left, window_right = _window_argument(window_size)
        sinks = optional_array_argument(sinks, "sinks")
        softcap = real(softcap, "softcap")
        alibi_slopes = optional_array_argument(alibi_slopes, "alibi_slopes")
        shapes = _ForwardShapes(self, query, key, value, key_padding_mask, attn_mask)
        # Half-precision inputs are read in place (the library widens them to float32 as
        # its projections read them) and the results written in query's dtype, rounded
        # once by the library.
        dtype = output_dtype(query)
        out = empty_like_framework(query, shapes.out, dtype)
        weights = None
        if need_weights:
            weights = empty_like_framework(query, shapes.weights(average_attn_weights), dtype)
        self._module.forward(query, key, value, out, key_padding_mask, attn_mask, weights,
                             average_attn_weights, is_causal,
                             shapes.batched and not self.batch_first, False, 0, window_left,
                             window_right, sinks, softcap, alibi_slopes)
        return out, weights

    __call__ = forward

    def __repr__(self) -> str:
        return (f"mha.MultiheadAttention(embed_dim={self._embed_dim}, "
                f"num_heads={self._num_heads}, kdim={self._kdim}, vdim={self._vdim}, "
                f"bias={self._bias}, batch_first={self.batch_first})")


class _ForwardShapes:
    """PyTorch's shape rules for a forward call (ValueError naming the argument), and the
    shapes of its outputs."""

    def __init__(self, module, query, key, value, key_padding_mask, attn_mask):
        q, k, v = shape_of(query), shape_of(key), shape_of(value)
        if len(q) not in (2, 3):
            raise ValueError(f"query must be 2-D (unbatched [L, E]) or 3-D (batched), has "
                             f"{len(q)} dimensions")
        self.batched = len(q) == 3
        for name, shape in (("key", k), ("value", v)):
            if len(shape) != len(q):
                raise ValueError(f"{name} must have {len(q)} dimensions like query, has "
                                 f"{len(shape)}")
        for name, shape, features in (("query", q, module.embed_dim), ("key", k, module.kdim),
                                      ("value", v, module.vdim)):
            if shape[-1] != features:
                raise ValueError(f"{name} has {shape[-1]} features (shape {list(shape)}) but "
                                 f"the module takes {features}")
        length_axis = 1 if self.batched and module.batch_first else 0
        self.lq, self.lk = q[length_axis], k[length_axis]
        if v[length_axis] != self.lk:
            raise ValueError(f"key and value must have the same length: key has shape "
                             f"{list(k)}, value {list(v)}")
        self.batch = q[1 - length_axis] if self.batched else None
        if self.batched and not k[1 - length_axis] == v[1 - length_axis] == self.batch:
            raise ValueError(f"query, key and value must have the same batch size: shapes "
                             f"{list(q)}, {list(k)}, {list(v)}")
        self.heads = module.num_heads
        self.out = q[:-1] + (module.embed_dim,)
        self._check_masks(key_padding_mask, attn_mask)

    def _check_masks(self, key_padding_mask, attn_mask):
        batch = (self.batch,) if self.batched else ()
        if key_padding_mask is not None and shape_of(key_padding_mask) != batch + (self.lk,):
            raise ValueError(f"key_padding_mask has shape {list(shape_of(key_padding_mask))}; "
                             f"it must be {list(batch + (self.lk,))}")
        if attn_mask is not None:
            mask = shape_of(attn_mask)
            rows = (self.batch if self.batched else 1) * self.heads  # B*H: a mask per head
            allowed = [(self.lq, self.lk), (rows, self.lq, self.lk)]
            if mask not in allowed:
                raise ValueError(f"attn_mask has shape {list(mask)}; it must be "
                                 f"{list(allowed[0])} or {list(allowed[1])}")

    def weights(self, averaged):
        batch = (self.batch,) if self.batched else ()
        heads = () if averaged else (self.heads,)
        return batch + heads + (self.lq, self.lk)


def _check_device(device):
    if device is None:
        return
    # "cpu", "cpu:0" or torch.device("cpu", 0), as torch takes them.
    name = device.split(":")[0] if isinstance(device, str) else getattr(device, "type", None)
    if name != "cpu":
        raise ValueError(f"device must be None or the CPU (mha computes on the CPU), not "
                         f"{device!r}")


def _check_dtype(dtype):
    if dtype is None:
        return
    torch = torch_module()
    if torch is not None and isinstance(dtype, torch.dtype):
        ok = dtype == torch.float32
    else:
        try:
            ok = np.dtype(dtype) == np.float32
        except TypeError:
            ok = False
    if not ok:
        raise ValueError(f"dtype must be None or float32 (mha's module computes in float32), "
                         f"not {dtype!r}")
