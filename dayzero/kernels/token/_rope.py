"""RoPE, one program per (token, block of heads) of x [T, H, D] (or [T, D]): pair i of each head turns by
cos[t, i], sin[t, i] (float32), pairs (x[2i], x[2i+1]) when interleaved, else (x[i], x[i + D/2]); the
arithmetic in float32 and the result in x.dtype, as dayzero.ops.rope.rope. x may be a strided view
(the rope part of a wider projection); the output is contiguous."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xt, stride_xh, stride_ct, stride_st,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_P)
    pmask = pairs < HALF
    mask = (heads < H)[:, None] & pmask[None, :]
    c = tl.load(cos_ptr + t * stride_ct + pairs, mask=pmask, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * stride_st + pairs, mask=pmask, other=0.0)[None, :]
    if INTERLEAVED:
        ia, ib = 2 * pairs, 2 * pairs + 1
    else:
        ia, ib = pairs, pairs + HALF
    xrow = x_ptr + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh
    orow = out_ptr + (t * H + heads[:, None].to(tl.int64)) * (2 * HALF)
    a = tl.load(xrow + ia[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(xrow + ib[None, :], mask=mask, other=0.0).to(tl.float32)
    ra = a * c - b * s
    rb = a * s + b * c
    tl.store(orow + ia[None, :], ra.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(orow + ib[None, :], rb.to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    t, h, d = x3.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    block_h = min(triton.next_power_of_2(h), max(1, 2048 // d))
    grid = (t, triton.cdiv(h, block_h))
    _rope_kernel[grid](x3, cos, sin, out, h, x3.stride(0), x3.stride(1), cos.stride(0), sin.stride(0),
                       HALF=d // 2, BLOCK_H=block_h, BLOCK_P=triton.next_power_of_2(d // 2), INTERLEAVED=interleaved)
    return out if x.dim() == 3 else out.view(t, d)
