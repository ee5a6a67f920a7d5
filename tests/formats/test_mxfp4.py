import ml_dtypes
import numpy as np
import pytest
import torch

from dayzero.formats import mxfp4

from .oracles import e2m1_values, e8m0_values, mxfp4_values, same_bits, unpack_codes


def random_mxfp4(shape, scale_low=0, scale_high=253, seed=0):
    """Fresh random canonical MXFP4: blocks uint8 [*shape, 16], scales uint8 shape."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(scale_low, scale_high, shape, dtype=torch.uint8, generator=g)
    return blocks, scales


def random_input(shape, seed=0, dtype=torch.float32):
    """Gaussian values with a random binade per 32-block, so scales span a wide range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    binade = torch.randint(-30, 30, (*shape[:-1], shape[-1] // 32, 1), generator=g).float()
    return (x.unflatten(-1, (-1, 32)) * torch.exp2(binade)).flatten(-2).to(dtype)


def reference_quantize(x: np.ndarray):
    """OCP MX scale and RNE element rounding via numpy log2 and ml_dtypes.float4_e2m1fn."""
    blocks = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        exp = np.where(amax == 0, -127, np.clip(np.floor(np.log2(amax)) - 2, -127, 127)).astype(np.int64)
    y = blocks / np.exp2(exp.astype(np.float64))[..., None]
    codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return codes.reshape(x.shape), (exp + 127).astype(np.uint8)


def test_e2m1_pair_decode_all_256_bytes():
    byte = np.arange(256, dtype=np.uint8)
    got = mxfp4.decode_e2m1_pairs(torch.from_numpy(byte))
    want = np.stack([e2m1_values(byte & 0xF), e2m1_values(byte >> 4)], axis=-1).reshape(-1)
    assert same_bits(got, want)  # -0 for codes 0x8 included


def test_e2m1_table_matches_ml_dtypes():
    assert np.array_equal(np.array(mxfp4.E2M1_VALUES), e2m1_values(np.arange(16, dtype=np.uint8)))


def test_e8m0_decode_all_256_bytes():
    byte = np.arange(256, dtype=np.uint8)
    got = mxfp4.decode_e8m0(torch.from_numpy(byte))
    assert same_bits(got, e8m0_values(byte))
    assert same_bits(got, torch.from_numpy(byte).view(torch.float8_e8m0fnu).float().double().numpy())
    assert torch.isnan(got[255]) and got[0].item() == 2.0**-127 and got[254].item() == 2.0**127
    same = mxfp4.decode_e8m0(torch.from_numpy(byte).view(torch.float8_e8m0fnu))
    assert torch.equal(same.nan_to_num(), got.nan_to_num())


def test_dequantize_every_scale_byte_float32_and_float64():
    blocks, _ = random_mxfp4((4, 256), seed=1)
    scales = torch.arange(256, dtype=torch.uint8).expand(4, 256).contiguous()
    want = mxfp4_values(blocks.numpy(), scales.numpy())
    assert same_bits(mxfp4.dequantize(blocks, scales, torch.float64), want)  # float64 exact for all bytes
    got32 = mxfp4.dequantize(blocks, scales, torch.float32)
    assert same_bits(got32, want)  # float64 -> float32 overflows to the same +-Inf for bytes 253, 254
    assert torch.isinf(got32[:, 253 * 32 : 255 * 32]).any() and not torch.isinf(got32[:, : 253 * 32]).any()
    assert torch.isnan(got32[:, 255 * 32 :]).all()  # 0xFF: the whole block, zeros included


def test_dequantize_bfloat16_exact_below_byte_253():
    blocks, scales = random_mxfp4((3, 5, 64), scale_high=253, seed=2)
    want = torch.from_numpy(mxfp4_values(blocks.numpy(), scales.numpy()))
    got = mxfp4.dequantize(blocks, scales)  # default dtype bfloat16
    assert got.dtype == torch.bfloat16 and got.shape == (3, 5, 64 * 32)
    assert torch.equal(got.double(), want)  # every value e2m1 * 2^(b-127), b <= 252, is a bfloat16


def test_quantize_matches_ml_dtypes_rounding():
    x = random_input((8, 512), seed=3)
    blocks, scales = mxfp4.quantize(x)
    assert blocks.dtype == torch.uint8 and blocks.shape == (8, 16, 16) and scales.shape == (8, 16)
    want_codes, want_scales = reference_quantize(x.numpy())
    assert np.array_equal(scales.numpy(), want_scales)
    assert np.array_equal(unpack_codes(blocks.numpy()).reshape(8, 512), want_codes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_quantize_other_input_dtypes(dtype):
    x = random_input((4, 128), seed=4, dtype=torch.float32).clamp(-6e4, 6e4).to(dtype)
    blocks, scales = mxfp4.quantize(x)
    want_codes, want_scales = reference_quantize(x.double().numpy())
    assert np.array_equal(scales.numpy(), want_scales)
    assert np.array_equal(unpack_codes(blocks.numpy()).reshape(4, 128), want_codes)


def test_quantize_ties_round_to_even_and_saturate():
    # amax 7.5 -> shared exponent floor(log2 7.5) - 2 = 0, so these are the scaled values themselves.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.5, 7.5, -0.25, -0.75, -5.0, -7.0, -1e-30, 0.0]
    x = torch.tensor(ties + [0.1 * i for i in range(16)], dtype=torch.float32)
    blocks, scales = mxfp4.quantize(x)
    assert scales.item() == 127
    codes = unpack_codes(blocks.numpy()).reshape(-1)
    assert np.array_equal(codes, x.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF)
    values = e2m1_values(codes[:16])
    assert values.tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 6, 6, -0.0, -1, -4, -6, -0.0, 0]
    assert np.signbit(values[10]) and np.signbit(values[14])


def test_quantize_scale_clamps_to_e8m0_range():
    x = torch.zeros(2, 32)
    x[0, 0] = 2.0**-140  # floor(log2) - 2 = -142 -> clamped to -127
    x[1, 0] = 3e38  # floor(log2) - 2 = 125
    blocks, scales = mxfp4.quantize(x)
    assert scales.tolist() == [[0], [252]]
    big = torch.full((1, 32), 1e300, dtype=torch.float64)
    blocks, scales = mxfp4.quantize(big)
    assert scales.item() == 254  # shared exponent clamped to 127, elements saturate at 6
    assert (unpack_codes(blocks.numpy()) == 7).all()


def test_quantize_zero_block_and_nan_block():
    x = random_input((2, 96), seed=5)
    x[0, 32:64] = 0.0
    x[1, 32:64] = -0.0
    x[1, 70] = float("nan")
    blocks, scales = mxfp4.quantize(x)
    assert scales[0, 1].item() == 0 and scales[1, 1].item() == 0
    codes = unpack_codes(blocks.numpy())
    assert (codes[0, 1] == 0x0).all() and (codes[1, 1] == 0x8).all()
    assert scales[1, 2].item() == mxfp4.E8M0_NAN and (codes[1, 2] == 0).all()
    y = mxfp4.dequantize(blocks, scales, torch.float32)
    assert torch.isnan(y[1, 64:96]).all() and not torch.isnan(y[:, :64]).any() and not torch.isnan(y[0]).any()


def test_quantize_rejects_inf():
    x = random_input((2, 64), seed=6)
    x[1, 40] = -float("inf")
    with pytest.raises(ValueError, match=r"infinite.*\(1, 40\)"):
        mxfp4.quantize(x)


def test_round_trip_bytes_when_block_max_fixes_the_scale():
    # The scale is recoverable when each block holds a code of magnitude 4 or 6 (amax in [4, 8)).
    blocks, scales = random_mxfp4((6, 8), scale_low=0, scale_high=253, seed=7)
    blocks[..., 3] = (blocks[..., 3] & 0xF0) | 0x7  # element 6 of each block is +6
    values = mxfp4.dequantize(blocks, scales, torch.float32)
    again = mxfp4.quantize(values)
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)


def test_dequantize_of_quantize_matches_reference_values():
    x = random_input((4, 256), seed=8)
    got = mxfp4.dequantize(*mxfp4.quantize(x), dtype=torch.float32)
    codes, scale_bytes = reference_quantize(x.numpy())
    want = e2m1_values(codes).reshape(4, -1, 32) * e8m0_values(scale_bytes)[..., None]
    assert same_bits(got, want.reshape(4, 256))
    # error is at most one E2M1 step (2 * 2^shared_exp) of the block, relative to amax < 8 * 2^shared_exp
    amax = x.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    assert ((got - x).abs().unflatten(-1, (-1, 32)) <= amax / 4).all()


def deepseek_v4_reference(weight_int8: np.ndarray, scale_e8m0: np.ndarray) -> np.ndarray:
    """As DeepSeek-V4 inference/convert.py decodes it: byte & 0xF is element 2j, byte >> 4 element 2j+1."""
    u8 = weight_int8.view(np.uint8)
    values = np.stack([e2m1_values(u8 & 0x0F), e2m1_values(u8 >> 4)], axis=-1).reshape(*u8.shape[:-1], -1)
    return values * np.repeat(e8m0_values(scale_e8m0.view(np.uint8)), 32, axis=-1)


def test_three_layouts_agree():
    x = random_input((3, 10, 128), seed=9)
    blocks, scales = mxfp4.quantize(x)
    canonical = mxfp4.dequantize(blocks, scales, torch.float32)

    weight, scale = mxfp4.to_deepseek_v4(blocks, scales)
    assert weight.dtype == torch.int8 and weight.shape == (3, 10, 64)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, 10, 4)
    assert torch.equal(mxfp4.dequantize_deepseek_v4(weight, scale, torch.float32), canonical)
    assert same_bits(canonical, deepseek_v4_reference(weight.numpy(), scale.view(torch.uint8).numpy()))
    back = mxfp4.from_deepseek_v4(weight, scale)
    assert torch.equal(back[0], blocks) and torch.equal(back[1], scales)
    back = mxfp4.from_deepseek_v4(weight, scale.view(torch.uint8))  # scale re-saved as bytes
    assert torch.equal(back[1], scales)

    packed, packed_scale = mxfp4.to_compressed_tensors(blocks, scales)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 10, 64)
    assert packed_scale.dtype == torch.uint8 and packed_scale.shape == (3, 10, 4)
    assert torch.equal(mxfp4.dequantize_compressed_tensors(packed, packed_scale, torch.float32), canonical)
    assert torch.equal(packed.view(torch.int8), weight)  # same bytes as DeepSeek-V4
    back = mxfp4.from_compressed_tensors(packed, packed_scale)
    assert torch.equal(back[0], blocks) and torch.equal(back[1], scales)


