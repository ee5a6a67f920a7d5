"""DeepSeek-V4 attention kernels registered beside the reference ops (dayzero/ops/attention_v4.py) for
CUDA; importing this package imports no Triton.

    _compressor  kv_compressor "triton": one program per compressed entry, its slots read from the
                 projected tokens in place (CSA's overlapping halves and the carried window included),
                 the per-channel softmax, the pooling and the RMSNorm in one launch (the reference takes
                 about fifty PyTorch ops a call, and a decode step calls it once per compressor)

    _attention   sparse_attention "triton": one program per (query, 16 heads) over the block's gathered
                 rows, an online softmax from the sink logits over the query's window keys, then CSA's
                 chosen or HCA's visible entries (compiled for sm_90 it spills ~400 B a thread at D = 512:
                 to tune once the H200 has timed it)

    _index       v4_index_topk "triton": the CSA indexer's scores reduced over the heads in the kernel as
                 int64 order keys (DSA's), chunked over rows, then torch.topk (dayzero/kernels/dsa/_topk.py)

    _paged       paged_v4_index_topk and paged_v4_attention "triton": a step's query rows (decodes and prompt
                 chunks) read the paged streams in place through their block tables (the same math as
                 _index and _attention), sizes from the launch, lengths from the device: what a captured
                 decode graph needs
"""

from __future__ import annotations

import torch

from dayzero.kernels.devices import triton_cuda
from dayzero.ops.paged import FP8_GROUP
from dayzero.ops.registry import REGISTRY

PRIORITY = 10  # above the reference
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_RATIO, MAX_DIM = 128, 1024  # the compressor's
MAX_HEAD_DIM = 512  # the attention's: one [16 heads, D] query tile a program


def supports_kv_compressor(kv, gate, ape, norm_weight, eps, overlap, prev_kv=None, prev_gate=None) -> bool:
    """Contiguous [B, tokens, C] kv and gate of one dtype, whole windows, float32 ape [ratio, C]; else the
    reference runs (and raises what is wrong)."""
    if not (isinstance(kv, torch.Tensor) and kv.is_cuda and kv.dtype in DTYPES and kv.dim() == 3 and kv.is_contiguous()):
        return False
    if not (isinstance(gate, torch.Tensor) and gate.shape == kv.shape and gate.dtype == kv.dtype and gate.is_contiguous()):
        return False
    if ape.dim() != 2 or ape.dtype != torch.float32 or not ape.is_contiguous() or ape.shape[1] != kv.shape[2]:
        return False
    ratio, c = ape.shape
    d = c // 2 if overlap else c
    if not 1 <= ratio <= MAX_RATIO or d > MAX_DIM or kv.shape[1] % ratio or (overlap and c % 2):
        return False
    if norm_weight.shape != (d,) or not norm_weight.is_contiguous() or not norm_weight.is_cuda:
        return False
    if (prev_kv is None) != (prev_gate is None) or (prev_kv is not None and not overlap):
        return False
    return prev_kv is None or all(t.shape == (kv.shape[0], ratio, c) and t.is_contiguous() and t.is_cuda
                                  for t in (prev_kv, prev_gate))


def supports_sparse_attention(q, kv, sinks, scale, sliding_window, compressed=None, indices=None, positions=None,
                              ratio=None, kv_lens=None, compressed_lens=None) -> bool:
    """Contiguous q [B, T, H, D <= MAX_HEAD_DIM] / kv [B, S, D] / compressed [B, N, D] of one dtype, float32
    sinks, int64 indices (made contiguous), positions and lengths; else the reference runs (and raises what
    is wrong)."""
    if not (isinstance(q, torch.Tensor) and q.is_cuda and q.dtype in DTYPES and q.dim() == 4 and q.is_contiguous()):
        return False
    b, t, h, d = q.shape
    if d > MAX_HEAD_DIM or not (isinstance(kv, torch.Tensor) and kv.dim() == 3 and kv.shape[0] == b and kv.shape[2] == d
                           and kv.shape[1] >= t and kv.dtype == q.dtype and kv.is_contiguous()):
        return False
    if not (sinks.shape == (h,) and sinks.dtype == torch.float32 and sinks.is_contiguous()) or sliding_window < 1:
        return False
    if compressed is not None:
        if compressed.dim() != 3 or compressed.shape[0] != b or compressed.shape[2] != d \
                or compressed.dtype != q.dtype or not compressed.is_contiguous():
            return False
        if indices is not None:
            if indices.dtype != torch.int64 or indices.shape[:2] != (b, t):
                return False
        elif positions is None or positions.dtype != torch.int64 or positions.shape != (b, t) \
                or not positions.is_contiguous() or not ratio:
            return False
    elif indices is not None:
        return False
    return all(x is None or (x.dtype == torch.int64 and x.shape == (b,) and x.is_contiguous())
               for x in (kv_lens, compressed_lens))


def sparse_attention(*args, **kwargs):
    from dayzero.kernels.v4 import _attention

    return _attention.sparse_attention(*args, **kwargs)


MAX_INDEX_HEADS, MAX_INDEX_DIM = 128, 256


