"""Multi-head latent attention (MLA, DeepSeek-V2 arXiv 2405.04434 §2.1) in the absorbed (MQA) form.

What a layer caches per token is the latent only:
    kv_latent [B, S, C]   c_kv = kv_a_layernorm(kv_a_proj(x)[:C]), C = kv_lora_rank (512)
    k_pe      [B, S, Dr]  the shared RoPE key, already rotated (Dr = qk_rope_head_dim, 64)
Per head h, key and value are up-projections of the latent by kv_b_proj, whose weight
[H * (Dn + Dv), C] is, per head, Dn key rows then Dv value rows:
    w_uk [H, Dn, C] (keys), w_uv [H, Dv, C] (values)    = kv_b_proj.weight.view(H, Dn + Dv, C).split
The absorbed form never expands keys or values:
    score[t, s] = scale * ((q_nope[t] w_uk) . kv_latent[s] + q_pe[t] . k_pe[s])
    out[t]      = w_uv (softmax_s(score[t]) @ kv_latent)
which equals the expanded form softmax(q k^T) v with k = [w_uk c, k_pe], v = w_uv c (transformers'
eager path) up to float rounding, and is what FlashMLA computes (576-dim MQA keys, 512-dim values).

Causality: the T queries are the last T of the S keys (the keys of this step are already appended),
so query t sees keys s <= S - T + t. The references compute in float32 and return q_nope.dtype.
"""

from __future__ import annotations

import torch

from dayzero.ops.attention_gqa import padding_mask
from dayzero.ops.paged import PagedStream, SeqBatch, query_chunks
from dayzero.ops.registry import reference_op


def _check_mla(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, name: str) -> None:
    if q_nope.dim() != 4 or q_pe.dim() != 4 or q_nope.shape[:3] != q_pe.shape[:3]:
        raise ValueError(
            f"{name}: q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} must be [batch, tokens, heads, dim] "
            "with equal batch, tokens and heads"
        )
    b, _, h, dn = q_nope.shape
    if kv_latent.dim() != 3 or k_pe.dim() != 3 or kv_latent.shape[:2] != k_pe.shape[:2] or kv_latent.shape[0] != b:
        raise ValueError(
            f"{name}: kv_latent {tuple(kv_latent.shape)} and k_pe {tuple(k_pe.shape)} must be [batch={b}, keys, dim]"
        )
    if k_pe.shape[-1] != q_pe.shape[-1]:
        raise ValueError(f"{name}: q_pe dim {q_pe.shape[-1]} differs from k_pe dim {k_pe.shape[-1]}")
    c = kv_latent.shape[-1]
    if w_uk.shape != (h, dn, c) or w_uv.dim() != 3 or w_uv.shape[0] != h or w_uv.shape[2] != c:
        raise ValueError(
            f"{name}: w_uk {tuple(w_uk.shape)} must be [heads={h}, nope={dn}, latent={c}] and "
            f"w_uv {tuple(w_uv.shape)} [heads={h}, v_dim, latent={c}]"
        )


