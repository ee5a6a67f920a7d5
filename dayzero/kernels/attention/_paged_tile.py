"""Triton helpers both GQA kernels share: read one tile of keys or values from a paged stream
(dayzero.ops.paged) through a sequence's block-table row, and the tensor-core product.

A stream's element (token j, kv head h, dim d) lives at
    data + table[j // PAGE] * stride_page + (j % PAGE) * stride_slot + h * stride_head + d
(stride(0) of the data view is the pool's page size, the last dim contiguous). An FP8 stream holds
float8_e4m3fn values and one float32 scale per FP8_GROUP values of the last dim at the same
(page, slot, head), value = data * scale, dequantized in float32 as the reference does."""

from __future__ import annotations

import triton
import triton.language as tl

from dayzero.ops.paged import FP8_GROUP

LOG2E = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp(x) = exp2(x * LOG2E)
GROUP = tl.constexpr(FP8_GROUP)


@triton.jit
def load_tile(data_ptr, scale_ptr, table_row, tokens, ok, head, offs_d,
              stride_page, stride_slot, stride_head, sstride_page, sstride_slot, sstride_head, sstride_group,
              D: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr, FP8: tl.constexpr):
    """[BLOCK_N, BLOCK_D] values of `tokens` [BLOCK_N] (int32 token numbers of the sequence whose table
    row starts at `table_row`) for kv `head`, dims offs_d; with MASKED, tokens where `ok` is False read
    neither the table nor the stream (they may lie in -1 pages) and give 0. FP8: dequantized, float32;
    else the stream's dtype."""
    EVEN_D: tl.constexpr = offs_d.shape[0] == D
    if MASKED:
        page = tl.load(table_row + tokens // PAGE, mask=ok, other=0)
    else:
        page = tl.load(table_row + tokens // PAGE)
    page = page.to(tl.int64)
    slot = tokens % PAGE
    rows = page * stride_page + slot * stride_slot + head * stride_head
    ptrs = data_ptr + rows[:, None] + offs_d[None, :]
    if MASKED:
        if EVEN_D:
            mask = ok[:, None]
        else:
            mask = ok[:, None] & (offs_d < D)[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0)
    elif EVEN_D:
        x = tl.load(ptrs)
    else:
        mask = (offs_d < D)[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0)
    if FP8:
        srows = page * sstride_page + slot * sstride_slot + head * sstride_head
        if D <= GROUP:  # one scale per (token, head)
            if MASKED:
                s = tl.load(scale_ptr + srows, mask=ok, other=0.0)
            else:
                s = tl.load(scale_ptr + srows)
            x = x.to(tl.float32) * s[:, None]
        else:
            sptrs = scale_ptr + srows[:, None] + (offs_d // GROUP)[None, :] * sstride_group
            if MASKED or not EVEN_D:
                s = tl.load(sptrs, mask=mask, other=0.0)
            else:
                s = tl.load(sptrs)
            x = x.to(tl.float32) * s
    return x


@triton.jit
def mma(a, b, F32: tl.constexpr):
    """a @ b accumulated in float32; F32: float32 operands multiplied exactly (no TF32 rounding)."""
    if F32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


def stream_args(stream) -> tuple:
    """(data, scales, page/slot/head strides of data, page/slot/head/group strides of scales) of a
    PagedStream as the kernels take them; a stream without scales passes its data and zero strides."""
    data = stream.data
    if stream.scales is None:
        return data, data, *data.stride()[:3], 0, 0, 0, 0
    return data, stream.scales, *data.stride()[:3], *stream.scales.stride()
