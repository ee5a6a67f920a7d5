"""DeepSeek-V4 attention: a sliding window of raw keys plus compressed entries, with sinks.

Every V4 layer attends, with one shared key=value head (MQA), to
  - the last `sliding_window` tokens (itself included), and
  - compressed entries, each pooling `ratio` consecutive tokens (entry s covers tokens
    [s*ratio, (s+1)*ratio) and becomes visible to the query at position p once s < (p+1) // ratio):
      HCA (ratio 128): every visible entry;
      CSA (ratio 4):   the top-k visible entries picked by the lightning indexer.

Ops, in call order:
  kv_compressor   pool complete windows of projected tokens into entries (softmax-gated, then RMSNorm)
  v4_indexer      score every compressed indexer key for every query
  v4_topk_select  keep the best k entries per query (-1 where fewer are visible)
  v4_index_topk   both, for chunks of queries (what the model calls; one kernel on CUDA)
  sparse_attention  softmax over window keys + chosen entries + one sink logit per head
"""

from __future__ import annotations

import math

import torch

from dayzero.ops.attention_gqa import padding_mask
from dayzero.ops.dsa import ranked_topk
from dayzero.ops.paged import query_chunks
from dayzero.ops.registry import reference_op


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Number of compressed entries a query at each position may read: (p + 1) // ratio."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def entry_visible(num_entries: int, positions: torch.Tensor, ratio: int, lens: torch.Tensor | None = None) -> torch.Tensor:
    """bool [B, T, N]: which of N compressed entries each query may read. Without lens entry n is
    entry number n; with lens [B] rows are right-aligned (row b's entries are its last lens[b], the
    ones before are padding), so entry n is number n - (N - lens[b])."""
    n = torch.arange(num_entries, device=positions.device)
    number = n.view(1, 1, -1) if lens is None else n.view(1, 1, -1) - (num_entries - lens).view(-1, 1, 1)
    return (number >= 0) & (number < visible_entries(positions, ratio).unsqueeze(-1))


# -- compressor -------------------------------------------------------------------------------


