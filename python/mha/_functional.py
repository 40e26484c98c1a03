"""mha.multi_head_attention_forward and mha.multi_head_attention_backward: PyTorch's
torch.nn.functional.multi_head_attention_forward computed by mha's module (mha_module_forward),
and its gradients (mha_module_backward).

Each call makes a library module of the call's configuration and copies the weights into it
(O(E²), against the O(B·L·E²) of the projections); mha.torch.MultiheadAttention keeps one per
torch module instead and copies its parameters again only when they have changed.
"""
import functools
import threading
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _mha
from ._arguments import activations_argument, flag, integer, real
from ._attention import _NO_WINDOW, _dropout_seed, _grad_wanted, _window_argument
from ._arrays import (Array, array_argument, empty_like_framework, half_dtype, is_torch_tensor,
                      optional_array_argument, output_dtype, shape_of, torch_module, widened)
from ._module import _ForwardShapes
from ._state_dict import float32_copy

# The gradients of mha_module_gradients the in-projection's weights map to, by rows of E.
_IN_PROJ_ROWS = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
_IN_BIAS_ROWS = ("q_proj_bias", "k_proj_bias", "v_proj_bias")


def multi_head_attention_forward(
        query: Array, key: Array, value: Array, embed_dim_to_check: int, num_heads: int,
        in_proj_weight: Optional[Array], in_proj_bias: Optional[Array],
        bias_k: Optional[Array], bias_v: Optional[Array], add_zero_attn: bool,
        dropout_p: float, out_proj_weight: Array, out_proj_bias: Optional[Array],
        training: bool = True, key_padding_mask: Optional[Array] = None,
        need_weights: bool = True, attn_mask: Optional[Array] = None,
        use_separate_proj_weight: bool = False, q_proj_weight: Optional[Array] = None,
        k_proj_weight: Optional[Array] = None, v_proj_weight: Optional[Array] = None,
        static_k: Optional[Array] = None, static_v: Optional[Array] = None,
        average_attn_weights: bool = True, is_causal: bool = False, *,
        dropout_seed: Optional[int] = None, window_size: Tuple[int, int] = _NO_WINDOW,
        sinks: Optional[Array] = None, softcap: float = 0.0,
        alibi_slopes: Optional[Array] = None,
        activations: str = "float32") -> Tuple[Array, Optional[Array]]:
    """(output, attention weights or None), as torch.nn.functional.multi_head_attention_forward.

    PyTorch's arguments, names, positions and shapes (sequence-first, as
    PyTorch's function: query [L, B, E], key [S, B, kdim], value [S, B,
    vdim], or unbatched [L, E], [S, kdim], [S, vdim]); NumPy arrays or
    PyTorch tensors (any strides, read in place), float32, bfloat16 or
    float16 (half-precision values computed in float32: widened as the
    library's projections read them, with or without autograd; see
    Returns):

    embed_dim_to_check: E, query's features; num_heads: H, dividing E.
    in_proj_weight [3E, E], in_proj_bias [3E] or None: the stacked
        projections of query, key and value (rows 0..E-1, E..2E-1, 2E..3E-1);
        with use_separate_proj_weight, q_proj_weight [E, E], k_proj_weight
        [E, kdim] and v_proj_weight [E, vdim] instead (in_proj_weight is then
        ignored, as by PyTorch).
    out_proj_weight [E, E], out_proj_bias [E] or None.
    bias_k, bias_v, static_k, static_v must be None and add_zero_attn False:
        mha's module has none of them (NotImplementedError).
    dropout_p: the probability of dropping an attention weight when training
        (PyTorch's default training=True): mha's counter-based rule with
        dropout_seed (None draws one from Python's `random`), so the same
        seed drops the same weights for any thread count and backend, and
        the backward drops them again.
    key_padding_mask: [B, S] ([S] unbatched), bool (True = the key is
        ignored) or float32 or query's dtype (added to the scores).
    attn_mask: [L, S] or [B*H, L, S], bool (True = not allowed) or float32
        or query's dtype (added).
    need_weights: also return the attention weights (after dropout, as
        PyTorch's), [B, L, S] averaged over the heads (average_attn_weights)
        or [B, H, L, S]; that path materialises them, need_weights=False is
        the fused one.
    is_causal: query i sees keys j <= i.  Unlike PyTorch (where it is a hint
        that attn_mask is causal), mha applies the causal mask itself; an
        attn_mask given with it applies too.

    mha's own, keyword-only: dropout_seed (above), and the attention variants
    of MultiheadAttention.forward: window_size=(left, right), sinks [H]
    (their gradient too), softcap, alibi_slopes [H] or [B, H]; and
    activations: "float32" (the default: a half-precision call computes in
    float32 on its values, rounding only its results) or "input" (its
    projections Q, K, V and the heads' outputs rounded to query's dtype, the
    attention run on them in that dtype: what PyTorch's module computes in
    bfloat16, and on AMX CPUs about twice as fast; float32 queries ignore
    it).  The gradients are the float32 activations' either way.

    Gradients: on torch tensors, while autograd is on, a query, key, value,
    weight, bias or sinks that requires grad makes the call go through a
    torch.autograd.Function whose backward is mha_module_backward: the
    forward (projections and attention) is recomputed there from the saved
    inputs and weights (activation checkpointing: nothing of size L x S is
    kept), dropout's mask regenerated from the seed the forward used.  The
    same tensor as query, key and value (self-attention), or as key and value,
    gets the sum of its gradients, as in PyTorch.  The attention weights of
    need_weights=True are not differentiable (the output is).  Query, key,
    value and the weights may be float32, bfloat16 or float16 then (each
    gradient in its tensor's dtype, rounded once), sinks float32 (TypeError
    otherwise: float64 would lose its precision); a float mask or alibi_slopes that requires grad is refused (ValueError:
    they have no gradient).  No second derivatives.

    Returns (output [L, B, E] or [L, E], weights or None), float32 -- or
    query's dtype when it is a bfloat16 or float16 tensor or a float16 NumPy
    array --, in query's
    framework.  Raises ValueError for shapes PyTorch refuses (naming
    the argument), TypeError for arguments of the wrong type (a dtype mha has
    no name for, such as float64, included), mha.Error when the library
    refuses the call (a dtype it does not take there, such as a float16 mask
    for a bfloat16 query, ...).
    """
    call = _Call(query, key, value, embed_dim_to_check, num_heads, in_proj_weight,
                 in_proj_bias, bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight,
                 out_proj_bias, training, key_padding_mask, attn_mask,
                 use_separate_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight,
                 static_k, static_v, is_causal, window_size, sinks, softcap, alibi_slopes,
                 activations)
    call.forward_options(need_weights, average_attn_weights, dropout_seed)
    return forward(call, None)



