"""The prefill sequences of a paged GQA step on torch's FlashAttention-2 (`aten::_flash_attention_forward`,
varlen, bottom-right causal, sliding window, grouped kv heads), the library kernel beside our Triton one
(_gqa_prefill.py): FA2 reads contiguous K/V, so each sequence's keys from the first one its queries can
see (0, or the first query's window start) to its end are gathered from the pages first (FP8 streams
dequantized by the gather); FA2 knows no sinks, so they join the denominator afterwards from its
log-sum-exp: o * S / (S + e^sink) = o * sigmoid(lse - sink). The gather's indices come from the step's
device tensors and host sizes only (no host sync, no host-to-device copy)."""

from __future__ import annotations

import torch

from dayzero.kernels.devices import capability
from dayzero.ops.paged import PagedStream, SeqBatch

FLASH_DTYPES = (torch.bfloat16, torch.float16)


def available(q: torch.Tensor, k: PagedStream, v: PagedStream) -> bool:
    """Whether FA2 takes these heads on this device: fp16 / bf16, equal k and v dims of at most 256 in
    multiples of 8, sm_80 or newer, torch's flash backend on."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in FLASH_DTYPES and k.entry_shape[1] == v.entry_shape[1] == d and d % 8 == 0
            and d <= 256 and capability(q.device) >= (8, 0)
            and torch.backends.cuda.flash_sdp_enabled() and hasattr(torch.ops.aten, "_flash_attention_forward"))


def _gather(s: PagedStream, first: int, seq: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    pages = s.block_table[first + seq, tok // s.block_size].long()
    return s.read(pages, tok % s.block_size)


def flash_prefill(q: torch.Tensor, k: PagedStream, v: PagedStream, seqs: SeqBatch, scale: float,
                  sliding_window: int | None, sinks: torch.Tensor | None, out: torch.Tensor, first: int) -> None:
    """out rows of sequences first .. num_seqs - 1 (arguments checked by the caller, `available` true)."""
    dev = q.device
    q0 = seqs.query_start_host[first]
    qlens, slens = seqs.query_lens[first:], seqs.seq_lens_host[first:]
    w = sliding_window
    key_starts = [max(0, s - t - w + 1) if w else 0 for t, s in zip(qlens, slens)]
    ktot = sum(s - s0 for s, s0 in zip(slens, key_starts))
    qstart = seqs.query_start[first:]
    seq_lens = seqs.seq_lens[first:].long()
    ctx = seq_lens - (qstart[1:] - qstart[:-1]).long()
    start = (ctx - w + 1).clamp_min(0) if w else torch.zeros_like(ctx)
    cu_k = torch.zeros(len(qlens) + 1, dtype=torch.int64, device=dev)
    torch.cumsum(seq_lens - start, 0, out=cu_k[1:])
    rows = torch.arange(ktot, device=dev)
    seq = torch.searchsorted(cu_k[1:], rows, right=True)
    tok = rows - cu_k[seq] + start[seq]
    keys, values = _gather(k, first, seq, tok), _gather(v, first, seq, tok)
    cu_q = (qstart - q0).int()
    qf = q[q0:]
    if qf.stride(-1) != 1 or qf.stride(1) != qf.shape[-1]:
        qf = qf.contiguous()
    o, lse = torch.ops.aten._flash_attention_forward(
        qf, keys, values, cu_q, cu_k.int(), max(qlens), max(s - s0 for s, s0 in zip(slens, key_starts)), 0.0, True,
        False, scale=scale, window_size_left=w - 1 if w else None, window_size_right=0 if w else None)[:2]
    if sinks is None:
        out[q0:] = o
        return
    if lse.dim() == 2:  # [heads, total_q]
        lse_rows = lse.t()
    else:  # [sequences, heads, max_q]
        r = torch.arange(qf.shape[0], device=dev)
        b = torch.searchsorted(cu_q[1:].long(), r, right=True)
        lse_rows = lse[b, :, r - cu_q[b].long()]
    out[q0:] = (o.float() * torch.sigmoid(lse_rows - sinks.float()[None, :])[..., None]).to(out.dtype)
