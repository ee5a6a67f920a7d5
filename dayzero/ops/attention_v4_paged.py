"""DeepSeek-V4 attention of a decode step over the paged streams in place (dayzero/ops/attention_v4.py
holds the math over gathered rows): row b of the step is sequence b's one new token at positions[b],
its entries (this step's included) already written to the streams.

    paged_v4_index_topk   the CSA indexer's selection over the sequence's compressed index keys:
                          int64 [B, k] entry numbers, best first, -1 padded (a fixed width, so that a
                          captured graph's shapes do not depend on the context)
    paged_v4_attention    the window's keys (tokens max(0, p - window + 1) ... p of the window stream)
                          plus CSA's chosen entries or HCA's visible ones (numbers below (p + 1) // ratio),
                          with the heads' sinks

The references gather each row's keys (PagedStream.gather) and call the gathered ops, so they are
what the kernels (dayzero/kernels/v4/_paged.py) are checked against; they read the positions on the
host (a reference, not a step's path on CUDA)."""

from __future__ import annotations

import torch

from dayzero.ops.attention_v4 import sparse_attention, v4_index_topk, visible_entries
from dayzero.ops.paged import PagedStream
from dayzero.ops.registry import reference_op


def _check_rows(op: str, q: torch.Tensor, positions: torch.Tensor, *streams: PagedStream | None) -> None:
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [B, H, D] (one token a sequence), got {tuple(q.shape)}")
    if positions.shape != (q.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(f"{op}: positions must be int64 [{q.shape[0]}], got {positions.dtype} {tuple(positions.shape)}")
    for s in streams:
        if s is not None and (s.block_table.shape[0] < q.shape[0] or s.entry_shape[-1] != q.shape[-1]):
            raise ValueError(f"{op}: a stream of entries {s.entry_shape} with {s.block_table.shape[0]} table rows "
                             f"cannot serve q {tuple(q.shape)}")


@reference_op("paged_v4_index_topk")
def paged_v4_index_topk(q: torch.Tensor, keys: PagedStream, weights: torch.Tensor, positions: torch.Tensor,
                        ratio: int, k: int) -> torch.Tensor:
    """q [B, H, Di] indexer queries (rotary applied), keys the layer's compressed index-key stream (rate
    ratio), weights [B, H], positions int64 [B]: v4_index_topk of each row over its visible entries
    (numbers below (p + 1) // ratio), as entry numbers int64 [B, k], -1 where fewer are visible."""
    _check_rows("paged_v4_index_topk", q, positions, keys)
    if weights.shape != q.shape[:2]:
        raise ValueError(f"paged_v4_index_topk: weights must be [B, H] = {tuple(q.shape[:2])}, got {tuple(weights.shape)}")
    out = torch.full((q.shape[0], k), -1, dtype=torch.int64, device=q.device)
    for b, p in enumerate(positions.tolist()):
        n = (p + 1) // ratio
        if n == 0:
            continue
        entries = keys.gather(b, 0, n).to(q.dtype)[None]
        pick = v4_index_topk(q[b][None, None], entries, weights[b][None, None], positions[b].view(1, 1), ratio, k)
        out[b, :pick.shape[-1]] = pick.view(-1)
    return out


@reference_op("paged_v4_attention")
def paged_v4_attention(q: torch.Tensor, window: PagedStream, sinks: torch.Tensor, scale: float, sliding_window: int,
                       positions: torch.Tensor, compressed: PagedStream | None = None,
                       indices: torch.Tensor | None = None, ratio: int | None = None) -> torch.Tensor:
    """q [B, H, D], window the layer's window-key stream (rate 1), positions int64 [B]; compressed the
    layer's entry stream (rate ratio) or None; indices int64 [B, k] entry numbers (CSA), or None for
    every visible entry (HCA). sparse_attention of each row over its keys, [B, H, D] in q's dtype."""
    _check_rows("paged_v4_attention", q, positions, window, compressed)
    if compressed is not None and not ratio:
        raise ValueError("paged_v4_attention: compressed entries need their ratio")
    if indices is not None and (compressed is None or indices.dim() != 2 or indices.shape[0] != q.shape[0]):
        raise ValueError(f"paged_v4_attention: indices must be [B, k] with compressed entries, got "
                         f"{None if indices is None else tuple(indices.shape)}")
    out = torch.empty_like(q)
    for b, p in enumerate(positions.tolist()):
        lo = max(0, p - sliding_window + 1)
        kv = window.gather(b, lo, p + 1).to(q.dtype)[None]
        comp = idx = pos = None
        n = 0 if compressed is None else int(visible_entries(positions[b], ratio))
        if n:
            comp = compressed.gather(b, 0, n).to(q.dtype)[None]
            pos = positions[b].view(1, 1)
            if indices is not None:
                idx = indices[b].masked_fill(indices[b] >= n, -1)[None, None]  # never past what is visible
        out[b] = sparse_attention(q[b][None, None], kv, sinks, scale, sliding_window, comp, idx, pos, ratio)[0, 0]
    return out