def multi_head_attention_backward(
        grad_output: Array, query: Array, key: Array, value: Array, embed_dim_to_check: int,
        num_heads: int, in_proj_weight: Optional[Array], in_proj_bias: Optional[Array],
        bias_k: Optional[Array], bias_v: Optional[Array], add_zero_attn: bool,
        dropout_p: float, out_proj_weight: Array, out_proj_bias: Optional[Array],
        training: bool = True, key_padding_mask: Optional[Array] = None,
        need_weights: bool = True, attn_mask: Optional[Array] = None,
        use_separate_proj_weight: bool = False, q_proj_weight: Optional[Array] = None,
        k_proj_weight: Optional[Array] = None, v_proj_weight: Optional[Array] = None,
        static_k: Optional[Array] = None, static_v: Optional[Array] = None,
        average_attn_weights: bool = True, is_causal: bool = False, *,
        dropout_seed: Optional[int] = None, window_size: Tuple[int, int] = _NO_WINDOW,
        sinks: Optional[Array] = None, softcap: float = 0.0,
        alibi_slopes: Optional[Array] = None) -> Dict[str, Array]:
    """The gradients of multi_head_attention_forward(query, ...) from grad_output:
    mha_module_backward on NumPy arrays or tensors.

    What torch's autograd calls for multi_head_attention_forward (which needs
    no call of this by hand); here for NumPy arrays and code that keeps its
    own graph.  grad_output: dL/d(output), shaped like the output.  The other
    arguments are exactly the forward call's, so that the same argument list
    serves both (need_weights and average_attn_weights change nothing here):
    the forward is recomputed from them (the projections and the attention;
    memory O((L + S)·E)).  dropout_seed: the forward's seed, required when
    training with dropout_p > 0 (the same weights are dropped again).

    Returns {name: gradient}, float32 arrays in query's framework (also for
    bfloat16 and float16 tensors, computed in float32 on their values), named as
    the forward's arguments: "query", "key", "value", the weights that were
    given ("in_proj_weight", or "q_proj_weight", "k_proj_weight",
    "v_proj_weight"; "out_proj_weight"), the biases that were given
    ("in_proj_bias", "out_proj_bias") and "sinks" with sinks.  When query, key
    and value (or two of them) are the same array, their entries are one
    array holding the sum of their gradients (what autograd gives that
    array).  The results are the same bits for any thread count.  Raises as
    multi_head_attention_forward does; torch tensors that require grad are
    refused while autograd is on (call under torch.no_grad()).
    """
    call = _Call(query, key, value, embed_dim_to_check, num_heads, in_proj_weight,
                 in_proj_bias, bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight,
                 out_proj_bias, training, key_padding_mask, attn_mask,
                 use_separate_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight,
                 static_k, static_v, is_causal, window_size, sinks, softcap, alibi_slopes)
    flag(need_weights, "need_weights")
    flag(average_attn_weights, "average_attn_weights")
    call.backward_seed(dropout_seed)
    grad_output = array_argument(grad_output, "grad_output")
    grad_output = _dout(grad_output, call.query)
    if shape_of(grad_output) != call.shapes.out:
        raise ValueError(f"grad_output has shape {list(shape_of(grad_output))}; it must be the "
                         f"output's, {list(call.shapes.out)}")
    library = LibraryModule(call.config)
    wanted = {*call.inputs, *call.weights, "sinks"}
    gradients = call.allocate_gradients(wanted, lambda like, shape: empty_like_framework(
        call.query, shape, "float32"))
    call.load(library)
    library.module.backward(*call.backward_arguments(grad_output, gradients.library))
    return gradients.results


