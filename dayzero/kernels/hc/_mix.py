"""DeepSeek-V4's hyper-connections (dayzero/ops/hyper_connection.py) in one launch each after one GEMM.

hyper_connection: mixes = rows @ fn^T in float32 (torch.mm; the RMS normalisation of the flattened
streams is a per-token factor, applied after the product: mixes = (rows @ fn^T) * rsqrt(mean(rows^2) +
eps)), then one program per token: the factor, pre / post / comb from the mixes (sigmoids, the row
softmax of comb and its Sinkhorn-Knopp iterations on an [n, n] tile, in the reference's order), and the
block input sum_j pre[j] * stream[j] over D in chunks. The hyper-head (fn of n rows) is pre alone.
D and the iteration count are compile-time constants (fixed per model; Triton's interpreter cannot
loop to a runtime bound).

hyper_connection_post: one program per (token, chunk of D): out[k] = post[k] * block_out + sum_j
comb[j, k] * stream[j], rounded as the reference rounds in the streams' dtype (the product, the mixed
streams, then their sum)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 1024  # columns of a stream per loop step (hyper_connection)
POST_BLOCK_D = 256  # columns per program (hyper_connection_post: an [n, n, POST_BLOCK_D] product in registers)


@triton.jit
def _mix_kernel(x_ptr, mix_ptr, base_ptr, scale_ptr, out_ptr, post_ptr, comb_ptr, hc_eps, norm_eps,
                D: tl.constexpr, ITERS: tl.constexpr, N: tl.constexpr, M: tl.constexpr, BN: tl.constexpr, BLOCK_D: tl.constexpr, HEAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BN)
    jm = j < N
    cols = tl.arange(0, BLOCK_D)
    row = x_ptr + t * N * D
    ss = tl.zeros([BN, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        m = jm[:, None] & ((d0 + cols) < D)[None, :]
        x = tl.load(row + j[:, None] * D + d0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
        ss += x * x
    r = tl.rsqrt(tl.sum(tl.sum(ss, 1), 0) / (N * D) + norm_eps)
    mix = mix_ptr + t * M
    pre = tl.load(mix + j, mask=jm, other=0.0) * r
    pre = tl.sigmoid(pre * tl.load(scale_ptr) + tl.load(base_ptr + j, mask=jm, other=0.0)) + hc_eps
    if not HEAD:
        post = tl.load(mix + N + j, mask=jm, other=0.0) * r
        post = 2 * tl.sigmoid(post * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + j, mask=jm, other=0.0))
        tl.store(post_ptr + t * N + j, post, mask=jm)
        k = tl.arange(0, BN)
        cm = jm[:, None] & (k < N)[None, :]
        idx = j[:, None] * N + k[None, :]  # comb[j, k]: input stream j into output stream k
        c = tl.load(mix + 2 * N + idx, mask=cm, other=0.0) * r
        c = c * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + idx, mask=cm, other=0.0)
        c = tl.where(cm, c, -1e30)  # finite: a padding row's max stays finite (no NaN)
        c = tl.exp(c - tl.max(c, 1)[:, None])
        c = tl.where(cm, c / tl.sum(c, 1)[:, None] + hc_eps, 0.0)
        c = c / (tl.sum(c, 0)[None, :] + hc_eps)
        for _ in range(ITERS - 1):
            c = c / (tl.sum(c, 1)[:, None] + hc_eps)
            c = c / (tl.sum(c, 0)[None, :] + hc_eps)
        tl.store(comb_ptr + t * N * N + idx, c, mask=cm)
    for d0 in range(0, D, BLOCK_D):
        dm = (d0 + cols) < D
        x = tl.load(row + j[:, None] * D + d0 + cols[None, :], mask=jm[:, None] & dm[None, :], other=0.0)
        y = tl.sum(pre[:, None] * x.to(tl.float32), 0)
        tl.store(out_ptr + t * D + d0 + cols, y.to(out_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _post_kernel(bo_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, D: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = cols < D
    j = tl.arange(0, BN)
    jm = j < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * N * D + j[:, None] * D + cols[None, :], mask=jm[:, None] & dm[None, :], other=0.0)
    bo = tl.load(bo_ptr + t * D + cols, mask=dm, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + j, mask=jm, other=0.0).to(dtype).to(tl.float32)
    c = tl.load(comb_ptr + t * N * N + j[:, None] * N + j[None, :], mask=jm[:, None] & jm[None, :], other=0.0)
    c = c.to(dtype).to(tl.float32)  # [j, k]
    mixed = tl.sum(c[:, :, None] * x.to(tl.float32)[:, None, :], 0)  # [k, BLOCK_D]
    y = (post[:, None] * bo[None, :]).to(dtype).to(tl.float32) + mixed.to(dtype).to(tl.float32)
    tl.store(out_ptr + t * N * D + j[:, None] * D + cols[None, :], y.to(dtype), mask=jm[:, None] & dm[None, :])


def hyper_connection(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
    """As dayzero.ops.hyper_connection.hyper_connection (checked there and by `supports`)."""
    *lead, n, d = streams.shape
    rows = streams.reshape(-1, n * d)
    t = rows.shape[0]
    head = fn.shape[0] == n and (2 + n) * n != n
    mixes = torch.mm(rows.float(), fn.t())
    out = torch.empty((t, d), dtype=streams.dtype, device=streams.device)
    post = comb = None
    if not head:
        post = torch.empty((t, n), dtype=torch.float32, device=streams.device)
        comb = torch.empty((t, n, n), dtype=torch.float32, device=streams.device)
    if t:
        block = min(BLOCK_D, triton.next_power_of_2(d))
        _mix_kernel[(t,)](rows, mixes, base, scale, out, out if head else post, out if head else comb,
                          float(hc_eps), float(norm_eps), D=d, ITERS=int(sinkhorn_iters), N=n, M=fn.shape[0], BN=max(2, triton.next_power_of_2(n)),
                          BLOCK_D=block, HEAD=head, num_warps=4)
    out = out.view(*lead, d)
    if head:
        return out, None, None
    return out, post.view(*lead, n), comb.view(*lead, n, n)


def hyper_connection_post(block_out, streams, post, comb):
    """As dayzero.ops.hyper_connection.hyper_connection_post (checked there and by `supports`)."""
    n, d = streams.shape[-2:]
    out = torch.empty(streams.shape, dtype=streams.dtype, device=streams.device)
    t = out.numel() // (n * d)
    if t:
        block = min(POST_BLOCK_D, triton.next_power_of_2(d))
        _post_kernel[(t, triton.cdiv(d, block))](block_out, streams, post, comb, out, D=d, N=n,
                                                 BN=max(2, triton.next_power_of_2(n)), BLOCK_D=block, num_warps=4)
    return out