def supports_v4_index_topk(q, keys, weights, positions, ratio, k, lens=None) -> bool:
    if not (isinstance(q, torch.Tensor) and q.is_cuda and q.dtype in DTYPES and q.dim() == 4 and q.is_contiguous()):
        return False
    b, t, h, d = q.shape
    return (isinstance(keys, torch.Tensor) and keys.dim() == 3 and keys.shape[0] == b and keys.shape[2] == d
            and keys.dtype == q.dtype and keys.is_contiguous() and weights.shape == (b, t, h)
            and weights.is_floating_point() and weights.is_contiguous() and positions.shape == (b, t)
            and positions.dtype == torch.int64 and positions.is_contiguous() and h <= MAX_INDEX_HEADS
            and d <= MAX_INDEX_DIM and isinstance(k, int) and k >= 1 and int(ratio) >= 1
            and (lens is None or (lens.dtype == torch.int64 and lens.shape == (b,) and lens.is_contiguous())))


def v4_index_topk(*args, **kwargs):
    from dayzero.kernels.v4 import _index

    return _index.v4_index_topk(*args, **kwargs)


def _stream_ok(stream, q, rows_seq=None) -> bool:
    """A stream the paged kernels read: entries [D] of q's dtype, or FP8 read back in q's dtype with float32
    scales [pages, per block, ceil(D / FP8_GROUP)]; rows of unit stride."""
    if stream is None or not stream.data.is_cuda or stream.data.dim() != 3 or stream.data.shape[2] != q.shape[-1]:
        return False
    if stream.data.stride(2) != 1 or stream.block_table.dtype != torch.int32:
        return False
    if rows_seq is None and stream.block_table.shape[0] < q.shape[0]:  # row b reads table row b
        return False
    if stream.scales is None:
        return stream.data.dtype == q.dtype
    sc = stream.scales
    return (stream.data.dtype == torch.float8_e4m3fn and stream.read_dtype == q.dtype and sc.dtype == torch.float32
            and sc.dim() == 3 and sc.shape[:2] == stream.data.shape[:2] and sc.shape[2] == -(-q.shape[-1] // FP8_GROUP)
            and sc.stride(2) == 1)


def _rows_ok(q, positions, rows_seq=None) -> bool:
    return (isinstance(q, torch.Tensor) and q.is_cuda and q.dtype in DTYPES and q.dim() == 3 and q.is_contiguous()
            and positions.dtype == torch.int64 and positions.shape == (q.shape[0],) and positions.is_contiguous()
            and (rows_seq is None or (rows_seq.is_cuda and rows_seq.dtype in (torch.int32, torch.int64)
                                      and rows_seq.shape == (q.shape[0],) and rows_seq.is_contiguous())))


def supports_paged_v4_index_topk(q, keys, weights, positions, ratio, k, rows_seq=None) -> bool:
    return (_rows_ok(q, positions, rows_seq) and _stream_ok(keys, q, rows_seq) and q.shape[1] <= MAX_INDEX_HEADS
            and q.shape[2] <= MAX_INDEX_DIM and weights.shape == q.shape[:2] and weights.is_floating_point()
            and weights.is_contiguous() and isinstance(k, int) and k >= 1 and int(ratio) >= 1)


def supports_paged_v4_attention(q, window, sinks, scale, sliding_window, positions, compressed=None, indices=None,
                                ratio=None, rows_seq=None) -> bool:
    if not (_rows_ok(q, positions, rows_seq) and _stream_ok(window, q, rows_seq) and q.shape[2] <= MAX_HEAD_DIM and sliding_window >= 1):
        return False
    if not (sinks.shape == (q.shape[1],) and sinks.dtype == torch.float32 and sinks.is_contiguous()):
        return False
    if compressed is None:
        return indices is None
    return _stream_ok(compressed, q, rows_seq) and bool(ratio) and (
        indices is None or (indices.dtype == torch.int64 and indices.dim() == 2 and indices.shape[0] == q.shape[0]))


def paged_v4_index_topk(*args, **kwargs):
    from dayzero.kernels.v4 import _paged

    return _paged.paged_v4_index_topk(*args, **kwargs)


def paged_v4_attention(*args, **kwargs):
    from dayzero.kernels.v4 import _paged

    return _paged.paged_v4_attention(*args, **kwargs)


def kv_compressor(*args, **kwargs):
    from dayzero.kernels.v4 import _compressor

    return _compressor.kv_compressor(*args, **kwargs)


REGISTRY.register_kernel("sparse_attention", sparse_attention, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_sparse_attention)
REGISTRY.register_kernel("v4_index_topk", v4_index_topk, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_v4_index_topk)
REGISTRY.register_kernel("kv_compressor", kv_compressor, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_kv_compressor)
REGISTRY.register_kernel("paged_v4_index_topk", paged_v4_index_topk, backend="triton", devices=["cuda"],
                         priority=PRIORITY, available=triton_cuda, supports=supports_paged_v4_index_topk)
REGISTRY.register_kernel("paged_v4_attention", paged_v4_attention, backend="triton", devices=["cuda"],
                         priority=PRIORITY, available=triton_cuda, supports=supports_paged_v4_attention)
