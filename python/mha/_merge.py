"""mha.merge_partials: results over disjoint key ranges combined by their LSE."""
from typing import Optional, Sequence, Tuple

from . import _mha
from ._arrays import Array, array_argument, empty_like_framework, mark_written, shape_of


def merge_partials(outs: Sequence[Array], lses: Sequence[Array], *, out: Optional[Array] = None,
                   lse: Optional[Array] = None) -> Tuple[Array, Array]:
    """Combines attention results over disjoint key ranges into the result over all keys.

    outs: a list of float32 [B, H, L, Ev] arrays, each the attention of the
        same queries over its own keys; lses: their float32 [B, H, L]
        log-sum-exps (scaled_dot_product_attention(..., return_lse=True)).
    out, lse: optional arrays to write the merged result and log-sum-exp into.

    The parts are combined in list order, so the result is reproducible; a
    row whose parts all have LSE -inf is zeros with LSE -inf.  Returns
    (out, lse) in the framework of outs[0] (NumPy or torch).  Raises
    mha.Error when the library refuses the arrays.
    """
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError("outs and lses must be lists (or tuples) of arrays")
    outs = [array_argument(x, f"outs[{i}]") for i, x in enumerate(outs)]
    lses = [array_argument(x, f"lses[{i}]") for i, x in enumerate(lses)]
    if not outs:
        raise ValueError("outs is empty: merge_partials needs at least one partial result")
    if out is None:
        out = empty_like_framework(outs[0], shape_of(outs[0]), "float32")
    else:
        out = array_argument(out, "out")
    if lse is None:
        lse = empty_like_framework(outs[0], shape_of(outs[0])[:-1], "float32")
    else:
        lse = array_argument(lse, "lse")
    _mha.merge_partials(outs, lses, out, lse)
    mark_written(out, lse)  # (new ones have no history: this changes nothing for them)
    return out, lse