@reference_op("kv_compressor")
def kv_compressor(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    overlap: bool,
    prev_kv: torch.Tensor | None = None,
    prev_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compress W complete windows of `ratio` tokens into W entries.

    kv, gate: [B, W*ratio, C], the projected tokens (compressor wkv / wgate outputs, model dtype);
    ape: float32 [ratio, C], a learned bias added to the gate by slot within the window;
    norm_weight: [D]; eps: its RMSNorm epsilon.
    overlap=False (HCA): C = D; entry w = sum over the window's slots of softmax_slots(gate + ape) * kv.
    overlap=True (CSA): C = 2D holding two series, Ca = [..., :D] and Cb = [..., D:]; entry w pools
      2*ratio slots, Ca of window w-1 then Cb of window w, so consecutive entries overlap by one
      window. prev_kv / prev_gate [B, ratio, C]: the raw tokens of the window before the first
      (from an earlier call), or None when there is none (its slots then get weight 0).
    The softmax runs per channel in float32, its weights are cast to kv.dtype for the sum, and the
    pooled entry is RMS-normalised in float32, scaled by norm_weight and cast to kv.dtype.
    Returns [B, W, D] before rotary embedding.
    """
    if kv.dim() != 3 or gate.shape != kv.shape:
        raise ValueError(f"kv_compressor: kv {tuple(kv.shape)} and gate {tuple(gate.shape)} must both be [B, tokens, C]")
    ratio, channels = ape.shape if ape.dim() == 2 else (0, 0)
    if ratio == 0 or channels != kv.shape[-1]:
        raise ValueError(f"kv_compressor: ape must be [ratio, C={kv.shape[-1]}], got {tuple(ape.shape)}")
    if kv.shape[1] % ratio:
        raise ValueError(f"kv_compressor: {kv.shape[1]} tokens are not whole windows of {ratio}")
    dim = channels // 2 if overlap else channels
    if norm_weight.shape != (dim,) or (overlap and channels % 2):
        raise ValueError(f"kv_compressor: norm_weight {tuple(norm_weight.shape)} must be [{dim}] (C={channels}, overlap={overlap})")
    if (prev_kv is None) != (prev_gate is None) or (prev_kv is not None and not overlap):
        raise ValueError("kv_compressor: prev_kv and prev_gate come together, and only with overlap=True")
    if prev_kv is not None and (prev_kv.shape != (kv.shape[0], ratio, channels) or prev_gate.shape != prev_kv.shape):
        raise ValueError(f"kv_compressor: prev_kv/prev_gate must be [B, {ratio}, {channels}], got {tuple(prev_kv.shape)}, {tuple(prev_gate.shape)}")

    b, windows = kv.shape[0], kv.shape[1] // ratio
    kv_w = kv.view(b, windows, ratio, channels)
    gate_w = gate.view(b, windows, ratio, channels) + ape.float()
    if overlap:
        slots_kv = kv_w.new_zeros((b, windows, 2 * ratio, dim))
        slots_gate = gate_w.new_full((b, windows, 2 * ratio, dim), float("-inf"))
        slots_kv[:, :, ratio:], slots_gate[:, :, ratio:] = kv_w[..., dim:], gate_w[..., dim:]
        slots_kv[:, 1:, :ratio], slots_gate[:, 1:, :ratio] = kv_w[:, :-1, :, :dim], gate_w[:, :-1, :, :dim]
        if prev_kv is not None and windows:
            slots_kv[:, 0, :ratio] = prev_kv[..., :dim].to(slots_kv.dtype)
            slots_gate[:, 0, :ratio] = prev_gate[..., :dim].float() + ape[:, :dim].float()
        kv_w, gate_w = slots_kv, slots_gate
    pooled = (kv_w * gate_w.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
    x = pooled.float()
    normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return (norm_weight.float() * normed).to(kv.dtype)


# -- indexer ----------------------------------------------------------------------------------


@reference_op("v4_indexer")
def v4_indexer(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, ratio: int,
    lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Lightning-indexer scores of compressed entries (DeepSeek-V4 CSA).

    q: [B, T, H, Di] indexer queries (rotary applied); keys: [B, N, Di] compressed indexer keys;
    weights: [B, T, H] the raw per-head weights (weights_proj output); positions: int [B, T].
    score[b, t, s] = sum_h weights[b,t,h] * H^-0.5 * relu(q[b,t,h] . keys[b,s]) * Di^-0.5,
    float32 [B, T, N], -inf for entries not yet visible to the query (s >= (p+1) // ratio).
    lens: optional int [B] for right-aligned rows of different lengths (`entry_visible`); padding
    scores -inf.
    """
    if q.dim() != 4 or keys.dim() != 3 or keys.shape[0] != q.shape[0] or keys.shape[-1] != q.shape[-1]:
        raise ValueError(f"v4_indexer: q must be [B, T, H, Di] and keys [B, N, Di]; got {tuple(q.shape)} and {tuple(keys.shape)}")
    if weights.shape != q.shape[:3] or positions.shape != q.shape[:2]:
        raise ValueError(f"v4_indexer: weights {tuple(weights.shape)} must be [B, T, H] and positions {tuple(positions.shape)} [B, T] for q {tuple(q.shape)}")
    heads, dim = q.shape[2], q.shape[3]
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))  # [B, T, H, N]
    scores = torch.relu(scores) * dim**-0.5
    scores = (scores * (weights.float() * heads**-0.5).unsqueeze(-1)).sum(dim=2)
    return scores.masked_fill(~entry_visible(keys.shape[1], positions, ratio, lens), float("-inf"))


