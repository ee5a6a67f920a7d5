"""Top-k expert routing on the GPU: one Triton kernel for every routing function the models use,
registered beside the reference ops (dayzero/ops/routing_*.py), with no host synchronisation.

    route_softmax_topk     softmax routing (gpt-oss): top-k logits, softmax over them (or over all E)
    route_sigmoid_grouped  DeepSeek-V3 / Kimi noaux_tc: sigmoid + correction bias, group limit
    route_sqrtsoftplus     DeepSeek-V4: sqrt(softplus) + correction bias
    route_hash             DeepSeek-V4 hash layers: experts from a token id -> experts table

Layout. A program owns BLOCK_T tokens and holds their E logits in registers as a float32 tile
[BLOCK_T, BLOCK_E] (BLOCK_E = E rounded up to a power of two, E <= 512), in one warp so every
reduction along E stays inside the warp; BLOCK_T keeps it at <= 8 scores per lane (one token per
program from E = 256 up). The cost is the chain of dependent reductions (2 per chosen expert, 3 per
group, 2 per kept group), so many short programs beat fewer long ones. Selection is k rounds of (max, lowest index attaining it)
over the eligible experts; the chosen logits are then re-read (a gather from L1/L2) to form the
weights. Outputs: ids int64 [T, k] and weights float32 [T, k], in the reference's order (choice value
descending; table order for hash).

Ties. The kernel picks, among equal choice values, the lowest expert index first (groups likewise).
The reference leaves exact ties to torch.topk, which follows no documented rule (its CPU partial sort
returns tied indices in an order that depends on E and k), so only inputs without exact ties give the
same ids from both. NaN choice values count as +inf (torch.topk also ranks NaN first), so ids are
always distinct and in [0, E).

Numerics. Scores use the fast exp of the device; log1p is an atanh series (exact to float32 for
arguments in (0, 1]) so that sqrt(softplus(x)) keeps its relative precision for very negative x.
Weights agree with the reference within float32 rounding (a few ulp).

Hash routing. The reference raises on token ids outside [0, vocab) or table entries outside [0, E);
checking needs a host synchronisation, so here such a slot gets id -1 (which moe dispatch drops) and
weight 0, and is left out of its row's normalising sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.routing._checks import (SCORE_CODE, SIGMOID, SOFTMAX, SQRTSOFTPLUS, check_hash_call,
                                             check_sigmoid_grouped_call, check_softmax_call, check_sqrtsoftplus_call)


# -- the kernel -----------------------------------------------------------------------------------

@triton.jit
def _log1p_unit(y):
    """log(1 + y) for y in [0, 1], to float32 precision: 2 atanh(z), z = y / (2 + y) <= 1/3 (series to z^15)."""
    z = y / (2.0 + y)
    z2 = z * z
    p = 1.0 / 15.0
    p = p * z2 + 1.0 / 13.0
    p = p * z2 + 1.0 / 11.0
    p = p * z2 + 1.0 / 9.0
    p = p * z2 + 1.0 / 7.0
    p = p * z2 + 1.0 / 5.0
    p = p * z2 + 1.0 / 3.0
    p = p * z2 + 1.0
    return 2.0 * z * p


@triton.jit
def _score(x, SCORE: tl.constexpr):
    """sigmoid or sqrt(softplus) of float32 x (softmax needs the whole row; the caller does it)."""
    if SCORE == 1:
        return 1.0 / (1.0 + tl.exp(-x))
    else:
        return tl.sqrt(tl.maximum(x, 0.0) + _log1p_unit(tl.exp(-tl.abs(x))))


@triton.jit
def _argmax_rows(values, eligible, cols, SENTINEL: tl.constexpr):
    """Per row of values [R, C]: the lowest column attaining the max over the eligible columns."""
    masked = tl.where(eligible, values, float("-inf"))
    best = tl.max(masked, axis=1)
    hit = eligible & (masked == best[:, None])
    return tl.min(tl.where(hit, cols[None, :], SENTINEL), axis=1)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, token_ids_ptr, table_ptr, ids_ptr, weights_ptr,
                  T, E, stride_t, stride_e, stride_bias, stride_token, stride_vocab, stride_slot,
                  vocab, per_group, scaling, eps,
                  TOP_K: tl.constexpr, SCORE: tl.constexpr, HASH: tl.constexpr, HAS_BIAS: tl.constexpr,
                  N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORMALIZE: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    k = tl.arange(0, BLOCK_K)
    row_ok = t < T
    valid = row_ok[:, None] & (e < E)[None, :]
    k_ok = row_ok[:, None] & (k < TOP_K)[None, :]
    rows = logits_ptr + t.to(tl.int64)[:, None] * stride_t

    if SCORE == 0 or not HASH:  # the whole row: softmax's max and sum, or the top-k choice
        x = tl.load(rows + e[None, :] * stride_e, mask=valid, other=0.0).to(tl.float32)
    if SCORE == 0:
        in_row = (e < E)[None, :]  # (padding rows hold zeros: finite max and sum)
        row_max = tl.max(tl.where(in_row, x, float("-inf")), axis=1)
        row_sum = tl.sum(tl.where(in_row, tl.exp(x - row_max[:, None]), 0.0), axis=1)

    if HASH:
        token = tl.load(token_ids_ptr + t * stride_token, mask=row_ok, other=-1).to(tl.int64)
        token_ok = row_ok & (token >= 0) & (token < vocab)
        slot = tl.load(table_ptr + token[:, None] * stride_vocab + k[None, :] * stride_slot, mask=token_ok[:, None] & k_ok, other=-1)
        ids = tl.where((slot >= 0) & (slot < E), slot, -1).to(tl.int32)
    else:
        choice = x  # softmax ranks by logit (monotone)
        if SCORE != 0:
            choice = _score(x, SCORE)
        if HAS_BIAS:
            choice += tl.load(bias_ptr + e * stride_bias, mask=e < E, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(choice != choice, float("inf"), choice)  # NaN ranks first, as in torch.topk
        eligible = valid
        if TOPK_GROUP < N_GROUP:
            # Group score: the sum of the group's two best choices with a bias, its best without.
            group = e // per_group
            g_cols = tl.arange(0, BLOCK_G)
            group_score = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
            for g in tl.static_range(N_GROUP):
                in_group = valid & (group == g)[None, :]
                members = tl.where(in_group, choice, float("-inf"))
                score = tl.max(members, axis=1)
                if HAS_BIAS:
                    first = _argmax_rows(members, in_group, e, BLOCK_E)
                    score += tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), members), axis=1)
                group_score = tl.where(g_cols[None, :] == g, score[:, None], group_score)
            g_left = (g_cols < N_GROUP)[None, :] & row_ok[:, None]
            keep = tl.zeros([BLOCK_T, BLOCK_E], tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                best_group = _argmax_rows(group_score, g_left, g_cols, BLOCK_G)
                g_left &= g_cols[None, :] != best_group[:, None]
                keep |= group[None, :] == best_group[:, None]
            eligible &= keep
        ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
        for i in range(TOP_K):
            best = _argmax_rows(choice, eligible, e, BLOCK_E)
            ids = tl.where(k[None, :] == i, best[:, None], ids)
            eligible &= e[None, :] != best[:, None]

    picked = (k < TOP_K)[None, :] & (ids >= 0)  # padding rows compute on zeros; their stores are masked
    x_chosen = tl.load(rows + ids * stride_e, mask=picked & row_ok[:, None], other=0.0).to(tl.float32)
    if SCORE == 0:
        s = tl.exp(x_chosen - row_max[:, None]) / row_sum[:, None]
    else:
        s = _score(x_chosen, SCORE)
    s = tl.where(picked, s, 0.0)
    if NORMALIZE:
        s = s / (tl.sum(s, axis=1)[:, None] + eps)
    out = t.to(tl.int64)[:, None] * TOP_K + k[None, :]
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=k_ok)
    tl.store(weights_ptr + out, s * scaling, mask=k_ok)


def _launch(logits, top_k, score, *, bias=None, token_ids=None, table=None, n_group=1, topk_group=1,
            normalize=True, scaling=1.0, eps=1e-20, block_t=None, num_warps=1):
    T, E = logits.shape
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, weights
    block_e = triton.next_power_of_2(E)
    if block_t is None:  # at most 8 scores per lane: more, shorter programs (bench/routing.py sweeps this)
        block_t = min(max(1, 256 // block_e), triton.next_power_of_2(T))
    hashed = table is not None
    _route_kernel[(triton.cdiv(T, block_t),)](
        logits, bias if bias is not None else logits, token_ids if hashed else logits, table if hashed else logits,
        ids, weights, T, E, logits.stride(0), logits.stride(1), bias.stride(0) if bias is not None else 0,
        token_ids.stride(0) if hashed else 0, table.stride(0) if hashed else 0, table.stride(1) if hashed else 0,
        table.shape[0] if hashed else 0, E // n_group,
        float(scaling), float(eps),
        TOP_K=top_k, SCORE=score, HASH=hashed, HAS_BIAS=bias is not None, N_GROUP=n_group,
        TOPK_GROUP=topk_group, NORMALIZE=normalize, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_G=triton.next_power_of_2(n_group), num_warps=num_warps)
    return ids, weights


# -- entry points (the reference ops' signatures) -------------------------------------------------

def route_softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool = True):
    """route_softmax_topk on the GPU: renormalize -> softmax over the k largest logits (as p_i / sum of
    the chosen p, no epsilon), else the chosen entries of the softmax over all E."""
    check_softmax_call(logits, top_k, renormalize)
    return _launch(logits, top_k, SOFTMAX, normalize=renormalize, eps=0.0)


def route_sigmoid_grouped(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, n_group: int = 1,
                          topk_group: int = 1, normalize: bool = True, scaling_factor: float = 1.0):
    """route_sigmoid_grouped (DeepSeek-V3 noaux_tc) on the GPU; ids ordered by biased score, descending."""
    check_sigmoid_grouped_call(logits, correction_bias, top_k, n_group, topk_group, normalize, scaling_factor)
    if topk_group == n_group:  # every group stays: no group pass
        n_group = topk_group = 1
    return _launch(logits, top_k, SIGMOID, bias=correction_bias, n_group=n_group, topk_group=topk_group,
                   normalize=normalize, scaling=scaling_factor)


def route_sqrtsoftplus(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, scaling: float = 1.0):
    """route_sqrtsoftplus (DeepSeek-V4) on the GPU."""
    check_sqrtsoftplus_call(logits, correction_bias, top_k, scaling)
    return _launch(logits, top_k, SQRTSOFTPLUS, bias=correction_bias, scaling=scaling)


def route_hash(logits: torch.Tensor, token_ids: torch.Tensor, tid2eid: torch.Tensor, scaling: float = 1.0,
               score_function: str = "sqrtsoftplus"):
    """route_hash (DeepSeek-V4 hash layers) on the GPU; out-of-range token ids or table entries give id -1
    and weight 0 (the reference raises)."""
    check_hash_call(logits, token_ids, tid2eid, scaling, score_function)
    return _launch(logits, tid2eid.shape[1], SCORE_CODE[score_function], token_ids=token_ids, table=tid2eid,
                   scaling=scaling)