def _absorbed(q_nope, q_pe, latent, pe, w_uk, w_uv, scale, visible, keys: str):
    """keys "sc": latent [B, S, C] / pe [B, S, Dr] shared by all queries; keys "tsc": latent
    [B, T, K, C] / pe [B, T, K, Dr], one key set per query. visible: bool [B, T, S or K]."""
    q_lat = torch.einsum("bthn,hnc->bthc", q_nope.float(), w_uk.float())
    k = "bsc" if keys == "sc" else "btsc"
    scores = torch.einsum(f"bthc,{k}->bths", q_lat, latent.float())
    scores = scores + torch.einsum(f"bthc,{k}->bths", q_pe.float(), pe.float())
    scores = (scores * scale).masked_fill(~visible[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no visible key attends to nothing
    o_lat = torch.einsum(f"bths,{k}->bthc", probs, latent.float())
    return torch.einsum("bthc,hvc->bthv", o_lat, w_uv.float()).to(q_nope.dtype)


@reference_op("mla_attention")
def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    kv_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal MLA over every cached key, absorbed form (module docstring).

    q_nope [B, T, H, Dn], q_pe [B, T, H, Dr] (rotated); kv_latent [B, S, C], k_pe [B, S, Dr] (S >= T,
    the last T keys belong to the queries); w_uk [H, Dn, C], w_uv [H, Dv, C]; scale: softmax scale.
    Returns [B, T, H, Dv] in q_nope.dtype."""
    _check_mla(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, "mla_attention")
    t, s = q_nope.shape[1], kv_latent.shape[1]
    if s < t:
        raise ValueError(f"mla_attention: {s} keys cannot hold the {t} queries' own keys (need keys >= tokens)")
    rows = torch.arange(t, device=q_nope.device)[:, None] + (s - t)
    visible = (torch.arange(s, device=q_nope.device)[None, :] <= rows).expand(q_nope.shape[0], t, s)
    if kv_lens is not None:
        visible = visible & padding_mask(kv_lens, s)[:, None, :]
    return _absorbed(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, visible, "sc")


@reference_op("sparse_mla_attention")
def sparse_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    indices: torch.Tensor,
) -> torch.Tensor:
    """MLA of each query over its own selected keys only (DSA), absorbed form.

    Shapes as `mla_attention`; indices: integer [B, T, K], key positions in [0, S) per query, -1 for
    an unused slot (FlashMLA's convention). No causal mask is applied here: the selection (e.g.
    `topk_select`) is responsible for it. A query whose K slots are all -1 gets zeros.
    Returns [B, T, H, Dv] in q_nope.dtype."""
    _check_mla(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, "sparse_mla_attention")
    b, t = q_nope.shape[:2]
    s = kv_latent.shape[1]
    if indices.dim() != 3 or indices.shape[:2] != (b, t) or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_mla_attention: indices must be int32/int64 [batch={b}, tokens={t}, k], "
                         f"got {indices.dtype} {tuple(indices.shape)}")
    if indices.numel() and (int(indices.min()) < -1 or int(indices.max()) >= s):
        raise ValueError(f"sparse_mla_attention: indices must lie in [0, {s}) or be -1, "
                         f"got min {int(indices.min())}, max {int(indices.max())}")
    visible = indices >= 0
    flat = indices.long().clamp(min=0).reshape(b, -1)  # [B, T*K]
    latent = torch.gather(kv_latent, 1, flat[..., None].expand(-1, -1, kv_latent.shape[-1])).view(b, t, -1, kv_latent.shape[-1])
    pe = torch.gather(k_pe, 1, flat[..., None].expand(-1, -1, k_pe.shape[-1])).view(b, t, -1, k_pe.shape[-1])
    return _absorbed(q_nope, q_pe, latent, pe, w_uk, w_uv, scale, visible, "tsc")


@reference_op("paged_mla_attention")
def paged_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_latent: PagedStream,
    k_pe: PagedStream,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    seqs: SeqBatch,
) -> torch.Tensor:
    """Causal MLA of a packed step over latents read from the paged pool (module docstring's
    equations); [N, H, Dv] in q_nope.dtype.

    q_nope [N, H, Dn], q_pe [N, H, Dr] (rotated), sequence b's at rows seqs.query_start[b] : [b + 1];
    kv_latent, k_pe: streams of [C] / [Dr] entries (rate 1) that already hold this step's keys.
    Query at position p of sequence b sees its keys j <= p. Kernels may compute the expanded form
    (prefill) or the absorbed one (decode): both equal this up to float rounding.
    Reference: per sequence, absorbed, queries in chunks (scores O(chunk x keys))."""
    n, h = q_nope.shape[:2]
    if q_nope.dim() != 3 or q_pe.dim() != 3 or n != seqs.num_tokens or q_pe.shape[:2] != (n, h):
        raise ValueError(f"paged_mla_attention: q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} must be "
                         f"[num_tokens={seqs.num_tokens}, heads, dim]")
    if kv_latent.rate != 1 or k_pe.rate != 1 or len(kv_latent.entry_shape) != 1 or len(k_pe.entry_shape) != 1:
        raise ValueError(f"paged_mla_attention: kv_latent and k_pe must be streams of vectors, one per token; got "
                         f"{kv_latent.entry_shape} and {k_pe.entry_shape}")
    out = q_nope.new_empty((n, h, w_uv.shape[1]))
    for b in range(seqs.num_seqs):
        q0, ctx, total = seqs.query_start_host[b], seqs.context_lens[b], seqs.seq_lens_host[b]
        t = total - ctx
        chunk = query_chunks(t, total, h)
        for lo in range(0, t, chunk):
            hi = min(t, lo + chunk)
            latent, pe = kv_latent.gather(b, 0, ctx + hi), k_pe.gather(b, 0, ctx + hi)
            rows = torch.arange(ctx + lo, ctx + hi, device=latent.device)[:, None]
            visible = (torch.arange(ctx + hi, device=latent.device)[None, :] <= rows)[None]
            rng = slice(q0 + lo, q0 + hi)
            _check_mla(q_nope[None, rng], q_pe[None, rng], latent[None], pe[None], w_uk, w_uv, "paged_mla_attention")
            out[rng] = _absorbed(q_nope[None, rng], q_pe[None, rng], latent[None], pe[None], w_uk, w_uv, scale,
                                 visible, "sc")[0]
    return out


@reference_op("paged_sparse_mla_attention")
def paged_sparse_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_latent: PagedStream,
    k_pe: PagedStream,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    seqs: SeqBatch,
    indices: torch.Tensor,
) -> torch.Tensor:
    """MLA of each query of a packed step over its own selected keys only (DSA), read from the paged
    pool; [N, H, Dv] in q_nope.dtype.

    Shapes as `paged_mla_attention`; indices: integer [N, K], key positions within the query's
    sequence (< its seq_len), -1 for an unused slot. No causal mask here: the selection
    (`paged_index_topk`) is causal. A query whose K slots are all -1 gets zeros."""
    n, h = q_nope.shape[:2]
    if indices.dim() != 2 or indices.shape[0] != n:
        raise ValueError(f"paged_sparse_mla_attention: indices must be [num_tokens={n}, k], got {tuple(indices.shape)}")
    out = q_nope.new_empty((n, h, w_uv.shape[1]))
    width = max(h, kv_latent.entry_shape[0])  # the gathered latents [chunk, K, C] bound the memory
    for b in range(seqs.num_seqs):
        q0, t = seqs.query_start_host[b], seqs.query_lens[b]
        chunk = query_chunks(t, indices.shape[1], width)
        for lo in range(0, t, chunk):
            rows = slice(q0 + lo, q0 + min(t, lo + chunk))
            picked = indices[rows].long()
            latent = kv_latent.gather_at(b, picked.clamp(min=0))  # [chunk, K, C]
            pe = k_pe.gather_at(b, picked.clamp(min=0))
            out[rows] = _absorbed(q_nope[None, rows], q_pe[None, rows], latent[None], pe[None], w_uk, w_uv, scale,
                                  (picked >= 0)[None], "tsc")[0]
    return out
