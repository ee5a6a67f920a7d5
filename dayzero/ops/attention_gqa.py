"""Grouped-query attention: causal, optional sliding window, optional sinks.

Used by gpt-oss (sliding and full layers, both with sinks) and by any Llama-style GQA layer.
`paged_gqa_attention` is the op models call: packed queries of a step, keys and values read from the
paged pool in place (dayzero.ops.paged). `gqa_attention` is the same arithmetic over one contiguous
key set, the building block of the reference.
"""

from __future__ import annotations

import torch

from dayzero.ops.paged import PagedStream, SeqBatch, query_chunks
from dayzero.ops.registry import reference_op


def padding_mask(kv_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool [B, S]: True for the real keys of right-aligned rows of kv_lens[b] keys each."""
    if kv_lens.dim() != 1 or int(kv_lens.max()) > num_keys or int(kv_lens.min()) < 0:
        raise ValueError(f"kv_lens must be [batch] counts in [0, {num_keys}], got {kv_lens.tolist()}")
    return torch.arange(num_keys, device=kv_lens.device)[None, :] >= (num_keys - kv_lens)[:, None]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None, sinks: torch.Tensor | None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "gqa_attention: q, k, v must be [batch, tokens, heads, dim]; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, t, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"gqa_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must share batch={b}, keys and kv heads"
        )
    if k.shape[3] != d:
        raise ValueError(f"gqa_attention: q head dim {d} != k head dim {k.shape[3]}")
    hkv = k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"gqa_attention: {hq} query heads are not a multiple of {hkv} kv heads")
    if k.shape[1] < t:
        raise ValueError(f"gqa_attention: {k.shape[1]} keys cannot hold the {t} query tokens (queries are the last keys)")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"gqa_attention: sliding_window must be >= 1 or None, got {sliding_window}")
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"gqa_attention: sinks must be [{hq}] (one logit per query head), got {tuple(sinks.shape)}")


@reference_op("gqa_attention")
def gqa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    kv_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v with grouped kv heads; returns [B, T, Hq, Dv] in q.dtype.

    q: [B, T, Hq, D]; k: [B, S, Hkv, D]; v: [B, S, Hkv, Dv]; Hq a multiple of Hkv, query head h
    reads kv head h // (Hq / Hkv). The S keys are consecutive positions and the T queries are the
    last T of them (query i sits at key index S - T + i), so a caller may drop keys older than the
    window without changing the result.
    Causal: query at index p sees keys j <= p; with `sliding_window` W also p - j < W (W keys,
    itself included, as transformers' sliding-window mask).
    sinks: float [Hq], one learned logit per head joined to each query's scores before the
    softmax and dropped after it (gpt-oss): it takes probability mass and adds nothing to the output.
    kv_lens: optional int [B], a batch of sequences of different lengths (a paged decode step):
    row b's keys are its last kv_lens[b] (right-aligned); the keys before them are padding.
    Scores, softmax and the weighted sum are computed in float32.
    """
    _check(q, k, v, sliding_window, sinks)
    b, t, hq, _ = q.shape
    s, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    qf = q.float().reshape(b, t, hkv, group, -1)
    scores = torch.einsum("btkgd,bskd->bkgts", qf, k.float()) * scale  # [B, Hkv, G, T, S]

    query_index = torch.arange(s - t, s, device=q.device).unsqueeze(1)
    key_index = torch.arange(s, device=q.device).unsqueeze(0)
    visible = key_index <= query_index
    if sliding_window is not None:
        visible &= query_index - key_index < sliding_window
    visible = visible.expand(b, t, s)
    if kv_lens is not None:
        visible = visible & padding_mask(kv_lens, s)[:, None, :]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))

    if sinks is not None:
        sink = sinks.float().reshape(1, hkv, group, 1, 1).expand(b, hkv, group, t, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :s]
    out = torch.einsum("bkgts,bskd->btkgd", probs, v.float())
    return out.reshape(b, t, hq, -1).to(q.dtype)


@reference_op("paged_gqa_attention")
def paged_gqa_attention(
    q: torch.Tensor,
    k: PagedStream,
    v: PagedStream,
    seqs: SeqBatch,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA of a packed step over keys and values read from the paged pool; [N, Hq, Dv] in q.dtype.

    q [N, Hq, D]: the step's queries, sequence b's at rows seqs.query_start[b] : [b + 1], at positions
    context_len[b] ... seq_len[b] - 1; k, v: streams of entries [Hkv, D] / [Hkv, Dv] (rate 1) that already
    hold this step's keys. Query at position p of sequence b sees its keys j <= p, with a sliding window
    W also p - j < W (pages wholly before a window are never read: they may be reclaimed). Sinks and
    arithmetic as `gqa_attention` (float32 scores, softmax and sum).
    Reference: per sequence, queries in chunks so that scores stay O(chunk x keys)."""
    if q.dim() != 3 or q.shape[0] != seqs.num_tokens:
        raise ValueError(f"paged_gqa_attention: q must be [num_tokens={seqs.num_tokens}, heads, dim], got {tuple(q.shape)}")
    if k.rate != 1 or v.rate != 1 or len(k.entry_shape) != 2 or len(v.entry_shape) != 2:
        raise ValueError(f"paged_gqa_attention: k and v must be streams of [kv_heads, dim] entries, one per token; got "
                         f"{k.entry_shape} (rate {k.rate}) and {v.entry_shape} (rate {v.rate})")
    out = q.new_empty((q.shape[0], q.shape[1], v.entry_shape[-1]))
    for b in range(seqs.num_seqs):
        q0, ctx, total = seqs.query_start_host[b], seqs.context_lens[b], seqs.seq_lens_host[b]
        t = total - ctx
        chunk = query_chunks(t, total if sliding_window is None else min(total, sliding_window + t), q.shape[1])
        for lo in range(0, t, chunk):
            hi = min(t, lo + chunk)
            first = 0 if sliding_window is None else max(0, ctx + lo - sliding_window + 1)
            keys, values = k.gather(b, first, ctx + hi), v.gather(b, first, ctx + hi)
            out[q0 + lo:q0 + hi] = gqa_attention.reference.fn(q[None, q0 + lo:q0 + hi], keys[None], values[None], scale,
                                                              sliding_window, sinks)[0]
    return out
