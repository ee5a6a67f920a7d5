"""Triton helpers both GQA kernels share: find a key tile's pages through a sequence's block-table row,
read the tile (and an FP8 stream's scales) from a paged stream, and the tensor-core product.

A stream's element (token j, kv head h, dim d) lives at
    data + table[j // PAGE] * stride_page + (j % PAGE) * stride_slot + h * stride_head + d
(stride(0) of the data view is the pool's page size, the last dim contiguous). An FP8 stream holds
float8_e4m3fn values and one float32 scale per FP8_GROUP values of the last dim at the same
(page, slot, head), value = data * scale, dequantized in float32 as the reference does."""

from __future__ import annotations

import triton
import triton.language as tl

from dayzero.ops.paged import FP8_GROUP

LN2_INV = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * LOG2E)
LOG2E = tl.constexpr(LN2_INV)
GROUP = tl.constexpr(FP8_GROUP)


@triton.jit
def locate(table_row, tokens, ok, PAGE: tl.constexpr, MASKED: tl.constexpr):
    """(page int64, slot) of `tokens` [BLOCK_N] (token numbers of the sequence whose table row starts at
    `table_row`); with MASKED, tokens where `ok` is False read no table entry (page 0)."""
    if MASKED:
        page = tl.load(table_row + tokens // PAGE, mask=ok, other=0)
    else:
        page = tl.load(table_row + tokens // PAGE)
    return page.to(tl.int64), tokens % PAGE


@triton.jit
def load_tile(data_ptr, scale_ptr, page, slot, ok, head, offs_d, stride_page, stride_slot, stride_head,
              sstride_page, sstride_slot, sstride_head, sstride_group, D: tl.constexpr, MASKED: tl.constexpr,
              DEQUANT: tl.constexpr):
    """[BLOCK_N, BLOCK_D] values at (page, slot) for kv `head`, dims offs_d; with MASKED, rows where `ok`
    is False are not read (they may lie in -1 pages) and give 0. DEQUANT (an FP8 stream): times the
    scales, float32; else the stream's dtype."""
    EVEN_D: tl.constexpr = offs_d.shape[0] == D
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
    if DEQUANT:
        if D <= GROUP:  # one scale per (token, head)
            s = load_row_scales(scale_ptr, page, slot, ok, head, sstride_page, sstride_slot, sstride_head, MASKED)
            x = x.to(tl.float32) * s[:, None]
        else:
            srows = page * sstride_page + slot * sstride_slot + head * sstride_head
            sptrs = scale_ptr + srows[:, None] + (offs_d // GROUP)[None, :] * sstride_group
            if MASKED or not EVEN_D:
                s = tl.load(sptrs, mask=mask, other=0.0)
            else:
                s = tl.load(sptrs)
            x = x.to(tl.float32) * s
    return x


@triton.jit
def load_row_scales(scale_ptr, page, slot, ok, head, sstride_page, sstride_slot, sstride_head, MASKED: tl.constexpr):
    """[BLOCK_N] float32 scales of an FP8 stream whose entries have one group (dim <= FP8_GROUP); 0
    where masked."""
    ptrs = scale_ptr + page * sstride_page + slot * sstride_slot + head * sstride_head
    if MASKED:
        return tl.load(ptrs, mask=ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def mma(a, b, F32: tl.constexpr):
    """a @ b accumulated in float32; F32: float32 operands multiplied exactly (no TF32 rounding)."""
    if F32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


def block_dim(n: int) -> int:
    """A tile side holding n: a power of two, at least 16 (the tensor cores' smallest)."""
    return max(16, triton.next_power_of_2(n))


def stream_args(stream) -> tuple:
    """(data, scales, page/slot/head strides of data, page/slot/head/group strides of scales) of a
    PagedStream as the kernels take them; a stream without scales passes its data and zero strides."""
    data = stream.data
    if stream.scales is None:
        return data, data, *data.stride()[:3], 0, 0, 0, 0
    return data, stream.scales, *data.stride()[:3], *stream.scales.stride()


def same_table(k, v) -> bool:
    """Whether streams k and v are paged alike (one cache group: the same table, page size): the kernels
    then look each key tile's pages up once for both."""
    tk, tv = k.block_table, v.block_table
    return (k.block_size == v.block_size and tk.data_ptr() == tv.data_ptr() and tk.shape == tv.shape
            and tk.stride() == tv.stride())
