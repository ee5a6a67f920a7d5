"""DeepSeek-V4 attention kernels (dayzero/kernels/v4) against their reference ops: on CPU under Triton's
interpreter (seeded random ratios, widths, windows, the carried window or none), and on CUDA at
DeepSeek-V4-Flash's shapes through the registry."""

import random

import pytest
import torch

from dayzero import ops
from dayzero.ops.registry import REGISTRY
from tests.kernels.conftest import cuda, interpreter


def _ref(*args):
    return REGISTRY.get("kv_compressor").reference.fn(*args)


def _case(seed, device="cpu", ratio=None, dim=None, windows=None, overlap=None, dtype=None):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    ratio = ratio or rng.choice((2, 4, 8))
    dim = dim or rng.choice((16, 40, 64, 100))
    overlap = rng.random() < 0.6 if overlap is None else overlap
    windows = windows or rng.randint(1, 3)
    dtype = dtype or rng.choice((torch.float32, torch.bfloat16))
    b, c = rng.randint(1, 3), 2 * dim if overlap else dim
    kv = torch.randn(b, windows * ratio, c, generator=g).to(dtype)
    gate = (2 * torch.randn(b, windows * ratio, c, generator=g)).to(dtype)
    ape = torch.randn(ratio, c, generator=g) * 0.5
    weight = (1 + 0.2 * torch.randn(dim, generator=g)).to(dtype)
    prev = (None, None)
    if overlap and rng.random() < 0.7:
        prev_gate = (2 * torch.randn(b, ratio, c, generator=g)).to(dtype)
        if rng.random() < 0.5:
            prev_gate[0] = float("-inf")  # no window before: the model's initial state
        prev = (torch.randn(b, ratio, c, generator=g).to(dtype), prev_gate)
    args = (kv, gate, ape, weight, 1e-6, overlap, *prev)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), dtype


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    # bf16: the weighted slots and their sum round as the reference's, but a sum may land a rounding apart
    # (and the interpreter rounds float32 -> bf16 its own way), so a few ulps of the largest value
    tol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-5}[dtype]
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err <= tol, f"max relative error {float(err):.2e}"


@interpreter
@pytest.mark.parametrize("seed", range(10))
def test_kv_compressor_interpreted(seed):
    from dayzero.kernels.v4 import _compressor

    args, dtype = _case(seed)
    _close(_compressor.kv_compressor(*args), _ref(*args), dtype)


@interpreter
@pytest.mark.parametrize("ratio, overlap", [(128, False), (64, True)])
def test_kv_compressor_with_many_slots_interpreted(ratio, overlap):
    """HCA's 128 slots (and 2 x 64): the loop steps over fewer columns (TILE)."""
    from dayzero.kernels.v4 import _compressor

    args, dtype = _case(ratio, ratio=ratio, dim=72, windows=2, overlap=overlap)
    _close(_compressor.kv_compressor(*args), _ref(*args), dtype)


def test_unsupported_calls_run_the_reference():
    from dayzero.kernels.v4 import supports_kv_compressor

    args, _ = _case(0)
    assert not supports_kv_compressor(*args)  # CPU tensors
    assert ops.kv_compressor(*args).shape[1] == args[0].shape[1] // args[2].shape[0]


