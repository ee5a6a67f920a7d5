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
