"""DeepSeek-V4 attention over the paged streams in place (dayzero/ops/attention_v4.py holds the math over
gathered rows): each row is one query token at positions[r] of sequence rows_seq[r] (default: row b is
sequence b's one new token, a decode step), its sequence's entries (this step's included) already
written to the streams; a prompt chunk's rows are consecutive tokens of one sequence.

    paged_v4_index_topk   the CSA indexer's selection over the sequence's compressed index keys:
                          int64 [N, k] entry numbers, best first, -1 padded (a fixed width, so that a
                          captured graph's shapes do not depend on the context)
    paged_v4_attention    the window's keys (tokens max(0, p - window + 1) ... p of the window stream)
                          plus CSA's chosen entries or HCA's visible ones (numbers below (p + 1) // ratio),
                          with the heads' sinks

The references gather each run of rows' keys (PagedStream.gather) and call the gathered ops, so they are
what the kernels (dayzero/kernels/v4/_paged.py) are checked against; they read the positions on the
host (a reference, not a step's path on CUDA)."""

from __future__ import annotations

import torch

from dayzero.ops.attention_v4 import sparse_attention, v4_index_topk, visible_entries
from dayzero.ops.paged import PagedStream
from dayzero.ops.registry import reference_op


def _check_rows(op: str, q: torch.Tensor, positions: torch.Tensor, rows_seq: torch.Tensor | None,
                *streams: PagedStream | None) -> None:
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [N, H, D] (one token a row), got {tuple(q.shape)}")
    if positions.shape != (q.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(f"{op}: positions must be int64 [{q.shape[0]}], got {positions.dtype} {tuple(positions.shape)}")
    if rows_seq is not None and (rows_seq.shape != (q.shape[0],) or rows_seq.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{op}: rows_seq must be int [{q.shape[0]}], got {rows_seq.dtype} {tuple(rows_seq.shape)}")
    for s in streams:
        if s is not None and s.entry_shape[-1] != q.shape[-1]:
            raise ValueError(f"{op}: a stream of entries {s.entry_shape} cannot serve q {tuple(q.shape)}")


def _row_groups(positions: torch.Tensor, rows_seq: torch.Tensor | None) -> list[tuple[int, int, int, int]]:
    """(first row, end row, sequence, first position) of each run of rows of one sequence, whose positions
    must follow one another (a prompt chunk's tokens; a decode is a run of one)."""
    pos = positions.tolist()
    seqs = list(range(len(pos))) if rows_seq is None else rows_seq.tolist()
    groups: list[tuple[int, int, int, int]] = []
    for r, (b, p) in enumerate(zip(seqs, pos)):
        if groups and groups[-1][2] == b and p == pos[r - 1] + 1:
            groups[-1] = (groups[-1][0], r + 1, b, groups[-1][3])
        else:
            if any(g[2] == b for g in groups):
                raise ValueError(f"rows of sequence {b} must be consecutive tokens in one run")
            groups.append((r, r + 1, b, p))
    return groups


@reference_op("paged_v4_index_topk")
def paged_v4_index_topk(q: torch.Tensor, keys: PagedStream, weights: torch.Tensor, positions: torch.Tensor,
                        ratio: int, k: int, rows_seq: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, Di] indexer queries (rotary applied), one token a row; keys the layer's compressed index-key
    stream (rate ratio); weights [N, H]; positions int64 [N]; rows_seq: each row's sequence (its block
    table row; None: row b is sequence b). v4_index_topk of each row over its visible entries (numbers
    below (p + 1) // ratio), as entry numbers int64 [N, k], -1 where fewer are visible."""
    _check_rows("paged_v4_index_topk", q, positions, rows_seq, keys)
    if weights.shape != q.shape[:2]:
        raise ValueError(f"paged_v4_index_topk: weights must be [N, H] = {tuple(q.shape[:2])}, got {tuple(weights.shape)}")
    out = torch.full((q.shape[0], k), -1, dtype=torch.int64, device=q.device)
    for r0, r1, b, p0 in _row_groups(positions, rows_seq):
        n = (p0 + r1 - r0) // ratio  # entries the group's last row sees
        if n == 0:
            continue
        entries = keys.gather(b, 0, n).to(q.dtype)[None]
        pick = v4_index_topk(q[r0:r1][None], entries, weights[r0:r1][None], positions[r0:r1][None], ratio, k)
        out[r0:r1, :pick.shape[-1]] = pick[0]
    return out


@reference_op("paged_v4_attention")
def paged_v4_attention(q: torch.Tensor, window: PagedStream, sinks: torch.Tensor, scale: float, sliding_window: int,
                       positions: torch.Tensor, compressed: PagedStream | None = None,
                       indices: torch.Tensor | None = None, ratio: int | None = None,
                       rows_seq: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D] one token a row, window the layer's window-key stream (rate 1), positions int64 [N];
    compressed the layer's entry stream (rate ratio) or None; indices int64 [N, k] entry numbers (CSA), or
    None for every visible entry (HCA); rows_seq as paged_v4_index_topk's. sparse_attention of each row
    over its keys, [N, H, D] in q's dtype."""
    _check_rows("paged_v4_attention", q, positions, rows_seq, window, compressed)
    if compressed is not None and not ratio:
        raise ValueError("paged_v4_attention: compressed entries need their ratio")
    if indices is not None and (compressed is None or indices.dim() != 2 or indices.shape[0] != q.shape[0]):
        raise ValueError(f"paged_v4_attention: indices must be [N, k] with compressed entries, got "
                         f"{None if indices is None else tuple(indices.shape)}")
    out = torch.empty_like(q)
    for r0, r1, b, p0 in _row_groups(positions, rows_seq):
        last = p0 + r1 - r0 - 1
        kv = window.gather(b, max(0, p0 - sliding_window + 1), last + 1).to(q.dtype)[None]
        comp = idx = pos = None
        n = 0 if compressed is None else (last + 1) // ratio
        if n:
            comp = compressed.gather(b, 0, n).to(q.dtype)[None]
            pos = positions[r0:r1][None]
            if indices is not None:  # never past what each row sees
                seen = visible_entries(positions[r0:r1], ratio)[:, None]
                idx = indices[r0:r1].masked_fill(indices[r0:r1] >= seen, -1)[None]
        out[r0:r1] = sparse_attention(q[r0:r1][None], kv, sinks, scale, sliding_window, comp, idx, pos, ratio)[0]
    return out
