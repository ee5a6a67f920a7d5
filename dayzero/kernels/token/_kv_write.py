"""rope_kv_write in one launch: one program per (token, part) with part 0 the queries (rotated into the
output), 1 the keys (rotated into their stream's slot), 2 the values (copied into theirs). Rotation as
_rope.py (float32 arithmetic, rounded to the input dtype, then to the stream's); heads in blocks of
BLOCK_H (the head counts are compile-time: one model's). The streams are strided views of the pool (page stride, slot stride, head stride; the last
dim contiguous); q, k, v may be strided views of one projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, c, s, H: tl.constexpr, stride_sh, stride_dh, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr, ROTATE: tl.constexpr):
    pairs = tl.arange(0, BLOCK_P)
    pmask = pairs < HALF
    if INTERLEAVED:
        ia, ib = 2 * pairs, 2 * pairs + 1
    else:
        ia, ib = pairs, pairs + HALF
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < H)[:, None] & pmask[None, :]
        srow = src_ptr + heads[:, None].to(tl.int64) * stride_sh
        drow = dst_ptr + heads[:, None].to(tl.int64) * stride_dh
        a = tl.load(srow + ia[None, :], mask=mask, other=0.0)
        b = tl.load(srow + ib[None, :], mask=mask, other=0.0)
        if ROTATE:
            af, bf = a.to(tl.float32), b.to(tl.float32)
            a = (af * c - bf * s).to(src_ptr.dtype.element_ty)
            b = (af * s + bf * c).to(src_ptr.dtype.element_ty)
        tl.store(drow + ia[None, :], a.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(drow + ib[None, :], b.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kv_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, out_ptr, kd_ptr, vd_ptr, pages_ptr, offsets_ptr,
                          HQ: tl.constexpr, HKV: tl.constexpr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_ct, stride_st, stride_kp, stride_ko, stride_kdh, stride_vp, stride_vo, stride_vdh,
                          HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
                          INTERLEAVED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    pairs = tl.arange(0, BLOCK_P)
    pmask = pairs < HALF
    c = tl.load(cos_ptr + t * stride_ct + pairs, mask=pmask, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * stride_st + pairs, mask=pmask, other=0.0)[None, :]
    if part == 0:
        _rotate_heads(q_ptr + t * stride_qt, out_ptr + t * HQ * (2 * HALF), c, s, HQ, stride_qh, 2 * HALF,
                      HALF, BLOCK_H, BLOCK_P, INTERLEAVED, True)
    else:
        page = tl.load(pages_ptr + t)
        offset = tl.load(offsets_ptr + t)
        if part == 1:
            _rotate_heads(k_ptr + t * stride_kt, kd_ptr + page * stride_kp + offset * stride_ko, c, s, HKV,
                          stride_kh, stride_kdh, HALF, BLOCK_H, BLOCK_P, INTERLEAVED, True)
        else:
            _rotate_heads(v_ptr + t * stride_vt, vd_ptr + page * stride_vp + offset * stride_vo, c, s, HKV,
                          stride_vh, stride_vdh, HALF, BLOCK_H, BLOCK_P, INTERLEAVED, False)


def rope_kv_write(q, k, v, cos, sin, interleaved, k_data, v_data, pages, offsets, k_scales=None, v_scales=None):
    n, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    block_h = min(triton.next_power_of_2(max(hq, hkv)), max(1, 2048 // d))
    _rope_kv_write_kernel[(n, 3)](
        q, k, v, cos, sin, out, k_data, v_data, pages, offsets, hq, hkv, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_data.stride(0), k_data.stride(1), k_data.stride(2), v_data.stride(0), v_data.stride(1), v_data.stride(2),
        HALF=d // 2, BLOCK_H=block_h, BLOCK_P=triton.next_power_of_2(d // 2), INTERLEAVED=interleaved)
    return out