def _dout(grad_output, query):
    """grad_output as mha_module_backward takes its dout (float32 or query's dtype, a
    half-precision one widened as it is read): as it is, or widened when it has another
    half-precision dtype than query's (which that call refuses)."""
    dtype = half_dtype(grad_output)
    return grad_output if dtype is None or dtype == half_dtype(query) else widened(grad_output)


def forward(call, cache):
    """The forward of a checked call, through mha's autograd.Function when a tensor requires
    grad; with the library module `cache` holds (a ModuleCache), or a new one when None."""
    library = LibraryModule(call.config) if cache is None else cache.get(call.config)
    if _grad_wanted(*call.inputs.values(), *call.weights.values(), call.sinks,
                    call.key_padding_mask, call.attn_mask, call.alibi_slopes):
        from ._module_autograd import forward_with_grad
        return forward_with_grad(call, library)
    # Half-precision inputs are read in place and the results written in query's dtype
    # (mha_module_forward widens and rounds once), as the autograd.Function does too.
    dtype = output_dtype(call.query)
    out = empty_like_framework(call.query, call.shapes.out, dtype)
    weights = None
    if call.need_weights:
        weights = empty_like_framework(
            call.query, call.shapes.weights(call.average_attn_weights), dtype)
    call.load(library)
    library.module.forward(*call.forward_arguments(out, weights))
    return out, weights


