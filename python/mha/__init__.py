"""mha: multi-head attention on the CPU, with SIMD kernels chosen for the CPU at hand.

    import mha
    out = mha.scaled_dot_product_attention(q, k, v, is_causal=True)  # as torch's (autograd too)
    out = mha.flash_attn_func(q, k, v, causal=True)                   # FlashAttention-2's [B, L, H, D]
    out = mha.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k)  # FlashAttention-2's varlen
    mha.kv_cache_write(k, v, k_cache, v_cache, slot_mapping)          # vLLM's reshape_and_cache
    out = mha.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                      block_table=table, causal=True)  # a paged KV cache
    attention = mha.MultiheadAttention.from_torch(torch_module)     # nn.MultiheadAttention
    out, weights = attention(x, x, x)
    out, weights = mha.multi_head_attention_forward(x, x, x, 512, 8, ...)  # torch's F. one
    import mha.torch                                                 # torch.ops.mha.sdpa
    layer = mha.torch.MultiheadAttention(512, 8)    # nn.MultiheadAttention, trainable (autograd)

Arrays are NumPy arrays or PyTorch tensors (or any DLPack array) on the
CPU, read in place with their strides; results come back in the caller's
framework.  The compiled library (libmha), its backend plugins and the
extension live together in this package's directory: plugins are loaded
from there, never from elsewhere (unless MHA_PLUGIN_DIR says otherwise).
"""
from ._mha import Error, backends, get_num_threads, info, set_backend, set_num_threads
from ._mha import version as _library_version
from ._attention import scaled_dot_product_attention
from ._backward import scaled_dot_product_attention_backward
from ._flash import flash_attn_func
from ._flash_packed import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                            flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)
from ._functional import multi_head_attention_backward, multi_head_attention_forward
from ._merge import merge_partials
from ._module import MultiheadAttention
from ._paged import flash_attn_with_kvcache, kv_cache_write
from ._quantize import quantize_kv
from ._varlen import flash_attn_varlen_func, varlen_attention

__version__ = _library_version()

__all__ = [
    "Error",
    "MultiheadAttention",
    "backends",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "get_num_threads",
    "info",
    "kv_cache_write",
    "merge_partials",
    "multi_head_attention_backward",
    "multi_head_attention_forward",
    "quantize_kv",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "set_backend",
    "set_num_threads",
    "varlen_attention",
]
