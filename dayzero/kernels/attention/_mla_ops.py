"""`paged_mla_attention` "triton": the packed step split on the host tuples into runs of consecutive
decodes (query_len 1: `_mla_decode`, absorbed form) and of consecutive prefills (query_len > 1:
`_mla_prefill`, expanded form); sequences with no query this step are skipped. `paged_sparse_mla_attention`
"triton" (DSA): every query row on the decode kernel over its selected keys. A runner that orders
its decodes first gets one decode launch set and one prefill group. Every split and shape comes from
SeqBatch's host tuples, never from a device value, so a mixed step runs without a host sync.

Importing this module imports no Triton (the kernels' modules are imported at the first call).
`supports` declines, for the reference to run (and raise its errors), any call whose shapes, dtypes or
streams the kernels do not handle.
"""

from __future__ import annotations

import torch

from dayzero.ops.paged import PagedStream, SeqBatch
from dayzero.kernels.devices import triton_cuda

PRIORITY = 10  # above the reference

MAX_LATENT = 512  # the decode kernel holds a [64, latent] float32 accumulator per program
MAX_HEAD_DIM = 256
QUERY_DTYPES = (torch.bfloat16, torch.float16)  # float32 runs on the reference (no fast float32 MMA at 1e-4)
STREAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def runs(query_lens: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """Maximal runs (kind, b0, b1) of consecutive sequences with one query ("decode") or more ("prefill")."""
    out: list[tuple[str, int, int]] = []
    for b, t in enumerate(query_lens):
        kind = "decode" if t == 1 else "prefill" if t > 1 else None
        if kind is not None and out and out[-1][0] == kind and out[-1][2] == b:
            out[-1] = (kind, out[-1][1], b + 1)
        elif kind is not None:
            out.append((kind, b, b + 1))
    return out


def paged_mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_latent: PagedStream, k_pe: PagedStream,
                        w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float, seqs: SeqBatch) -> torch.Tensor:
    """The op (dayzero.ops.attention_mla.paged_mla_attention's contract) on the Triton kernels."""
    from dayzero.kernels.attention._mla_decode import mla_decode
    from dayzero.kernels.attention._mla_prefill import mla_prefill

    out = q_nope.new_empty((q_nope.shape[0], q_nope.shape[1], w_uv.shape[1]))
    for kind, b0, b1 in runs(seqs.query_lens):
        run = mla_decode if kind == "decode" else mla_prefill
        run(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, seqs, b0, b1, out)
    return out


def paged_sparse_mla_attention(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, seqs, indices) -> torch.Tensor:
    """The op (dayzero.ops.attention_mla.paged_sparse_mla_attention's contract) on the decode kernel,
    reading each query row's selected keys through its indices (`_mla_decode.mla_sparse`)."""
    from dayzero.kernels.attention._mla_decode import mla_sparse

    out = q_nope.new_empty((q_nope.shape[0], q_nope.shape[1], w_uv.shape[1]))
    if q_nope.shape[0]:
        mla_sparse(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, seqs, indices, out)
    return out


def _stream_ok(s: PagedStream, num_seqs: int, dim_limit: int) -> bool:
    data, table = s.data, s.block_table
    if s.rate != 1 or data.dim() != 3 or data.shape[-1] > dim_limit or data.stride(-1) != 1:
        return False
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] < num_seqs or table.device != data.device:
        return False
    if data.dtype == torch.float8_e4m3fn:
        sc = s.scales
        return (sc is not None and sc.dtype == torch.float32 and sc.dim() == 3 and sc.stride(-1) == 1
                and sc.shape[:2] == data.shape[:2])
    return s.scales is None and data.dtype in STREAM_DTYPES


def supports_paged_mla(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, seqs) -> bool:
    """Whether the kernels take this call (shapes as the reference checks them, dtypes, stream layouts)."""
    if not (isinstance(kv_latent, PagedStream) and isinstance(k_pe, PagedStream) and isinstance(seqs, SeqBatch)):
        return False
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.dtype not in QUERY_DTYPES or q_pe.dtype != q_nope.dtype:
        return False
    n, h, dn = q_nope.shape
    if q_pe.shape[:2] != (n, h) or n != seqs.num_tokens or q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1:
        return False
    if w_uk.dim() != 3 or w_uv.dim() != 3 or w_uk.shape[:2] != (h, dn) or w_uv.shape[0] != h:
        return False
    c = w_uk.shape[2]
    if w_uv.shape[2] != c or c > MAX_LATENT or max(dn, w_uv.shape[1], q_pe.shape[2]) > MAX_HEAD_DIM:
        return False
    if kv_latent.entry_shape != (c,) or k_pe.entry_shape != (q_pe.shape[2],):
        return False
    return _stream_ok(kv_latent, seqs.num_seqs, MAX_LATENT) and _stream_ok(k_pe, seqs.num_seqs, MAX_HEAD_DIM)


def supports_paged_sparse_mla(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, seqs, indices) -> bool:
    """As supports_paged_mla, and indices int32 [N, K >= 1] on the queries' device, rows contiguous."""
    return (supports_paged_mla(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, seqs)
            and isinstance(indices, torch.Tensor) and indices.dtype == torch.int32 and indices.dim() == 2
            and indices.shape[0] == q_nope.shape[0] and indices.shape[1] >= 1 and indices.stride(1) == 1
            and indices.device == q_nope.device)


def register_mla(registry) -> None:
    """Register the Triton paged_mla_attention for CUDA in `registry` (dayzero.ops.registry.Registry)."""
    registry.register_kernel("paged_mla_attention", paged_mla_attention, backend="triton", devices=["cuda"],
                             priority=PRIORITY, available=triton_cuda, supports=supports_paged_mla)
    registry.register_kernel("paged_sparse_mla_attention", paged_sparse_mla_attention, backend="triton",
                             devices=["cuda"], priority=PRIORITY, available=triton_cuda,
                             supports=supports_paged_sparse_mla)
