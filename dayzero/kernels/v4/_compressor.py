"""kv_compressor (dayzero/ops/attention_v4.py) in one launch: one program per compressed entry (b, w).

The entry's slots (HCA: the window's `ratio` tokens; CSA: the previous window's first half-channels Ca,
or prev_kv / weight 0 before the first window, then this window's Cb) are read straight from kv and gate
[B, W*ratio, C], the per-channel softmax over the slots (gate + ape, float32) weighs them, and the pooled
entry is RMS-normalised: over D in chunks of BLOCK_D, storing the pooled values rounded to the model
dtype, then a second pass normalising them in place. Rounded as the reference rounds: the weights and
each weighted slot to kv's dtype, their float32 sum to kv's dtype, the normalised value times the norm
weight once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 64  # columns a loop step
TILE = 4096  # slots x columns a loop step holds at most


@triton.jit
def _compress_kernel(kv_ptr, gate_ptr, ape_ptr, w_ptr, prev_kv_ptr, prev_gate_ptr, out_ptr, W, eps,
                     RATIO: tl.constexpr, D: tl.constexpr, C: tl.constexpr, OVERLAP: tl.constexpr,
                     HAS_PREV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    s = tl.arange(0, BLOCK_S)
    SLOTS: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
    in_slots = s < SLOTS
    rows = kv_ptr + b * W * RATIO * C
    grows = gate_ptr + b * W * RATIO * C
    out = out_ptr + (b * W + w) * D
    ss = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in tl.static_range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        if OVERLAP:
            early = s < RATIO  # Ca of the window before: its tokens' channels [0, D)
            tok = tl.where(early, (w - 1) * RATIO + s, w * RATIO + s - RATIO)
            chan = tl.where(early, 0, D)[:, None] + d[None, :]
            slot_in_window = tl.where(early, s, s - RATIO)
            from_kv = in_slots & ((~early) | (w > 0))
            valid = from_kv[:, None] & dm[None, :]
            x = tl.load(rows + tok[:, None] * C + chan, mask=valid, other=0.0)
            g = tl.load(grows + tok[:, None] * C + chan, mask=valid, other=float("-inf")).to(tl.float32)
            if HAS_PREV:  # the window before the first: the tokens an earlier call kept
                pm = (early & (w == 0))[:, None] & dm[None, :]
                pk = tl.load(prev_kv_ptr + b * RATIO * C + s[:, None] * C + d[None, :], mask=pm, other=0.0)
                pg = tl.load(prev_gate_ptr + b * RATIO * C + s[:, None] * C + d[None, :], mask=pm, other=0.0)
                x = tl.where(pm, pk.to(x.dtype), x)
                g = tl.where(pm, pg.to(tl.float32), g)
                valid = valid | pm
        else:
            tok = w * RATIO + s
            chan = tl.zeros([BLOCK_S], dtype=tl.int64)[:, None] + d[None, :]
            slot_in_window = s
            valid = in_slots[:, None] & dm[None, :]
            x = tl.load(rows + tok[:, None] * C + chan, mask=valid, other=0.0)
            g = tl.load(grows + tok[:, None] * C + chan, mask=valid, other=float("-inf")).to(tl.float32)
        a = tl.load(ape_ptr + slot_in_window[:, None] * C + chan, mask=valid, other=0.0)
        g = tl.where(valid, g + a, float("-inf"))
        top = tl.max(g, 0)
        top = tl.where(top == float("-inf"), 0.0, top)  # a column of no slot (padding): weights 0
        e = tl.exp(g - top[None, :])
        total = tl.sum(e, 0)
        p = (e / tl.where(total > 0, total, 1.0)[None, :]).to(dtype).to(tl.float32)
        prod = (x.to(tl.float32) * p).to(dtype).to(tl.float32)
        pooled = tl.sum(tl.where(valid, prod, 0.0), 0).to(dtype)
        tl.store(out + d, pooled, mask=dm)
        pf = pooled.to(tl.float32)
        ss += tl.where(dm, pf * pf, 0.0)
    r = tl.rsqrt(tl.sum(ss, 0) / D + eps)
    for d0 in tl.static_range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        pooled = tl.load(out + d, mask=dm, other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
        tl.store(out + d, (wt * (pooled * r)).to(dtype), mask=dm)


def kv_compressor(kv, gate, ape, norm_weight, eps, overlap, prev_kv=None, prev_gate=None):
    """As dayzero.ops.attention_v4.kv_compressor (checked by `supports`)."""
    b, tokens, c = kv.shape
    ratio = ape.shape[0]
    d = c // 2 if overlap else c
    windows = tokens // ratio
    out = torch.empty((b, windows, d), dtype=kv.dtype, device=kv.device)
    if b and windows:
        has_prev = prev_kv is not None
        block_s = triton.next_power_of_2(2 * ratio if overlap else ratio)
        block_d = min(BLOCK_D, max(16, TILE // block_s), triton.next_power_of_2(d))  # HCA's 128 slots: 32 columns
        _compress_kernel[(b, windows)](kv, gate, ape, norm_weight, prev_kv if has_prev else kv,
                                       prev_gate if has_prev else gate, out, windows, float(eps), RATIO=ratio, D=d,
                                       C=c, OVERLAP=bool(overlap), HAS_PREV=has_prev, BLOCK_S=block_s,
                                       BLOCK_D=block_d, num_warps=8 if block_s >= 64 else 4)
    return out