@reference_op("v4_topk_select")
def v4_topk_select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the min(k, N) best entries per row of scores [..., N], best first, equal scores by
    ascending entry index (as DSA's `topk_select`, dayzero/ops/dsa.py: exact ties happen when every
    indexer head's ReLU is 0, and torch.topk's order among them depends on the row's length, so a
    cached decode and a full forward would keep different entries). Picks with score -inf (entries not
    yet visible) become -1. int64 [..., min(k, N)]."""
    if k < 1:
        raise ValueError(f"v4_topk_select: k must be >= 1, got {k}")
    values, indices = ranked_topk(scores, min(k, scores.shape[-1]))
    return indices.masked_fill(values == float("-inf"), -1)


@reference_op("v4_index_topk")
def v4_index_topk(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, ratio: int, k: int,
    lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CSA indexer's selection: v4_topk_select(v4_indexer(q, keys, weights, positions, ratio, lens), k),
    int64 [B, T, min(k, N)], computed for chunks of queries (`query_chunks`: a chunk's [B, chunk, H, N]
    scores stay bounded however long the context)."""
    if q.dim() != 4 or keys.dim() != 3:
        raise ValueError(f"v4_index_topk: q must be [B, T, H, Di] and keys [B, N, Di]; got {tuple(q.shape)} and {tuple(keys.shape)}")
    t = q.shape[1]
    chunk = query_chunks(t, keys.shape[0] * keys.shape[1], q.shape[2])
    picks = [v4_topk_select(v4_indexer(q[:, a:a + chunk], keys, weights[:, a:a + chunk], positions[:, a:a + chunk],
                                       ratio, lens), k) for a in range(0, t, chunk)]
    return picks[0] if len(picks) == 1 else torch.cat(picks, dim=1)


# -- attention --------------------------------------------------------------------------------


def _check_attention(q, kv, sinks, compressed, indices, positions, ratio) -> None:
    if q.dim() != 4 or kv.dim() != 3 or kv.shape[0] != q.shape[0] or kv.shape[-1] != q.shape[-1]:
        raise ValueError(f"sparse_attention: q must be [B, T, H, D] and kv [B, S, D]; got {tuple(q.shape)} and {tuple(kv.shape)}")
    if kv.shape[1] < q.shape[1]:
        raise ValueError(f"sparse_attention: {kv.shape[1]} window keys cannot hold the {q.shape[1]} queries (queries are the last keys)")
    if sinks.shape != (q.shape[2],):
        raise ValueError(f"sparse_attention: sinks must be [{q.shape[2]}], got {tuple(sinks.shape)}")
    if compressed is None:
        if indices is not None:
            raise ValueError("sparse_attention: indices given without compressed entries")
        return
    if compressed.dim() != 3 or compressed.shape[0] != q.shape[0] or compressed.shape[-1] != q.shape[-1]:
        raise ValueError(f"sparse_attention: compressed must be [B, N, D={q.shape[-1]}], got {tuple(compressed.shape)}")
    if indices is not None:
        if indices.dim() != 3 or indices.shape[:2] != q.shape[:2]:
            raise ValueError(f"sparse_attention: indices must be [B, T, k], got {tuple(indices.shape)}")
        if indices.numel() and int(indices.max()) >= compressed.shape[1]:
            raise ValueError(f"sparse_attention: indices point past the {compressed.shape[1]} compressed entries")
    elif positions is None or ratio is None or positions.shape != q.shape[:2]:
        raise ValueError("sparse_attention: without indices, positions [B, T] and ratio are needed to mask future entries")


SCORE_ELEMENTS = 1 << 25  # float32 scores a chunk of queries may hold (128 MiB), as ops.paged.query_chunks


def attention_chunk(queries: int, keys: int, rows: int, budget: int | None = None) -> int:
    """Queries per chunk of `sparse_attention` so that rows x chunk x (chunk + keys) scores stay within
    budget (SCORE_ELEMENTS): a chunk of c queries reads c - 1 + sliding_window window keys plus `keys`
    - (sliding_window - 1) others (the compressed entries or the chosen ones)."""
    limit = (budget or SCORE_ELEMENTS) // max(1, rows)
    c = int((math.sqrt(keys * keys + 4 * limit) - keys) / 2)
    return max(1, min(queries, c))