def test_low_nibble_holds_the_even_element():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 1.0, -6.0  # codes 0x2 and 0xF
    blocks, scales = mxfp4.quantize(x)
    assert scales.item() == 127 and blocks[0, 0, 0].item() == 0xF2


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: mxfp4.quantize(torch.zeros(4, 48)), r"\(4, 48\).*multiple of 32"),
        (lambda: mxfp4.quantize(torch.zeros(4, 64, dtype=torch.int32)), "floating"),
        (lambda: mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, dtype=torch.uint8)), "blocks"),
        (lambda: mxfp4.dequantize(torch.zeros(2, 15, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8)), r"blocks.*\(2, 15\)"),
        (lambda: mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8)), r"scales.*\(3,\)"),
        (lambda: mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2)), r"scales.*float32"),
        (lambda: mxfp4.dequantize_deepseek_v4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8)), r"weight.*torch.int8"),
        (lambda: mxfp4.dequantize_deepseek_v4(torch.zeros(2, 8, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8)), r"weight.*\(2, 8\)"),
        (lambda: mxfp4.dequantize_deepseek_v4(torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8)), r"scale.*\(2, 2\)"),
        (lambda: mxfp4.dequantize_deepseek_v4(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1)), r"scale.*float32"),
        (lambda: mxfp4.dequantize_compressed_tensors(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8)), "weight_packed"),
        (lambda: mxfp4.dequantize_compressed_tensors(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)), "weight_scale"),
        (lambda: mxfp4.decode_e2m1_pairs(torch.zeros(4, dtype=torch.int8)), "packed"),
    ],
)
def test_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