class _Call:
    """The arguments of multi_head_attention_forward (and _backward), checked with
    PyTorch's rules (ValueError, TypeError or NotImplementedError naming the argument), as the
    extension takes them."""

    def __init__(self, query, key, value, embed_dim_to_check, num_heads, in_proj_weight,
                 in_proj_bias, bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight,
                 out_proj_bias, training, key_padding_mask, attn_mask,
                 use_separate_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight,
                 static_k, static_v, is_causal, window_size, sinks, softcap, alibi_slopes,
                 activations="float32"):
        query = array_argument(query, "query")
        key = array_argument(key, "key")
        value = array_argument(value, "value")
        self.inputs = {"query": query, "key": key, "value": value}
        self.query = query
        e = integer(embed_dim_to_check, "embed_dim_to_check", 1)
        h = integer(num_heads, "num_heads", 1)
        if e % h != 0:
            raise ValueError(f"embed_dim_to_check ({e}) must be a multiple of num_heads ({h})")
        for name, x in (("bias_k", bias_k), ("bias_v", bias_v), ("static_k", static_k),
                        ("static_v", static_v)):
            if x is not None:
                raise NotImplementedError(f"{name} must be None: mha's module has no {name} "
                                          "(add_bias_kv and static keys are not implemented)")
        if flag(add_zero_attn, "add_zero_attn"):
            raise NotImplementedError("add_zero_attn=True: mha's module does not append a batch "
                                      "of zeros to key and value")
        dropout_p = real(dropout_p, "dropout_p")
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), not {dropout_p}")
        self.training = flag(training, "training")
        self.dropout_p = dropout_p
        separate = flag(use_separate_proj_weight, "use_separate_proj_weight")
        q, k, v = shape_of(query), shape_of(key), shape_of(value)
        if q[-1:] != (e,):
            raise ValueError(f"query has {q[-1] if q else 0} features (shape {list(q)}) but "
                             f"embed_dim_to_check is {e}")

        weights = {}
        if separate:
            kdim, vdim = k[-1] if k else 0, v[-1] if v else 0
            given = {"q_proj_weight": (q_proj_weight, (e, e), "[E, E]"),
                     "k_proj_weight": (k_proj_weight, (e, kdim), "[E, key's features]"),
                     "v_proj_weight": (v_proj_weight, (e, vdim), "[E, value's features]")}
            for name, (x, shape, what) in given.items():
                if x is None:
                    raise ValueError(f"use_separate_proj_weight is True but {name} is None")
                weights[name] = _weight(x, name, shape, what)
        else:
            if shape_of(key) != shape_of(value):
                raise ValueError(f"key shape {list(k)} does not match value shape {list(v)} "
                                 "(they may differ only with use_separate_proj_weight=True)")
            if in_proj_weight is None:
                raise ValueError("use_separate_proj_weight is False but in_proj_weight is None")
            kdim = vdim = e
            if k[-1:] != (e,):
                raise ValueError(f"key has {k[-1] if k else 0} features (shape {list(k)}) but "
                                 f"in_proj_weight projects {e} (pass use_separate_proj_weight="
                                 "True with k_proj_weight and v_proj_weight for other sizes)")
            weights["in_proj_weight"] = _weight(in_proj_weight, "in_proj_weight", (3 * e, e),
                                                "[3E, E]")
        if in_proj_bias is not None:
            weights["in_proj_bias"] = _weight(in_proj_bias, "in_proj_bias", (3 * e,), "[3E]")
        if out_proj_weight is None:
            raise ValueError("out_proj_weight is None; the output projection is required")
        weights["out_proj_weight"] = _weight(out_proj_weight, "out_proj_weight", (e, e), "[E, E]")
        if out_proj_bias is not None:
            weights["out_proj_bias"] = _weight(out_proj_bias, "out_proj_bias", (e,), "[E]")
        self.weights = weights
        self.separate = separate
        self.embed_dim = e
        self.num_heads = h
        # The library's module: one bias flag for both projections (a missing one is zeros).
        bias = in_proj_bias is not None or out_proj_bias is not None
        self.config = (e, h, kdim, vdim, bias, dropout_p, activations_argument(activations))

        self.key_padding_mask = optional_array_argument(key_padding_mask, "key_padding_mask")
        self.attn_mask = optional_array_argument(attn_mask, "attn_mask")
        geometry = _Geometry(e, h, kdim, vdim)
        self.shapes = _ForwardShapes(geometry, query, key, value, self.key_padding_mask,
                                     self.attn_mask)
        self.is_causal = flag(is_causal, "is_causal")
        self.window = _window_argument(window_size)
        self.sinks = optional_array_argument(sinks, "sinks")
        self.softcap = real(softcap, "softcap")
        self.alibi_slopes = optional_array_argument(alibi_slopes, "alibi_slopes")
        self.need_weights = False
        self.average_attn_weights = True
        self.dropout_seed = 0

    @property
    def dropout(self):
        """Whether the call drops weights."""
        return self.training and self.dropout_p > 0.0

    def forward_options(self, need_weights, average_attn_weights, dropout_seed):
        self.need_weights = flag(need_weights, "need_weights")
        self.average_attn_weights = flag(average_attn_weights, "average_attn_weights")
        self.dropout_seed = _dropout_seed(dropout_seed, self.dropout_p if self.training else 0.0)

    def backward_seed(self, dropout_seed):
        if dropout_seed is None:
            if self.dropout:
                raise ValueError("dropout_seed is required when training with dropout_p > 0: "
                                 "pass the forward call's seed, so that the same weights are "
                                 "dropped")
            dropout_seed = 0
        self.dropout_seed = integer(dropout_seed, "dropout_seed", 0, 2**64 - 1)

    def load(self, library, weights=None):
        """Gives the library module `weights` ({argument name: array}; default: the call's)
        under its names (_library_weight); a bias missing beside the other is zeros."""
        weights = self.weights if weights is None else weights
        e = self.embed_dim
        given = {}
        for name, x in weights.items():
            given["out_proj." + name[9:] if name.startswith("out_proj_") else name] = \
                _library_weight(x, name)
        zeros = {}
        if self.config[4]:  # a module with biases
            for name, size in (("in_proj_bias", 3 * e), ("out_proj.bias", e)):
                if name not in given:
                    zeros[name] = np.zeros(size, np.float32)
        library.load(given, zeros)

    def _options(self):
        left, right = self.window
        return (self.is_causal, self.shapes.batched, self.dropout, self.dropout_seed, left,
                right, self.sinks, self.softcap, self.alibi_slopes)

    def forward_arguments(self, out, weights, inputs=None):
        """_mha.Module.forward's arguments, writing into out (and weights)."""
        query, key, value = (inputs or self.inputs).values()
        causal, sequence_first, training, seed, left, right, sinks, softcap, slopes = \
            self._options()
        return (query, key, value, out, self.key_padding_mask, self.attn_mask, weights,
                self.average_attn_weights, causal, sequence_first, training, seed, left, right,
                sinks, softcap, slopes)

    def backward_arguments(self, grad_output, gradients, inputs=None, masks=None):
        """_mha.Module.backward's arguments."""
        query, key, value = (inputs or self.inputs).values()
        key_padding_mask, attn_mask, sinks, slopes = masks or (
            self.key_padding_mask, self.attn_mask, self.sinks, self.alibi_slopes)
        causal, sequence_first, training, seed, left, right, _, softcap, _ = self._options()
        return (query, key, value, grad_output, key_padding_mask, attn_mask, causal,
                sequence_first, training, seed, left, right, sinks, softcap, slopes, gradients)

    def allocate_gradients(self, wanted, allocate, inputs=None, sinks=None):
        """The gradients of the names in `wanted` (the forward's argument names), allocated by
        allocate(like, shape): _Gradients with the library's dict and the results by name."""
        inputs = inputs or self.inputs
        sinks = self.sinks if sinks is None else sinks
        e = self.embed_dim
        library, results = {}, {}
        # One array for inputs that are one array (self-attention, key = value): the
        # library sums their gradients into it.
        for name, x in inputs.items():
            if name not in wanted:
                continue
            shared = next((other for other, y in inputs.items()
                           if y is x and other in results), None)
            results[name] = results[shared] if shared else allocate(x, shape_of(x))
            library[name] = results[name]
        packed = {"in_proj_weight": (_IN_PROJ_ROWS, (3 * e, e)),
                  "in_proj_bias": (_IN_BIAS_ROWS, (3 * e,))}
        for name, x in self.weights.items():
            if name not in wanted:
                continue
            if name in packed:
                rows, shape = packed[name]
                results[name] = allocate(x, shape)
                for i, row_name in enumerate(rows):
                    library[row_name] = results[name][i * e:(i + 1) * e]
            else:
                results[name] = library[name] = allocate(x, shape_of(x))
        if "sinks" in wanted and sinks is not None:
            results["sinks"] = library["sinks"] = allocate(sinks, shape_of(sinks))
        return _Gradients(library, results)


