"""Gated DeltaNet (Yang, Kautz, Hatamizadeh, arXiv 2412.06464; Qwen3-Next and Qwen3.5's linear-attention
layers): the gated delta rule with one decay per head, and grouped value heads.

HK query/key heads of dk channels serve HV = G * HK value heads of dv channels (value head h reads
query/key head h // G). Per value head, with q, k L2-normalised and state S [dk, dv]:
    S' = exp(g_t) S_{t-1};   u_t = beta_t (v_t - S'^T k_t);   S_t = S' + k_t u_t^T;   o_t = scale * S_t^T q_t
g_t <= 0 is the head's log decay (`kda_gate` of the raw a_t [HV, 1] with A_log [HV], dt_bias [HV]:
-exp(A_log) softplus(a_t + dt_bias)), beta_t in (0, 1) a sigmoid, scale dk^-1/2.

That is KDA (dayzero/ops/kda.py) with every channel of a head decaying alike: the reference ops here are
KDA's reference functions on q and k repeated per value head (G consecutive value heads share one) and g
broadcast over dk. The state a request keeps is therefore KDA's, in KDA's pool and slots:
    recurrent state   float32 [HV, dk, dv]
    conv state        [2 HK dk + HV dv, K-1] (one short convolution over q | k | v, `short_conv1d`)
"""

from __future__ import annotations

import torch

from dayzero.ops import kda
from dayzero.ops.registry import reference_op


def _as_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, name: str):
    """(q, k repeated to the value heads, g float32 broadcast over dk): KDA's arguments for the same rule.
    q, k [..., HK, dk]; v [..., HV, dv]; g, beta [..., HV]."""
    hk, hv = q.shape[-2], v.shape[-2]
    if k.shape != q.shape or v.shape[:-2] != q.shape[:-2] or hv % hk:
        raise ValueError(f"{name}: q and k must be [..., HK, dk] and v [..., HV, dv] with HV a multiple of HK; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if g.shape != v.shape[:-1] or beta.shape != v.shape[:-1]:
        raise ValueError(f"{name}: g and beta must be [..., HV] = {tuple(v.shape[:-1])}, got g {tuple(g.shape)}, "
                         f"beta {tuple(beta.shape)}")
    group = hv // hk
    q, k = (x.repeat_interleave(group, dim=-2) if group > 1 else x for x in (q, k))
    return q, k, g.float()[..., None].expand(*g.shape, q.shape[-1])


@reference_op("gdn_chunk")
def gdn_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor | None = None, scale: float | None = None, l2norm_qk: bool = True,
              chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over whole prompts (prefill), chunk by chunk: `kda_chunk`'s exact chunked form.

    q, k [B, T, HK, dk]; v [B, T, HV, dv]; g float [B, T, HV] log decay; beta [B, T, HV]; state float32
    [B, HV, dk, dv] (None: zeros); scale None means dk^-0.5. Returns (o [B, T, HV, dv] in q.dtype, final
    state float32 [B, HV, dk, dv])."""
    q, k, g = _as_kda(q, k, v, g, beta, "gdn_chunk")
    return kda.kda_chunk.reference.fn(q, k, v, g, beta, state, scale, l2norm_qk, chunk_size)


@reference_op("gdn_recurrent")
def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor | None = None, scale: float | None = None,
                  l2norm_qk: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (decode); arguments and result as `gdn_chunk`."""
    q, k, g = _as_kda(q, k, v, g, beta, "gdn_recurrent")
    return kda.kda_recurrent.reference.fn(q, k, v, g, beta, state, scale, l2norm_qk)


@reference_op("gdn_recurrent_slots")
def gdn_recurrent_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        pool: torch.Tensor, slots: torch.Tensor, scale: float | None = None,
                        l2norm_qk: bool = True) -> torch.Tensor:
    """`gdn_recurrent` of B requests whose states live in a pool: request b continues from pool[slots[b]]
    and leaves its final state there (in place). pool float32 [S, HV, dk, dv]; slots int [B], distinct.
    Returns o [B, T, HV, dv] in q.dtype."""
    q, k, g = _as_kda(q, k, v, g, beta, "gdn_recurrent_slots")
    return kda.kda_recurrent_slots.reference.fn(q, k, v, g, beta, pool, slots, scale, l2norm_qk)


@reference_op("gdn_chunk_varlen")
def gdn_chunk_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     query_start: torch.Tensor, query_start_host: tuple[int, ...], pool: torch.Tensor,
                     slots: torch.Tensor, scale: float | None = None, l2norm_qk: bool = True,
                     chunk_size: int = 64) -> torch.Tensor:
    """`gdn_chunk` of B prompt chunks of different lengths packed in one row (a step's prefills), each from
    and back to its request's state pool[slots[b]]. q, k [N, HK, dk]; v [N, HV, dv]; g, beta [N, HV];
    query_start int [B + 1] on the device and its host copy; pool float32 [S, HV, dk, dv]; slots int [B].
    Returns o [N, HV, dv] in q.dtype."""
    q, k, g = _as_kda(q, k, v, g, beta, "gdn_chunk_varlen")
    return kda.kda_chunk_varlen.reference.fn(q, k, v, g, beta, query_start, query_start_host, pool, slots, scale,
                                             l2norm_qk, chunk_size)
