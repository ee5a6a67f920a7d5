import math

import numpy as np
import pytest
import torch

from dayzero.formats import fp8

from .oracles import e4m3_bytes, e4m3_values


def random_weight(shape, seed=0):
    """Gaussian weight whose rows span several binades, so blocks get different scales."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-12, 12, (*shape[:-1], 1), generator=g).float())
    return torch.randn(shape, generator=g) * rows


def block_amax(w: np.ndarray, bn: int, bk: int) -> np.ndarray:
    """Per-block max |w| with numpy loops over the (possibly partial) blocks of the last two dims."""
    n, k = w.shape[-2:]
    out = np.zeros((*w.shape[:-2], math.ceil(n / bn), math.ceil(k / bk)), np.float32)
    for i in range(out.shape[-2]):
        for j in range(out.shape[-1]):
            out[..., i, j] = np.abs(w[..., i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]).max(axis=(-2, -1))
    return out


def expand(scale: np.ndarray, bn: int, bk: int, n: int, k: int) -> np.ndarray:
    return np.repeat(np.repeat(scale, bn, axis=-2), bk, axis=-1)[..., :n, :k]


def reference_scales(amax: np.ndarray, scale_format: str) -> np.ndarray:
    if scale_format == "float32":
        return np.maximum(amax / np.float32(448), np.float32(2.0**-126))
    with np.errstate(divide="ignore"):
        exp = np.ceil(np.log2((amax / np.float32(448)).astype(np.float64)))
    return np.exp2(np.where(amax == 0, -127, np.clip(exp, -127, 127))).astype(np.float32)


@pytest.mark.parametrize("scale_format", ["float32", "ue8m0"])
@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((2, 130, 256), (128, 128)), ((64, 96), (32, 64))])
def test_weight_blocks_match_reference(shape, block, scale_format):
    w = random_weight(shape, seed=len(shape) + block[1])
    w_fp8, scale_inv = fp8.quantize_weight_blocks(w, block=block, scale_format=scale_format)
    n, k = shape[-2:]
    assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == w.shape
    assert scale_inv.dtype == torch.float32
    assert scale_inv.shape == (*shape[:-2], math.ceil(n / block[0]), math.ceil(k / block[1]))

    want_scale = reference_scales(block_amax(w.numpy(), *block), scale_format)
    assert np.array_equal(scale_inv.numpy(), want_scale)
    scaled = (w.numpy() / expand(want_scale, *block, n, k)).clip(-448, 448)
    assert np.array_equal(w_fp8.view(torch.uint8).numpy(), e4m3_bytes(scaled))  # ml_dtypes, RNE
    torch_cast = torch.from_numpy(scaled).to(torch.float8_e4m3fn)
    assert torch.equal(w_fp8.view(torch.uint8), torch_cast.view(torch.uint8))

    w_back = fp8.dequantize_weight_blocks(w_fp8, scale_inv, block=block, dtype=torch.float32)
    want_back = e4m3_values(w_fp8) * expand(want_scale, *block, n, k)
    assert np.array_equal(w_back.numpy(), want_back.astype(np.float32))
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4, plus half a subnormal step near zero.
    scale_full = torch.from_numpy(expand(want_scale, *block, n, k))
    assert ((w_back - w).abs() <= w.abs() * 2**-4 + scale_full * 2**-10).all()


def test_ue8m0_scales_are_powers_of_two_rounded_up():
    w = random_weight((256, 384), seed=11)
    _, scale_inv = fp8.quantize_weight_blocks(w, scale_format="ue8m0")
    mantissa, _ = torch.frexp(scale_inv)
    assert (mantissa == 0.5).all()
    amax = torch.from_numpy(block_amax(w.numpy(), 128, 128))
    assert (amax / scale_inv <= 448).all() and (amax / scale_inv > 224).all()


def test_ue8m0_exact_power_of_two_is_not_rounded_up():
    x = torch.tensor([[448.0 * 2**-3, 1.0], [448.0 * 2**-3 * (1 + 2**-20), -1.0]])
    x_fp8, scales = fp8.quantize_activation_groups(x, scale_format="ue8m0")
    assert scales[:, 0].tolist() == [2.0**-3, 2.0**-2]
    assert x_fp8[0, 0].float().item() == 448.0


def test_ue8m0_scales_as_float8_e8m0fnu():
    w = random_weight((2, 200, 300), seed=12)
    w_fp8, as_float = fp8.quantize_weight_blocks(w, scale_format="ue8m0")
    w_fp8_b, as_e8m0 = fp8.quantize_weight_blocks(w, scale_format="ue8m0", scale_dtype=torch.float8_e8m0fnu)
    assert as_e8m0.dtype == torch.float8_e8m0fnu
    assert torch.equal(as_e8m0.float(), as_float) and torch.equal(w_fp8.view(torch.uint8), w_fp8_b.view(torch.uint8))
    assert torch.equal(
        fp8.dequantize_weight_blocks(w_fp8, as_e8m0, dtype=torch.float32),
        fp8.dequantize_weight_blocks(w_fp8, as_float, dtype=torch.float32),
    )


@pytest.mark.parametrize("scale_format", ["float32", "ue8m0"])
def test_activation_groups_match_reference(scale_format):
    x = random_weight((3, 5, 320), seed=13)
    x_fp8, scales = fp8.quantize_activation_groups(x, group=128, scale_format=scale_format)
    assert x_fp8.shape == x.shape and scales.shape == (3, 5, 3)
    amax = block_amax(x.numpy()[..., None, :], 1, 128)[..., 0, :]
    want_scale = reference_scales(amax, scale_format)
    assert np.array_equal(scales.numpy(), want_scale)
    full = np.repeat(want_scale, 128, axis=-1)[..., :320]
    assert np.array_equal(x_fp8.view(torch.uint8).numpy(), e4m3_bytes((x.numpy() / full).clip(-448, 448)))
    x_back = fp8.dequantize_activation_groups(x_fp8, scales, group=128, dtype=torch.float32)
    assert np.array_equal(x_back.numpy(), (e4m3_values(x_fp8) * full).astype(np.float32))


def test_zero_blocks_get_the_smallest_scale():
    w = torch.zeros(130, 128)
    _, s32 = fp8.quantize_weight_blocks(w)
    w_fp8, s_e8 = fp8.quantize_weight_blocks(w, scale_format="ue8m0")
    assert (s32 == 2.0**-126).all() and (s_e8 == 2.0**-127).all()
    assert (w_fp8.float() == 0).all()


def test_bfloat16_output_and_input():
    w = random_weight((128, 256), seed=14).bfloat16()
    w_fp8, scale_inv = fp8.quantize_weight_blocks(w)
    out = fp8.dequantize_weight_blocks(w_fp8, scale_inv)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fp8.dequantize_weight_blocks(w_fp8, scale_inv, dtype=torch.float32).bfloat16())


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: fp8.dequantize_weight_blocks(torch.zeros(300, 200).to(torch.float8_e4m3fn), torch.ones(2, 2)), r"\(2, 2\).*\(300, 200\).*\(3, 2\)"),
        (lambda: fp8.dequantize_weight_blocks(torch.zeros(2, 128, 128).to(torch.float8_e4m3fn), torch.ones(1, 1)), r"scale_inv.*\(2, 1, 1\)"),
        (lambda: fp8.dequantize_weight_blocks(torch.zeros(128, 128), torch.ones(1, 1)), "w_fp8"),
        (lambda: fp8.dequantize_weight_blocks(torch.zeros(128, 128).to(torch.float8_e4m3fn), torch.ones(1, 1, dtype=torch.int32)), "scale_inv"),
        (lambda: fp8.dequantize_activation_groups(torch.zeros(4, 256).to(torch.float8_e4m3fn), torch.ones(4, 3)), r"scales.*\(4, 3\).*\(4, 2\)"),
        (lambda: fp8.quantize_weight_blocks(torch.zeros(128)), "at least 2 dims"),
        (lambda: fp8.quantize_weight_blocks(torch.zeros(128, 128, dtype=torch.int8)), "w must be"),
        (lambda: fp8.quantize_weight_blocks(torch.full((4, 4), float("nan"))), "NaN/Inf"),
        (lambda: fp8.quantize_activation_groups(torch.tensor([1.0, float("inf")])), "NaN/Inf"),
        (lambda: fp8.quantize_weight_blocks(torch.zeros(4, 4), scale_format="e8m0"), "scale_format"),
        (lambda: fp8.quantize_weight_blocks(torch.zeros(4, 4), scale_dtype=torch.float8_e8m0fnu), "ue8m0"),
        (lambda: fp8.quantize_weight_blocks(torch.zeros(4, 4), block=(0, 128)), "block"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