class _Gradients:
    __slots__ = ("library", "results")

    def __init__(self, library, results):
        self.library = library
        self.results = results


class _Geometry:
    """The sizes _ForwardShapes checks a call against (a module's, or the call's)."""

    def __init__(self, embed_dim, num_heads, kdim, vdim):
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.kdim = kdim
        self.vdim = vdim
        self.batch_first = False  # PyTorch's function is sequence-first


def _weight(x, name, shape, what):
    x = array_argument(x, name)
    if shape_of(x) != shape:
        raise ValueError(f"{name} has shape {list(shape_of(x))}; it must be {what} = "
                         f"{list(shape)}")
    return x


def _library_weight(x, name):
    """A weight as the library module reads it: float32, bfloat16 and float16 arrays as they
    are (any strides; a tensor detached; mha_module_set_weight widens a half-precision one
    exactly into the module's float32 copy), other floating dtypes rounded to a float32
    copy."""
    if is_torch_tensor(x):
        torch = torch_module()
        if x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return x.detach()
        return float32_copy(x, name)
    if isinstance(x, np.ndarray) and x.dtype in (np.float32, np.float16):
        return x
    return float32_copy(x, name)


class LibraryModule:
    """An _mha.Module of one configuration (embed_dim, num_heads, kdim, vdim, bias, dropout)
    and which weights it holds: load() copies them again only when they may differ."""

    def __init__(self, config):
        self.config = config
        self.module = _mha.Module(*config)
        self._lock = threading.Lock()
        self._key = None
        # The tensors of _key, kept so that their memory cannot hold other tensors while
        # the key names its address.
        self._pinned = None

    def load(self, weights, zeros):
        """Sets weights {state_dict name: array} and zeros (the same, all zeros) unless the
        module holds them already: the same torch tensors (memory, layout, dtype) not
        changed in place since (their version counter).  Arrays without a version (NumPy's)
        are always copied."""
        key = _weights_key(weights, zeros)
        with self._lock:
            if key is None or key != self._key:
                self.module.set_weights({**weights, **zeros})
                self._key = key
                self._pinned = list(weights.values()) if key is not None else None