@reference_op("sparse_attention")
def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    sliding_window: int,
    compressed: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    ratio: int | None = None,
    kv_lens: torch.Tensor | None = None,
    compressed_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V4 attention of H query heads on one shared key=value head.

    q: [B, T, H, D]; kv: [B, S, D] consecutive tokens whose last T are the queries (query i sits at
    index S - T + i; older keys beyond the window may be dropped by the caller); a query sees the
    window keys j with 0 <= i' - j < sliding_window (i' its own index).
    compressed: [B, N, D] compressed entries (or None). indices: int64 [B, T, k] entries chosen
    per query, -1 = none (CSA); when None every entry s < (positions + 1) // ratio is seen (HCA).
    sinks: float [H], one logit per head joined to the softmax and dropped after it.
    kv_lens / compressed_lens: optional int [B] for a batch of rows of different lengths (a paged
    decode step): each row's window keys / compressed entries are its last kv_lens[b] /
    compressed_lens[b] (right-aligned); the ones before are padding and never seen.
    Scores q.k * scale, softmax and the weighted sum of values (= keys) run in float32, for chunks of
    queries (`attention_chunk`: the scores of a long prefill chunk stay bounded), each over the window
    keys its queries can see. Returns [B, T, H, D] in q.dtype.
    """
    _check_attention(q, kv, sinks, compressed, indices, positions, ratio)
    b, t, h, _ = q.shape
    s = kv.shape[1]
    others = 0 if compressed is None else (indices.shape[-1] if indices is not None else compressed.shape[1])
    chunk = attention_chunk(t, sliding_window + others, b * h)
    if chunk >= t:
        return _attend(q, kv, sinks, scale, sliding_window, compressed, indices, positions, ratio, kv_lens,
                       compressed_lens)
    outs = []
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        k0, k1 = max(0, s - t + c0 - (sliding_window - 1)), s - t + c1  # every key these queries may see
        lens = None if kv_lens is None else (k1 - torch.clamp(s - kv_lens, min=k0)).clamp(min=0)
        outs.append(_attend(q[:, c0:c1], kv[:, k0:k1], sinks, scale, sliding_window, compressed,
                            None if indices is None else indices[:, c0:c1],
                            None if positions is None else positions[:, c0:c1], ratio, lens, compressed_lens))
    return torch.cat(outs, dim=1)


def _attend(q, kv, sinks, scale, sliding_window, compressed, indices, positions, ratio, kv_lens, compressed_lens):
    """`sparse_attention` of all of q's queries at once (the op checked the arguments)."""
    b, t, h, _ = q.shape
    s = kv.shape[1]
    qf = q.float()
    values = [kv.float()]
    scores = [torch.einsum("bthd,bsd->bhts", qf, values[0]) * scale]
    query_index = torch.arange(s - t, s, device=q.device).unsqueeze(1)
    key_index = torch.arange(s, device=q.device).unsqueeze(0)
    in_window = ((key_index <= query_index) & (query_index - key_index < sliding_window)).expand(b, t, s)
    if kv_lens is not None:
        in_window = in_window & padding_mask(kv_lens, s)[:, None, :]
    scores[0] = scores[0].masked_fill(~in_window[:, None], float("-inf"))

    if compressed is not None and indices is not None:
        picked = compressed.float()[torch.arange(b, device=q.device).view(b, 1, 1), indices.clamp(min=0)]  # [B, T, k, D]
        chosen = torch.einsum("bthd,btkd->bhtk", qf, picked) * scale
        scores.append(chosen.masked_fill((indices < 0).unsqueeze(1), float("-inf")))
    elif compressed is not None:
        entries = compressed.float()
        hidden = ~entry_visible(entries.shape[1], positions, ratio, compressed_lens)
        scores.append((torch.einsum("bthd,bnd->bhtn", qf, entries) * scale).masked_fill(hidden.unsqueeze(1), float("-inf")))

    scores.append(sinks.float().view(1, h, 1, 1).expand(b, h, t, 1))
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = torch.einsum("bhts,bsd->bthd", probs[..., :s], values[0])
    if compressed is not None and indices is not None:
        out = out + torch.einsum("bhtk,btkd->bthd", probs[..., s:-1], picked)
    elif compressed is not None:
        out = out + torch.einsum("bhtn,bnd->bthd", probs[..., s:-1], entries)
    return out.to(q.dtype)
