"""PyTorch's broadcasting of query's, key's and value's leading dimensions for
scaled_dot_product_attention: a key and value shared by every batch entry (batch 1), or one
key/value head shared by every query head without enable_gqa, as torch's math path computes
them.  The library takes equal leading dimensions and reads a stride-0 dimension in place,
so broadcasting is a view (torch's expand, NumPy's broadcast_to): nothing is copied, and
under autograd expand's backward sums the gradients over the broadcast dimensions.

Only the calls the library refuses come here (mha._attention retries with the views), so
the common call pays nothing for it."""
import numpy as np

from ._arrays import is_torch_tensor


def broadcast_leading(query, key, value, enable_gqa):
    """(query, key, value) with the dimensions before the last two broadcast to one shape --
    key's and value's heads (the third dimension from the end) kept where enable_gqa groups
    them --, or None when nothing would change, when they do not broadcast, or for arrays
    that are neither torch tensors nor NumPy arrays (the library's refusal then stands)."""
    arrays = (query, key, value)
    if not all(is_torch_tensor(x) or isinstance(x, np.ndarray) for x in arrays):
        return None
    shapes = [tuple(x.shape) for x in arrays]
    if any(not 2 <= len(s) <= 4 for s in shapes):
        return None
    rank = max(len(s) for s in shapes) - 2
    lead = [(1,) * (rank - len(s) + 2) + s[:-2] for s in shapes]
    targets = [[], [], []]
    for i in range(rank):
        if enable_gqa and i == rank - 1:
            # Heads: query's its own; key's and value's one count between the two.
            kv = {lead[1][i], lead[2][i]} - {1}
            if len(kv) > 1:
                return None
            kv_heads = kv.pop() if kv else 1
            sizes = (lead[0][i], kv_heads, kv_heads)
        else:
            common = {x[i] for x in lead} - {1}
            if len(common) > 1:
                return None
            size = common.pop() if common else 1
            sizes = (size, size, size)
        for target, size in zip(targets, sizes):
            target.append(size)
    views = []
    for x, shape, target in zip(arrays, shapes, targets):
        full = tuple(target) + shape[-2:]
        if full == shape:
            views.append(x)
        elif is_torch_tensor(x):
            views.append(x.expand(full))
        else:
            views.append(np.broadcast_to(x, full))
    if all(v is x for v, x in zip(views, arrays)):
        return None
    return tuple(views)