def _weights_key(weights, zeros):
    torch = torch_module()
    if torch is None:
        return None
    key = [(name, "zeros") for name in zeros]
    for name, x in weights.items():
        if not isinstance(x, torch.Tensor):
            return None
        key.append((name, x.data_ptr(), x._version, tuple(x.shape), x.stride(), x.dtype,
                    _sample_of(x)))
    return tuple(key)


# Elements of a weight in the key: writes through a parameter's .data (manual SGD, an EMA,
# an init) bypass its version counter, and one that changes most elements changes these.
_SAMPLED = 16


@functools.lru_cache(maxsize=64)
def _sample_positions(size):
    return np.random.default_rng(size).integers(0, size, min(size, _SAMPLED))


def _sample_of(x):
    torch = torch_module()
    if x.numel() == 0:
        return None
    if x.dtype in (torch.bfloat16, torch.float16):  # their bits (NumPy has no bfloat16)
        values = x.detach().view(torch.int16).numpy()
    elif x.dtype == torch.float32:
        values = x.detach().numpy()
    else:
        return None
    return values.flat[_sample_positions(values.size)].tobytes()


class ModuleCache:
    """The library module of a torch module (mha.torch.MultiheadAttention): made again when
    the configuration changes (dropout is part of it).  Copies and pickles as an empty
    cache."""

    def __init__(self):
        self._lock = threading.Lock()
        self._module = None

    def get(self, config):
        with self._lock:
            if self._module is None or self._module.config != config:
                self._module = LibraryModule(config)
            return self._module

    def __reduce__(self) -> Any:
        return ModuleCache, ()
