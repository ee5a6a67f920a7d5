"""Hyper-connection ops against a per-token float64 formulation of mHC."""

import pytest
import torch

from dayzero import ops  # noqa: F401  (built-in ops)
from dayzero.ops.hyper_connection import hyper_connection, hyper_connection_post

N, D = 4, 16


def weights(gen, rows, scales):
    fn = torch.randn(rows, N * D, generator=gen) * (N * D) ** -0.5
    return fn, torch.randn(rows, generator=gen) * 0.1, torch.rand(scales, generator=gen) + 0.5


def one_token(x, fn, base, scale, iters, eps, norm_eps):
    """x [N, D] -> (collapsed [D], post [N], comb [N, N]) step by step in float64."""
    flat = x.double().flatten()
    flat = flat / torch.sqrt((flat**2).mean() + norm_eps)
    m = fn.double() @ flat
    b, s = base.double(), scale.double()
    pre = torch.sigmoid(m[:N] * s[0] + b[:N]) + eps
    post = 2 * torch.sigmoid(m[N:2 * N] * s[1] + b[N:2 * N])
    logits = (m[2 * N:] * s[2] + b[2 * N:]).view(N, N)
    comb = torch.exp(logits - logits.logsumexp(1, keepdim=True)) + eps
    for it in range(iters):
        if it > 0:
            for r in range(N):
                comb[r] = comb[r] / (comb[r].sum() + eps)
        for c in range(N):
            comb[:, c] = comb[:, c] / (comb[:, c].sum() + eps)
    return (pre[:, None] * x.double()).sum(0), post, comb


def test_hyper_connection_matches_per_token_formulation():
    gen = torch.Generator().manual_seed(0)
    streams = torch.randn(2, 3, N, D, generator=gen)
    fn, base, scale = weights(gen, (2 + N) * N, 3)
    collapsed, post, comb = hyper_connection(streams, fn, base, scale, 20, 1e-6, 1e-6)
    assert collapsed.shape == (2, 3, D) and post.shape == (2, 3, N) and comb.shape == (2, 3, N, N)
    for b in range(2):
        for t in range(3):
            c, p, m = one_token(streams[b, t], fn, base, scale, 20, 1e-6, 1e-6)
            torch.testing.assert_close(collapsed[b, t].double(), c, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(post[b, t].double(), p, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(comb[b, t].double(), m, rtol=1e-5, atol=1e-6)
    # Sinkhorn: after 20 alternations the matrix is doubly stochastic to within eps
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, 3, N), rtol=0, atol=1e-5)
    torch.testing.assert_close(comb.sum(-1), torch.ones(2, 3, N), rtol=0, atol=1e-3)


def test_hyper_head_collapses_with_pre_only():
    gen = torch.Generator().manual_seed(1)
    streams = torch.randn(5, N, D, generator=gen)
    fn, base, scale = weights(gen, N, 1)
    collapsed, post, comb = hyper_connection(streams, fn, base, scale, 20, 1e-6, 1e-6)
    assert post is None and comb is None
    for t in range(5):
        flat = streams[t].double().flatten()
        flat = flat / torch.sqrt((flat**2).mean() + 1e-6)
        pre = torch.sigmoid((fn.double() @ flat) * scale.double() + base.double()) + 1e-6
        torch.testing.assert_close(collapsed[t].double(), (pre[:, None] * streams[t].double()).sum(0), rtol=1e-5, atol=1e-6)


def test_hyper_connection_post_mixes_streams_through_comb_columns():
    gen = torch.Generator().manual_seed(2)
    streams, out = torch.randn(3, N, D, generator=gen), torch.randn(3, D, generator=gen)
    post, comb = torch.rand(3, N, generator=gen), torch.rand(3, N, N, generator=gen)
    got = hyper_connection_post(out, streams, post, comb)
    for t in range(3):
        for k in range(N):
            want = post[t, k] * out[t] + sum(comb[t, j, k] * streams[t, j] for j in range(N))
            torch.testing.assert_close(got[t, k], want, rtol=1e-5, atol=1e-6)


def test_bfloat16_streams_keep_their_dtype():
    gen = torch.Generator().manual_seed(3)
    streams = torch.randn(2, N, D, generator=gen).bfloat16()
    fn, base, scale = weights(gen, (2 + N) * N, 3)
    collapsed, post, comb = hyper_connection(streams, fn, base, scale, 20, 1e-6, 1e-6)
    assert collapsed.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    assert hyper_connection_post(collapsed, streams, post, comb).dtype == torch.bfloat16


def test_errors():
    streams = torch.randn(2, N, D)
    fn, base, scale = weights(torch.Generator().manual_seed(4), (2 + N) * N, 3)
    with pytest.raises(ValueError, match="fn must be"):
        hyper_connection(streams, fn[:, :-1], base, scale, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="scale must be"):
        hyper_connection(streams, fn, base, scale[:1], 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="base must be"):
        hyper_connection(streams, fn, base[:-1], scale, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="block_out"):
        hyper_connection_post(torch.randn(2, D + 1), streams, torch.rand(2, N), torch.rand(2, N, N))
    with pytest.raises(ValueError, match="post"):
        hyper_connection_post(torch.randn(2, D), streams, torch.rand(2, N + 1), torch.rand(2, N, N))
