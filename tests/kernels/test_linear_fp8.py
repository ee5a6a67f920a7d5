"""linear_fp8_block's kernels (dayzero/kernels/linear) against the reference op: on CPU under Triton's
interpreter (seeded random shapes off the block grid, float32 and E8M0 scales, bias, both paths, forced
K splits), and on CUDA at DeepSeek-V3.2 / V4 shapes through the registry."""

import random

import pytest
import torch

from dayzero import ops, settings
from dayzero.ops.registry import REGISTRY
from tests.kernels.conftest import cuda, interpreter


def _weights(g, n, k, block, e8m0, device="cpu"):
    grid = (-(-n // block[0]), -(-k // block[1]))
    w = (torch.randn(n, k, generator=g) * 2).to(torch.float8_e4m3fn)
    if e8m0:
        scale = torch.randint(118, 130, grid, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    else:
        scale = torch.rand(grid, generator=g) * 0.02 + 1e-3  # not powers of two: the rounding is tested too
    return w.to(device), scale.to(device)


def _ref(x, w, scale, bias, block):
    return REGISTRY.get("linear_fp8_block").reference.fn(x, w, scale, bias, block)


def _rel(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


@interpreter
@pytest.mark.parametrize("seed", range(8))
def test_linear_fp8_block_interpreted(seed):
    from dayzero.kernels.linear import _fp8_block

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    block = (rng.choice((16, 32, 128)), rng.choice((16, 32)))
    n, k, m = rng.randint(1, 100), rng.randint(1, 130), rng.choice((1, 3, 17, 70))
    dtype = rng.choice((torch.float32, torch.bfloat16))
    w, scale = _weights(g, n, k, block, rng.random() < 0.5)
    x = torch.randn(2, m, k, generator=g).to(dtype)[:, ::1]
    bias = torch.randn(n, generator=g).to(dtype) if rng.random() < 0.5 else None
    want = _ref(x, w, scale, bias, block)
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    for path in ("fused", "dequant"):
        with settings.override(variants={"linear_fp8_block": path}):
            got = _fp8_block.linear_fp8_block(x, w, scale, bias, block)
        assert got.dtype == dtype and got.shape == want.shape
        assert _rel(got, want) <= tol, path
    # the fused GEMM split over K (on CUDA chosen by the SM count): partial sums, then the bias
    got = _fp8_block._fused(x.reshape(-1, k), w, scale, bias, block, sms=64)
    assert _rel(got, want.reshape(-1, n)) <= tol


@interpreter
def test_the_dequantize_pass_equals_the_reference_bit_for_bit():
    """Every e4m3 byte (NaNs and subnormals included) under float32 and E8M0 scales, rounded once."""
    from dayzero.formats.fp8 import dequantize_weight_blocks
    from dayzero.kernels.linear._fp8_block import dequantize

    w = torch.arange(256, dtype=torch.uint8).repeat(4, 1).view(torch.float8_e4m3fn)  # [4, 256]: every byte
    e8m0 = torch.tensor([[0, 127], [140, 255]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    cases = [(torch.tensor([[0.37, 1.0], [3.0e-3, 2.0**-20]]), (torch.float32, torch.bfloat16)),
             (e8m0, (torch.float32,)),  # 2^-127 x subnormal e4m3: float32 subnormals, which torch's CPU
             (e8m0.view(torch.uint8).clamp(min=100).view(torch.float8_e8m0fnu), (torch.bfloat16,))]  # bf16 rounds its own way
    for scale, dtypes in cases:
        for dtype in dtypes:
            got = dequantize(w, scale, (2, 128), dtype)
            want = dequantize_weight_blocks(w, scale, (2, 128), dtype)
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_supports_declines_what_the_kernel_does_not_take():
    from dayzero.kernels.linear import supports_linear_fp8_block

    w, scale = _weights(torch.Generator().manual_seed(0), 256, 256, (128, 128), False)
    x = torch.randn(3, 256)
    assert not supports_linear_fp8_block(x, w, scale)  # CPU tensors: the reference runs


@cuda
@pytest.mark.parametrize("n, k, m", [(1536, 7168, 1), (24576, 1536, 7), (7168, 18432, 64), (4096, 8192, 300),
                                     (2112, 7168, 2048)])
@pytest.mark.parametrize("e8m0", [False, True])
def test_linear_fp8_block_on_cuda(n, k, m, e8m0):
    g = torch.Generator().manual_seed(n + k + m)
    w, scale = _weights(g, n, k, (128, 128), e8m0, "cuda")
    x = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=g).to("cuda", torch.bfloat16) if m % 2 else None
    want = _ref(x, w, scale, bias, (128, 128))
    with REGISTRY.record_calls(by_backend=True) as calls:
        got = ops.linear_fp8_block(x, w, scale, bias, (128, 128))
    assert calls == {"linear_fp8_block@triton": 1}
    assert _rel(got, want) <= 2.0**-7
    for path in ("fused", "dequant"):
        with settings.override(variants={"linear_fp8_block": path}):
            assert _rel(ops.linear_fp8_block(x, w, scale, bias, (128, 128)), want) <= 2.0**-7, path
