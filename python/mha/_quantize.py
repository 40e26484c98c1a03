"""mha.quantize_kv: a KV cache's rows as int8 with one float32 scale per row."""
from typing import Optional, Tuple

from . import _mha
from ._arrays import Array, array_argument, empty_like_framework, mark_written, shape_of


def quantize_kv(src: Array, *, dst: Optional[Array] = None,
                scale: Optional[Array] = None) -> Tuple[Array, Array]:
    """Quantises keys or values to int8 for scaled_dot_product_attention's int8 KV cache.

    src: [B, Hkv, L, D] (fewer dimensions: leading ones left out), float32,
        bfloat16 or float16, a NumPy array or a PyTorch tensor with any strides;
        every value finite.
    dst, scale: optional arrays to write into -- int8 of src's shape and float32
        [B, Hkv, L] (src's shape without the last dimension); e.g. views of a
        preallocated cache.

    Symmetric, one scale per row: scale = max|row| / 127 (in float32), dst =
    round(src / scale) to nearest, ties to even, so |src - scale * dst| <=
    scale / 2; a row of zeros gets scale 0.  Returns (dst, scale) in src's
    framework; pass them as key/value and k_scale/v_scale.  Raises mha.Error
    (naming src, dst or scale) when the library refuses the arrays, e.g. a
    NaN or an infinity in src.
    """
    src = array_argument(src, "src")
    shape = shape_of(src)
    dst = empty_like_framework(src, shape, "int8") if dst is None else array_argument(dst, "dst")
    if scale is None:
        scale = empty_like_framework(src, shape[:-1], "float32")
    else:
        scale = array_argument(scale, "scale")
    _mha.quantize_kv(src, dst, scale)
    mark_written(dst, scale)
    return dst, scale
