"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): n parallel residual streams per token.

Around every attention and MLP block the n streams [.., n, D] are
  1. read:  a one-layer perceptron on the RMS-normalised, flattened streams gives per token
            pre [n] = sigmoid(.) + eps, post [n] = 2 sigmoid(.) and comb [n, n] = softmax(.) + eps
            projected towards a doubly-stochastic matrix by Sinkhorn-Knopp; the block input is
            sum_j pre[j] * stream[j]                                 (`hyper_connection`)
  2. write: new stream[k] = post[k] * block_output + sum_j comb[j, k] * stream[j]
                                                                     (`hyper_connection_post`)
The final hyper-head is step 1 alone with pre only (n mixing weights, one scale).

Weights as DeepSeek ships them (float32): fn [m, n*D], base [m], scale [3] (block sites, m = (2+n)*n,
laid out pre | post | comb row-major) or scale [1] (hyper-head, m = n).
"""

from __future__ import annotations

import torch

from dayzero.ops.registry import reference_op


def _check(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor) -> tuple[int, bool]:
    if streams.dim() < 3:
        raise ValueError(f"hyper_connection: streams must be [..., n, D], got {tuple(streams.shape)}")
    n, d = streams.shape[-2:]
    block_rows, head_rows = (2 + n) * n, n
    if fn.dim() != 2 or fn.shape[1] != n * d or fn.shape[0] not in (block_rows, head_rows):
        raise ValueError(
            f"hyper_connection: fn must be [{block_rows} (block) or {head_rows} (head), n*D = {n * d}], got {tuple(fn.shape)}"
        )
    head = fn.shape[0] == head_rows and block_rows != head_rows
    if base.shape != (fn.shape[0],):
        raise ValueError(f"hyper_connection: base must be [{fn.shape[0]}], got {tuple(base.shape)}")
    if scale.shape != ((1,) if head else (3,)):
        raise ValueError(f"hyper_connection: scale must be [{1 if head else 3}] (pre{'' if head else ', post, comb'}), got {tuple(scale.shape)}")
    return n, head


@reference_op("hyper_connection")
def hyper_connection(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Mixing weights of one hyper-connection site and the collapsed block input.

    streams: [..., n, D] in the model dtype. fn / base / scale as in the module docstring.
    Returns (collapsed [..., D] in streams.dtype, post float32 [..., n], comb float32 [..., n, n]);
    post and comb are None for the hyper-head (fn with n rows). comb[j, k] weighs input stream j
    into output stream k: after `sinkhorn_iters` alternations (columns first, then rows and
    columns) its columns sum to 1 up to eps. All mixing math is float32; the flattened streams are
    RMS-normalised (no weight, `norm_eps`) before the projection.
    """
    n, head = _check(streams, fn, base, scale)
    flat = streams.flatten(-2).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(flat, fn.float())
    scale, base = scale.float(), base.float()
    if head:
        pre = torch.sigmoid(mixes * scale + base) + hc_eps
        return (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype), None, None

    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype)
    return collapsed, post, comb


@reference_op("hyper_connection_post")
def hyper_connection_post(
    block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams after a block: out[..., k, :] = post[..., k] * block_out + sum_j comb[..., j, k] * streams[..., j, :].

    block_out [..., D], streams [..., n, D] (model dtype), post [..., n], comb [..., n, n] (float32,
    from `hyper_connection`). Computed in streams.dtype (post and comb are cast first, as upstream)."""
    n, d = streams.shape[-2:]
    if block_out.shape != streams.shape[:-2] + (d,):
        raise ValueError(f"hyper_connection_post: block_out {tuple(block_out.shape)} must be streams {tuple(streams.shape)} without the n axis")
    if post.shape != streams.shape[:-1] or comb.shape != streams.shape[:-2] + (n, n):
        raise ValueError(
            f"hyper_connection_post: post {tuple(post.shape)} must be [..., {n}] and comb {tuple(comb.shape)} [..., {n}, {n}] "
            f"for streams {tuple(streams.shape)}"
        )
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
