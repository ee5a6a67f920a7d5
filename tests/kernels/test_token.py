"""The per-token layer kernels (dayzero/kernels/token/: rms_norm, add_rms_norm, rope) against their reference ops,
on CPU under Triton's interpreter (small shapes, seeded random sizes) and on CUDA (model shapes,
through the registry)."""

import random

import pytest
import torch

from dayzero import ops
from dayzero.ops.registry import REGISTRY
from tests.kernels.conftest import cuda, interpreter


def _ref(name, *args, **kwargs):
    return REGISTRY.get(name).reference.fn(*args, **kwargs)


def _close(got, want, dtype):
    """Equal up to the output dtype's rounding: two ulps of the largest value (the kernels sum in another
    order than torch, so a value can land on the other side of a rounding boundary, and RMSNorm rounds
    twice: the normalised value, then its product with the weight)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = {torch.float32: 2.0**-19, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}[dtype]
    err = (got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)
    assert err <= ulp, f"max relative error {float(err):.2e} over one {dtype} ulp"


@interpreter
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_float32", [False, True])
def test_rms_norm_interpreted(seed, dtype, weight_in_float32):
    from dayzero.kernels.token import _rms_norm

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    d, rows = rng.choice((16, 48, 100, 128)), rng.randint(1, 9)
    x = (torch.randn(rows, 2, d, generator=g) * rng.choice((0.01, 1.0, 30.0))).to(dtype)
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    got = _rms_norm.rms_norm(x, w, 1e-5, weight_in_float32)
    _close(got, _ref("rms_norm", x, w, 1e-5, weight_in_float32), dtype)


@interpreter
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_float32", [False, True])
def test_add_rms_norm_interpreted(seed, dtype, weight_in_float32):
    """The sum within an ulp of the unfused add's (Triton's interpreter rounds float32 -> bf16 its own
    way; on CUDA the sum is bitwise the add's, test_add_rms_norm_cuda), the norm within an ulp."""
    from dayzero.kernels.token import _rms_norm

    rng = random.Random(50 + seed)
    g = torch.Generator().manual_seed(seed)
    d, rows = rng.choice((16, 48, 100, 128)), rng.randint(1, 9)
    x = (torch.randn(rows, 2, d, generator=g) * rng.choice((0.01, 1.0, 30.0))).to(dtype)
    r = (torch.randn(rows, 2, d, generator=g) * 10).to(dtype)
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    normed, summed = _rms_norm.rms_norm(x, w, 1e-5, weight_in_float32, r)
    want_normed, want_summed = _ref("add_rms_norm", x, r, w, 1e-5, weight_in_float32)
    _close(summed, want_summed, dtype)
    _close(normed, want_normed, dtype)


def test_add_rms_norm_reference_is_the_add_then_the_norm():
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 8, generator=g).bfloat16(), torch.randn(3, 8, generator=g).bfloat16()
    w = torch.rand(8, generator=g).bfloat16()
    normed, summed = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, r + x) and torch.equal(normed, ops.rms_norm(r + x, w, 1e-6))
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, r[:2], w, 1e-6)


