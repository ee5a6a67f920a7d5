"""RMSNorm, one program per row of [rows, D]: ms = mean(x^2) in float32, n = x * rsqrt(ms + eps), then
either w * cast(n) rounded to the output (the DeepSeek/Llama order: the product of two values of the
model dtype) or cast(n * float(w)) (weight_in_float32, gpt-oss), as dayzero.ops.norm.rms_norm.
With a residual (add_rms_norm) the row is first s = cast(x + residual), stored, then normalised."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, sum_ptr, stride_x, stride_o, stride_r, stride_s, D, eps,
                     BLOCK: tl.constexpr, W_FP32: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    ms = tl.sum(x32 * x32, axis=0) / D
    n = x32 * tl.rsqrt(ms + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if W_FP32:
        y = n * w.to(tl.float32)
    else:
        y = w.to(tl.float32) * n.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float32: bool,
             residual: torch.Tensor | None = None):
    """rms_norm(x); with residual, (rms_norm(x + residual), x + residual) (add_rms_norm)."""
    d = x.shape[-1]
    rows = x.view(-1, d)
    out_dtype = x.dtype if weight_in_float32 else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    res = rows if residual is None else residual.view(-1, d)
    summed = rows if residual is None else torch.empty_like(rows)
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, res, summed, rows.stride(0), out.stride(0), res.stride(0),
                                       summed.stride(0), d, float(eps), BLOCK=block, W_FP32=weight_in_float32,
                                       ADD=residual is not None, num_warps=min(16, max(1, block // 256)))
    if residual is None:
        return out.view(*x.shape[:-1], d)
    return out.view(*x.shape[:-1], d), summed.view(*x.shape[:-1], d)
