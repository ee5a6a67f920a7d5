"""DeepSeek-V4's hyper-connection kernels (dayzero/kernels/hc) against their reference ops: on CPU under
Triton's interpreter (seeded random stream counts, widths, Sinkhorn iterations, both sites), and on CUDA
at DeepSeek-V4-Flash's shapes through the registry."""

import random

import pytest
import torch

from dayzero import ops
from dayzero.ops.registry import REGISTRY
from tests.kernels.conftest import cuda, interpreter


def _ref(name, *args):
    return REGISTRY.get(name).reference.fn(*args)


def _weights(g, n, d, head, device="cpu"):
    m = n if head else (2 + n) * n
    fn = torch.randn(m, n * d, generator=g) * (n * d) ** -0.5
    base = torch.randn(m, generator=g) * 0.5
    scale = torch.rand(1 if head else 3, generator=g) + 0.5
    return fn.to(device), base.to(device), scale.to(device)


def _rel(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def _check_mix(got, want, dtype):
    out_tol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape
    assert _rel(got[0], want[0]) <= out_tol
    for a, b in zip(got[1:], want[1:]):
        if b is None:
            assert a is None
        else:
            assert a.dtype == torch.float32 and a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@interpreter
@pytest.mark.parametrize("seed", range(8))
def test_hyper_connection_interpreted(seed):
    from dayzero.kernels.hc import _mix

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n, d = rng.choice((1, 2, 3, 4, 5)), rng.choice((8, 40, 64, 100))
    tokens, head = rng.randint(1, 6), rng.random() < 0.3
    iters = rng.choice((1, 2, 20))
    dtype = rng.choice((torch.float32, torch.bfloat16))
    streams = (torch.randn(1, tokens, n, d, generator=g) * rng.choice((0.1, 1.0, 10.0))).to(dtype)
    args = (streams, *_weights(g, n, d, head), iters, 1e-6, 1e-6)
    _check_mix(_mix.hyper_connection(*args), _ref("hyper_connection", *args), dtype)


@interpreter
@pytest.mark.parametrize("seed", range(6))
def test_hyper_connection_post_interpreted(seed):
    from dayzero.kernels.hc import _mix

    rng = random.Random(100 + seed)
    g = torch.Generator().manual_seed(seed)
    n, d, tokens = rng.choice((1, 2, 4, 5)), rng.choice((8, 40, 64, 1500)), rng.randint(1, 5)
    dtype = rng.choice((torch.float32, torch.bfloat16))
    streams = torch.randn(1, tokens, n, d, generator=g).to(dtype)
    block_out = torch.randn(1, tokens, d, generator=g).to(dtype)
    post = 2 * torch.rand(1, tokens, n, generator=g)
    comb = torch.rand(1, tokens, n, n, generator=g)
    comb = comb / comb.sum(-2, keepdim=True)
    got = _mix.hyper_connection_post(block_out, streams, post, comb)
    want = _ref("hyper_connection_post", block_out, streams, post, comb)
    assert got.dtype == want.dtype and got.shape == want.shape
    # the mixed streams sum in another order than the reference's matmul, and the interpreter rounds
    # float32 -> bf16 its own way (not to nearest) at each of the three roundings: a few bf16 ulps
    assert _rel(got, want) <= {torch.float32: 1e-6, torch.bfloat16: 2.0**-5}[dtype]


def test_unsupported_calls_run_the_reference():
    from dayzero.kernels.hc import supports_hyper_connection, supports_hyper_connection_post

    g = torch.Generator().manual_seed(0)
    streams = torch.randn(1, 3, 4, 16, generator=g)
    assert not supports_hyper_connection(streams, *_weights(g, 4, 16, False), 20, 1e-6, 1e-6)  # CPU tensors
    got = ops.hyper_connection(streams, *_weights(torch.Generator().manual_seed(1), 4, 16, False), 20, 1e-6, 1e-6)
    assert got[0].shape == (1, 3, 16)
    assert not supports_hyper_connection_post(streams[..., 0, :], streams, torch.rand(1, 3, 4), torch.rand(1, 3, 4, 4))


@cuda
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hyper_connections_on_cuda_at_v4_shapes(tokens, dtype):
    """DeepSeek-V4-Flash: 4 streams of 4096, 20 Sinkhorn iterations; both sites and the hyper-head."""
    g = torch.Generator().manual_seed(tokens)
    n, d = 4, 4096
    streams = torch.randn(1, tokens, n, d, generator=g).to(dtype).cuda()
    sites = {}
    for head in (False, True):
        args = (streams, *_weights(g, n, d, head, "cuda"), 20, 1e-6, 1e-6)
        with REGISTRY.record_calls(by_backend=True) as calls:
            sites[head] = ops.hyper_connection(*args)
        assert calls == {"hyper_connection@triton": 1}
        _check_mix(sites[head], _ref("hyper_connection", *args), dtype)
    _, post, comb = sites[False]
    block_out = torch.randn(1, tokens, d, generator=g).to(dtype).cuda()
    with REGISTRY.record_calls(by_backend=True) as calls:
        out = ops.hyper_connection_post(block_out, streams, post, comb)
    assert calls == {"hyper_connection_post@triton": 1}
    assert _rel(out, _ref("hyper_connection_post", block_out, streams, post, comb)) <= (
        1e-6 if dtype == torch.float32 else 2.0**-6)  # bf16: the product and the mixed streams each round
