"""DeepSeek Sparse Attention kernels (DSA, DeepSeek-V3.2) registered beside the reference ops for CUDA;
importing this package imports no Triton.

    _index    paged_index_topk "triton": the lightning indexer's scores read from the paged index keys
              in place, one program per (query row, key block), then the reference's ranked top-k
    _topk     the top-k of the scores' order keys as positions (torch.topk), shared with DeepSeek-V4
"""

from __future__ import annotations

import torch

from dayzero.kernels.devices import triton_cuda
from dayzero.ops.paged import FP8_GROUP, PagedStream, SeqBatch
from dayzero.ops.registry import REGISTRY

PRIORITY = 10  # above the reference
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEADS, MAX_DIM = 128, 256  # one [keys, heads] score tile and one [keys, dim] key tile a program


def supports_paged_index_topk(q, weights, index_k, scale, k, seqs) -> bool:
    """q [N, H, D] with a contiguous last dim, weights [N, H], an index-key stream of [D] entries one per
    token (q's dtype, or FP8 with scales), k >= 1; else the reference runs (and raises what is wrong)."""
    if not (isinstance(q, torch.Tensor) and isinstance(index_k, PagedStream) and isinstance(seqs, SeqBatch)):
        return False
    if q.dim() != 3 or q.dtype not in DTYPES or not q.is_cuda or q.stride(-1) != 1 or q.shape[0] != seqs.num_tokens:
        return False
    n, h, d = q.shape
    data = index_k.data
    stream_ok = (data.dim() == 3 and data.shape[2] == d and data.stride(2) == 1 and index_k.rate == 1
                 and index_k.per_block == index_k.block_size and data.device == q.device
                 and index_k.block_table.dtype == torch.int32 and index_k.block_table.stride(1) == 1
                 and index_k.block_table.shape[0] >= seqs.num_seqs
                 and index_k.block_table.shape[1] * index_k.block_size >= seqs.max_seq_len)
    if index_k.scales is None:
        stream_ok = stream_ok and data.dtype == q.dtype
    else:
        stream_ok = stream_ok and data.dtype == torch.float8_e4m3fn and index_k.scales.dtype == torch.float32 \
            and tuple(index_k.scales.shape) == (*data.shape[:2], -(-d // FP8_GROUP))
    return (stream_ok and isinstance(weights, torch.Tensor) and weights.shape == (n, h) and weights.is_cuda
            and weights.is_floating_point() and h <= MAX_HEADS and d <= MAX_DIM and isinstance(k, int) and k >= 1
            and min(seqs.context_lens, default=0) >= 0)


def paged_index_topk(q, weights, index_k, scale, k, seqs):
    from dayzero.kernels.dsa import _index

    return _index.paged_index_topk(q, weights, index_k, scale, k, seqs)


REGISTRY.register_kernel("paged_index_topk", paged_index_topk, backend="triton", devices=["cuda"],
                         priority=PRIORITY, available=triton_cuda, supports=supports_paged_index_topk)