@cuda
@pytest.mark.parametrize("ratio, overlap, windows", [(4, True, 1), (4, True, 33), (128, False, 1), (128, False, 9)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_compressor_on_cuda_at_v4_shapes(ratio, overlap, windows, dtype):
    """V4-Flash: CSA ratio 4 (2 x 512 channels, with the carried window), HCA ratio 128 (512); the
    indexer's compressor (2 x 128) too."""
    for dim in (512, 128) if overlap else (512,):
        args, _ = _case(ratio + windows + dim, "cuda", ratio, dim, windows, overlap, dtype)
        with REGISTRY.record_calls(by_backend=True) as calls:
            got = ops.kv_compressor(*args)
        assert calls == {"kv_compressor@triton": 1}
        _close(got, _ref(*args), dtype)


def _attention_case(seed, device="cpu", h=None, d=None, window=None, t=None, past=None, mode=None, dtype=None,
                    topk=None):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    b = rng.randint(1, 3)
    h, d = h or rng.choice((1, 4, 20)), d or rng.choice((16, 40, 64))
    window, ratio = window or rng.choice((1, 4, 9, 40)), rng.choice((2, 4))
    t, past = t or rng.choice((1, 1, 5, 17)), rng.choice((0, 3, 50)) if past is None else past
    mode = mode or rng.choice(("window", "hca", "csa"))
    dtype = dtype or rng.choice((torch.float32, torch.bfloat16))
    s = past + t
    q = torch.randn(b, t, h, d, generator=g).to(dtype)
    kv = torch.randn(b, s, d, generator=g).to(dtype)
    sinks = torch.randn(h, generator=g)
    positions = torch.arange(past, s).repeat(b, 1)
    kv_lens = torch.tensor([s - rng.randint(0, past) for _ in range(b)]) if past and b > 1 else None
    compressed = indices = clens = None
    if mode != "window":
        n = s // ratio
        compressed = torch.randn(b, n, d, generator=g).to(dtype)
        if mode == "csa":
            limit = (positions + 1) // ratio
            scores = torch.rand(b, t, n, generator=g).masked_fill(torch.arange(n) >= limit.unsqueeze(-1), float("-inf"))
            from dayzero.ops.attention_v4 import v4_topk_select
            indices = v4_topk_select(scores, topk or rng.choice((1, 3, 8, 40)))
        elif b > 1 and n:
            clens = torch.tensor([n - rng.randint(0, min(n, 2)) for _ in range(b)])
    args = (q, kv, sinks, d**-0.5, window, compressed, indices, positions, ratio, kv_lens, clens)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), dtype


def _attention_ref(*args):
    return REGISTRY.get("sparse_attention").reference.fn(*args)


@interpreter
@pytest.mark.parametrize("seed", range(12))
def test_sparse_attention_interpreted(seed):
    from dayzero.kernels.v4 import _attention

    args, dtype = _attention_case(seed)
    got, want = _attention.sparse_attention(*args), _attention_ref(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err <= (1e-5 if dtype == torch.float32 else 2.0**-6), f"{float(err):.2e}"


def test_unsupported_attention_runs_the_reference():
    from dayzero.kernels.v4 import supports_sparse_attention

    args, _ = _attention_case(0)
    assert not supports_sparse_attention(*args)  # CPU tensors
    assert ops.sparse_attention(*args).shape == args[0].shape


@cuda
@pytest.mark.parametrize("mode", ["window", "csa", "hca"])
@pytest.mark.parametrize("t, past", [(1, 300), (1, 5000), (200, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_attention_on_cuda_at_v4_shapes(mode, t, past, dtype):
    """V4-Flash: 64 heads of 512, window 128, CSA top-512 / HCA, decodes and a prefill block."""
    args, _ = _attention_case(t + past, "cuda", 64, 512, 128, t, past, mode, dtype, topk=512)
    with REGISTRY.record_calls(by_backend=True) as calls:
        got = ops.sparse_attention(*args)
    assert calls == {"sparse_attention@triton": 1}
    want = _attention_ref(*args)
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err <= (1e-5 if dtype == torch.float32 else 2.0**-6), f"{float(err):.2e}"


def _index_case(seed, device="cpu", h=None, d=None, t=None, past=None, dtype=None, k=None):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    b, ratio = rng.randint(1, 3), rng.choice((2, 4))
    h, d = h or rng.choice((1, 4, 16)), d or rng.choice((16, 32, 64))
    t, past = t or rng.choice((1, 1, 6)), rng.choice((0, 9, 90)) if past is None else past
    dtype = dtype or rng.choice((torch.float32, torch.bfloat16))
    s = past + t
    n = s // ratio
    q = torch.randn(b, t, h, d, generator=g).to(dtype)
    keys = torch.randn(b, n, d, generator=g).to(dtype)
    weights = torch.randn(b, t, h, generator=g).to(dtype)
    positions = torch.arange(past, s).repeat(b, 1)
    lens = torch.tensor([n - rng.randint(0, min(n, 3)) for _ in range(b)]) if b > 1 and n else None
    k = k or rng.choice((1, 4, 30))
    args = (q, keys, weights, positions, ratio, k, lens)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _check_index(got, args, rel=1e-5):
    """The kernel's picks against the reference's: as many, each visible, and the same scores (a swap of
    two entries one rounding apart allowed)."""
    from dayzero.ops.attention_v4 import v4_indexer

    want = REGISTRY.get("v4_index_topk").reference.fn(*args)
    assert got.shape == want.shape and got.dtype == torch.int64
    assert torch.equal((got >= 0).sum(-1), (want >= 0).sum(-1))
    if got.numel() == 0:  # no entry yet
        return 1.0
    q, keys, weights, positions, ratio, k, lens = args
    scores = v4_indexer(q, keys, weights, positions, ratio, lens)
    mine = scores.gather(-1, got.clamp(min=0)).masked_fill(got < 0, 0)
    theirs = scores.gather(-1, want.clamp(min=0)).masked_fill(want < 0, 0)
    assert torch.isfinite(mine).all(), "a pick is not visible"
    tol = rel * float(scores.masked_fill(~torch.isfinite(scores), 0).abs().max().clamp_min(1e-6))
    torch.testing.assert_close(mine, theirs, rtol=0, atol=tol)
    return float((got == want).all(-1).float().mean())


@interpreter
@pytest.mark.parametrize("seed", range(10))
def test_v4_index_topk_interpreted(seed):
    from dayzero.kernels.v4 import _index

    args = _index_case(seed)
    same = _check_index(_index.v4_index_topk(*args), args, 1e-2 if args[0].dtype == torch.bfloat16 else 1e-5)
    assert same >= 0.5


@interpreter
def test_v4_index_topk_ties_and_the_radix_variant_select_as_the_reference():
    """All-zero queries: every visible entry ties at 0, ranked by position, exactly the reference's; the
    radix top-k selects the same."""
    from dayzero import settings
    from dayzero.kernels.v4 import _index

    args = _index_case(3, t=3, past=40, dtype=torch.float32, k=7)
    q = args[0].clone()
    q[:, 1] = 0
    args = (q,) + args[1:]
    want = REGISTRY.get("v4_index_topk").reference.fn(*args)
    got = _index.v4_index_topk(*args)
    assert torch.equal(got[:, 1], want[:, 1])
    with settings.override(variants={"v4_index_topk": "radix"}):
        assert torch.equal(_index.v4_index_topk(*args), got)


@cuda
@pytest.mark.parametrize("t, past", [(1, 4096), (1, 131072), (300, 8192)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_v4_index_topk_on_cuda_at_v4_shapes(t, past, dtype):
    """V4-Flash's indexer: 64 heads of 128, top-512, ratio 4."""
    args = _index_case(t + past, "cuda", 64, 128, t, past, dtype, 512)
    args = args[:4] + (4,) + args[5:]
    with REGISTRY.record_calls(by_backend=True) as calls:
        got = ops.v4_index_topk(*args)
    assert calls == {"v4_index_topk@triton": 1}
    _check_index(got, args, 1e-2 if dtype == torch.bfloat16 else 1e-5)