@interpreter
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_interpreted(seed, interleaved):
    from dayzero.kernels.token import _rope

    rng = random.Random(100 + seed)
    g = torch.Generator().manual_seed(seed)
    t, h, d = rng.randint(1, 6), rng.choice((1, 3, 8)), rng.choice((8, 16, 64))
    dtype = rng.choice((torch.float32, torch.bfloat16))
    wide = torch.randn(t, h, d + 24, generator=g).to(dtype)
    x = wide[..., 24:] if rng.random() < 0.5 else wide[..., :d].contiguous()  # a strided view, or not
    angles = torch.rand(t, d // 2, generator=g) * 20
    cos, sin = angles.cos(), angles.sin()
    _close(_rope.rope(x, cos, sin, interleaved), _ref("rope", x, cos, sin, interleaved), dtype)
    x2 = x[:, 0]  # [T, D]
    _close(_rope.rope(x2, cos, sin, interleaved), _ref("rope", x2, cos, sin, interleaved), dtype)


@cuda
@pytest.mark.parametrize("d", [64, 2880, 7168])
@pytest.mark.parametrize("weight_in_float32", [False, True])
def test_rms_norm_cuda(d, weight_in_float32):
    x = torch.randn(257, d, device="cuda", dtype=torch.bfloat16) * 3
    w = (1 + 0.3 * torch.randn(d, device="cuda")).bfloat16()
    with REGISTRY.record_calls(by_backend=True) as calls:
        got = ops.rms_norm(x, w, 1e-5, weight_in_float32=weight_in_float32)
    assert calls == {"rms_norm@triton": 1}
    _close(got, _ref("rms_norm", x, w, 1e-5, weight_in_float32), torch.bfloat16)


@cuda
@pytest.mark.parametrize("d", [64, 2880, 7168])
@pytest.mark.parametrize("weight_in_float32", [False, True])
def test_add_rms_norm_cuda(d, weight_in_float32):
    x = torch.randn(257, d, device="cuda", dtype=torch.bfloat16) * 3
    r = torch.randn(257, d, device="cuda", dtype=torch.bfloat16) * 30
    w = (1 + 0.3 * torch.randn(d, device="cuda")).bfloat16()
    with REGISTRY.record_calls(by_backend=True) as calls:
        normed, summed = ops.add_rms_norm(x, r, w, 1e-5, weight_in_float32=weight_in_float32)
    assert calls == {"add_rms_norm@triton": 1}
    want_normed, want_summed = _ref("add_rms_norm", x, r, w, 1e-5, weight_in_float32)
    assert torch.equal(summed, want_summed)
    _close(normed, want_normed, torch.bfloat16)


@cuda
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_cuda(interleaved):
    x = torch.randn(300, 64, 64 + 128, device="cuda", dtype=torch.bfloat16)[..., 128:]  # q_pe of a wider q
    angles = torch.rand(300, 32, device="cuda") * 1000
    with REGISTRY.record_calls(by_backend=True) as calls:
        got = ops.rope(x, angles.cos(), angles.sin(), interleaved=interleaved)
    assert calls == {"rope@triton": 1}
    _close(got, _ref("rope", x, angles.cos(), angles.sin(), interleaved), torch.bfloat16)


def _kv_write_case(g, n, hq, hkv, d, dtype, device, blocks=7, per_block=4):
    """q, k, v as strided views of one projection, cos/sin, two strided streams (views of one arena, as
    the pool keeps them) and shuffled distinct slots."""
    qkv = torch.randn(n, hq + 2 * hkv, d, generator=g).to(dtype).to(device)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    angles = torch.rand(n, d // 2, generator=g) * 50
    arena = torch.randn(2, blocks, per_block, hkv, d, generator=g).to(dtype).to(device)
    slots = torch.randperm(blocks * per_block, generator=g)[:n]
    pages, offsets = (slots // per_block).to(device), (slots % per_block).to(device)
    return q, k, v, angles.cos().to(device), angles.sin().to(device), arena, pages, offsets


def _check_kv_write(fn, case, interleaved, dtype):
    """fn's output and streams against the reference's; returns the calls fn made through the registry."""
    q, k, v, cos, sin, arena, pages, offsets = case
    want_arena = arena.clone()
    want = _ref("rope_kv_write", q, k, v, cos, sin, interleaved, want_arena[0], want_arena[1], pages, offsets)
    with REGISTRY.record_calls(by_backend=True) as calls:
        got = fn(q, k, v, cos, sin, interleaved, arena[0], arena[1], pages, offsets)
    _close(got, want, dtype)
    _close(arena[0], want_arena[0], dtype)  # the rotated keys at their slots, every other slot untouched
    assert torch.equal(arena[1], want_arena[1])  # the values, copied
    return calls


@interpreter
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_kv_write_interpreted(seed, interleaved):
    """One launch against the reference (rope on q and k, k and v into shuffled slots of strided streams)."""
    from dayzero.kernels.token import _kv_write

    rng = random.Random(300 + seed)
    g = torch.Generator().manual_seed(seed)
    n, hkv, d = rng.randint(1, 9), rng.choice((1, 2, 3)), rng.choice((8, 16, 64))
    hq = hkv * rng.choice((1, 2, 5))
    dtype = rng.choice((torch.float32, torch.bfloat16))
    _check_kv_write(_kv_write.rope_kv_write, _kv_write_case(g, n, hq, hkv, d, dtype, "cpu"), interleaved, dtype)


def test_rope_kv_write_reference_names_the_bad_argument():
    g = torch.Generator().manual_seed(0)
    q, k, v, cos, sin, arena, pages, offsets = _kv_write_case(g, 3, 4, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"pages \(2,\) and offsets"):
        ops.rope_kv_write(q, k, v, cos, sin, False, arena[0], arena[1], pages[:2], offsets)
    with pytest.raises(ValueError, match="v_data entries"):
        ops.rope_kv_write(q, k, v, cos, sin, False, arena[0], arena[1, ..., :4], pages, offsets)


@cuda
@pytest.mark.parametrize("n", [1, 64, 300])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_kv_write_cuda(n, interleaved):
    """gpt-oss heads (64 q / 8 kv of 64) through the registry: one launch, the reference's values."""
    g = torch.Generator().manual_seed(n)
    case = _kv_write_case(g, n, 64, 8, 64, torch.bfloat16, "cuda", blocks=40, per_block=16)
    assert _check_kv_write(ops.rope_kv_write, case, interleaved, torch.bfloat16) == {"rope_kv_write@triton": 1}
