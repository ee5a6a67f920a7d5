"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): the lightning indexer and its top-k selection.

The indexer scores every (query, key) pair cheaply with its own small heads; each query then
attends (`sparse_mla_attention`) only to its index_topk best-scoring visible keys. Per query token t
and key token s, with Hi indexer heads of dim Di:
    I[t, s] = sum_h w[t, h] * ReLU(scale * q[t, h] . k[s])
q comes from the MLA query latent (wq_b), k from the layer input (wk, LayerNorm, one key shared by
all indexer heads), w from weights_proj(x) * Hi^-0.5, scale = Di^-0.5; the first qk_rope_head_dim
dims of q and k are rotated with the NON-interleaved (half-split) RoPE layout.

These references are the exact-arithmetic definition that transformers implements. DeepSeek's
deployed indexer applies a Hadamard rotation to q and k (orthonormal: q.k unchanged) and scores in
FP8 with one scale per (token, head); kernels doing so approximate this op, they do not redefine it.

Ties. "The k best-scoring keys" is a set only when the k-th and (k+1)-th scores differ. The ReLU
makes exact ties common: a key that every head scores <= 0 gets exactly 0, and with few indexer
heads (or a query whose weights are all negative, so that 0 is the best score) more than k keys
can share the boundary score. `torch.topk`'s pick among tied values depends on the length of the
row it is given, masked or padded tail included, so a selection made by it changes with how many
tokens share the forward (one prefill, chunks, one-token decode, a padded batch), which a causal
model must not do. `topk_select` ranks equal scores by key index, lower first (`ranked_topk`):
the selection is a function of the query's visible scores only, the same on every path.
"""

from __future__ import annotations

import torch

from dayzero.ops.attention_gqa import padding_mask
from dayzero.ops.paged import PagedStream, SeqBatch, query_chunks
from dayzero.ops.registry import reference_op


@reference_op("lightning_indexer")
def lightning_indexer(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """Index scores I[b, t, s] = sum_h weights[b, t, h] * relu(scale * q[b, t, h] . k[b, s]).

    q [B, T, Hi, Di] (rotated), k [B, S, Di] (rotated, every cached key), weights [B, T, Hi];
    returns float32 [B, T, S], accumulated in float64 and rounded once: the same query's scores then
    agree to the last bit whether it runs alone (a decode step) or among others (a full forward),
    whose float32 matmuls reduce in other orders; the selection of near-tied keys (seen 7 ulp apart in
    the tests' tiny models) must not depend on that. No mask: see `topk_select`."""
    if q.dim() != 4 or k.dim() != 3 or weights.dim() != 3:
        raise ValueError(
            f"lightning_indexer: q must be [batch, tokens, heads, dim], k [batch, keys, dim], weights "
            f"[batch, tokens, heads]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(weights.shape)}"
        )
    if k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1] or weights.shape != q.shape[:3]:
        raise ValueError(
            f"lightning_indexer: shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, weights {tuple(weights.shape)} "
            "(batch, head dim and heads must match)"
        )
    logits = torch.einsum("bthd,bsd->bths", q.double(), k.double()) * scale
    return torch.einsum("bths,bth->bts", logits.relu(), weights.double()).float()


def ranked_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries along the last dim, in descending order, equal
    values by ascending index: the first k of a stable descending sort. -0.0 counts as 0.0 (a sort
    that compares bit patterns, as radix sorts do, would otherwise rank it below +0.0)."""
    values, indices = torch.sort(scores.masked_fill(scores == 0, 0.0), dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


@reference_op("topk_select")
def topk_select(scores: torch.Tensor, k: int, kv_lens: torch.Tensor | None = None) -> torch.Tensor:
    """The k best-scoring visible keys of each query, causally: scores [B, T, S] float, where the T
    queries are the last T of the S keys (query t sees keys s <= S - T + t).

    kv_lens: optional int [B], right-aligned rows of different lengths (see gqa_attention): the
    padding keys before a row's last kv_lens[b] are never selected.
    Returns int64 [B, T, k]: key indices in descending score order, equal scores by ascending key
    index (module docstring), padded with -1 where a query sees fewer than k keys."""
    if scores.dim() != 3:
        raise ValueError(f"topk_select: scores must be [batch, queries, keys], got {tuple(scores.shape)}")
    b, t, s = scores.shape
    if t > s:
        raise ValueError(f"topk_select: {t} queries cannot be the last of only {s} keys")
    if k < 1:
        raise ValueError(f"topk_select: k must be positive, got {k}")
    rows = torch.arange(t, device=scores.device)[:, None] + (s - t)
    hidden = torch.arange(s, device=scores.device)[None, :] > rows
    if kv_lens is not None:
        hidden = hidden | ~padding_mask(kv_lens, s)[:, None, :]
    masked = scores.float().masked_fill(hidden, float("-inf"))
    values, indices = ranked_topk(masked, min(k, s))
    indices = indices.masked_fill(values == float("-inf"), -1)
    if k > s:
        indices = torch.cat([indices, indices.new_full((b, t, k - s), -1)], dim=-1)
    return indices


@reference_op("paged_index_topk")
def paged_index_topk(q: torch.Tensor, weights: torch.Tensor, index_k: PagedStream, scale: float, k: int,
                     seqs: SeqBatch) -> torch.Tensor:
    """DSA's selection for a packed step: for each query, the k best-scoring of its sequence's keys at
    positions <= its own (`lightning_indexer` scores, `topk_select` order and -1 padding), the keys read
    from the paged `index_k` stream ([Di] entries, rate 1).

    q [N, Hi, Di] (rotated), weights [N, Hi]; returns int32 [N, k]: key positions within the query's
    sequence, -1 where it sees fewer than k keys. Reference: per sequence, queries in chunks."""
    if q.dim() != 3 or weights.shape != q.shape[:2] or q.shape[0] != seqs.num_tokens:
        raise ValueError(f"paged_index_topk: q must be [num_tokens={seqs.num_tokens}, heads, dim] and weights "
                         f"[num_tokens, heads]; got {tuple(q.shape)}, {tuple(weights.shape)}")
    out = torch.full((q.shape[0], k), -1, dtype=torch.int32, device=q.device)
    for b in range(seqs.num_seqs):
        q0, ctx, total = seqs.query_start_host[b], seqs.context_lens[b], seqs.seq_lens_host[b]
        t = total - ctx
        chunk = query_chunks(t, total, q.shape[1])
        for lo in range(0, t, chunk):
            hi = min(t, lo + chunk)
            keys = index_k.gather(b, 0, ctx + hi)
            rows = slice(q0 + lo, q0 + hi)
            scores = lightning_indexer(q[None, rows], keys[None], weights[None, rows], scale)
            out[rows] = topk_select(scores, k)[0].to(torch.int32)
    return out
