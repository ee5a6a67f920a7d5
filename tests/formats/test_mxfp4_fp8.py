import ml_dtypes
import numpy as np
import pytest
import torch

from dayzero.formats import mxfp4, mxfp4_fp8

from .oracles import e2m1_values, e4m3_bytes, e4m3_values, mxfp4_values, unpack_codes


def grouped_mxfp4(rows, n_blocks, max_gap, min_gap=0, seed=0):
    """Random blocks; per group of 4 blocks one block sits at a random top exponent, the others
    `min_gap..max_gap` binades below it. Returns (blocks, scales, gap of every block)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, n_blocks, 16), dtype=torch.uint8, generator=g)
    n_groups = -(-n_blocks // 4)
    top = torch.randint(60, 254, (rows, n_groups), generator=g).repeat_interleave(4, dim=1)[:, :n_blocks]
    gap = torch.randint(min_gap, max_gap + 1, (rows, n_blocks), generator=g)
    gap[:, ::4] = 0  # the first block of each group is the group's largest
    return blocks, (top - gap).to(torch.uint8), gap


def reference_fp8_bytes(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """e2m1 * 2^(e_b - e_ref), e_ref = group max - 6, computed in float64 and rounded by ml_dtypes."""
    exp = scales.astype(np.int64) - 127
    n_blocks = exp.shape[-1]
    e_ref = np.empty_like(exp)
    for start in range(0, n_blocks, 4):
        e_ref[..., start : start + 4] = exp[..., start : start + 4].max(-1, keepdims=True) - 6
    products = e2m1_values(unpack_codes(blocks)) * np.exp2((exp - e_ref).astype(np.float64))[..., None]
    return e4m3_bytes(products.reshape(*exp.shape[:-1], -1))


def folded_values(result) -> np.ndarray:
    """fp8 * group scale in float64, decoded by ml_dtypes."""
    k = result.values.shape[-1]
    scale = np.repeat(result.scales.double().numpy(), 128, axis=-1)[..., :k]
    return e4m3_values(result.values) * scale


def test_window_is_exactly_minus_8_to_6():
    values = e2m1_values(np.arange(16, dtype=np.uint8))
    for r in range(-8, 7):
        scaled = values * 2.0**r
        assert np.array_equal(scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64), scaled), r
    for r in (7, -9):
        scaled = values * 2.0**r
        assert not np.array_equal(scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64), scaled), r


@pytest.mark.parametrize("n_blocks", [16, 6])  # 4 full groups; one full and one partial group
def test_exact_within_14_binades(n_blocks):
    blocks, scales, _ = grouped_mxfp4(5, n_blocks, max_gap=14, seed=n_blocks)
    result = mxfp4_fp8.mxfp4_to_fp8(blocks, scales)
    assert result.values.dtype == torch.float8_e4m3fn and result.values.shape == (5, n_blocks * 32)
    assert result.scales.dtype == torch.float32 and result.scales.shape == (5, -(-n_blocks // 4))
    assert result.out_of_window_blocks == 0 and mxfp4_fp8.count_out_of_window_blocks(scales) == 0
    assert np.array_equal(result.values.view(torch.uint8).numpy(), reference_fp8_bytes(blocks.numpy(), scales.numpy()))
    assert np.array_equal(folded_values(result), mxfp4_values(blocks.numpy(), scales.numpy()))
    mantissa, _ = torch.frexp(result.scales)
    assert (mantissa == 0.5).all()


def test_out_of_window_blocks_are_counted_and_bounded():
    blocks, scales, gap = grouped_mxfp4(6, 16, max_gap=40, seed=21)
    result = mxfp4_fp8.mxfp4_to_fp8(blocks, scales)
    expected = int((gap > 14).sum())
    assert expected > 10 and result.out_of_window_blocks == expected
    assert mxfp4_fp8.count_out_of_window_blocks(scales) == expected
    assert np.array_equal(result.values.view(torch.uint8).numpy(), reference_fp8_bytes(blocks.numpy(), scales.numpy()))

    exact = mxfp4_values(blocks.numpy(), scales.numpy())
    err = np.abs(folded_values(result) - exact).reshape(6, 16, 32)
    e_max = (scales.numpy().astype(np.int64) - 127).reshape(6, 4, 4).max(-1)
    bound = np.exp2(np.repeat(e_max, 4, axis=-1) - 16.0)[..., None]  # 2^(e_max - 16) per element
    assert (err <= bound).all()
    inside = (gap <= 14).numpy()
    assert (err[inside] == 0).all() and (err[~inside] > 0).any()


def test_count_on_constructed_scales_and_other_layouts():
    scales = torch.full((2, 3, 8), 127, dtype=torch.uint8)  # groups of 4 blocks along the last dim
    scales[0, 0, 1] = 127 - 14  # on the edge: still exact
    scales[0, 0, 2] = 127 - 15  # out
    scales[1, 2, 7] = 0  # out
    scales[1, 1, 4:8] = torch.tensor([10, 0, 255, 24], dtype=torch.uint8)  # NaN block is not counted
    assert mxfp4_fp8.count_out_of_window_blocks(scales) == 3
    as_e8m0 = scales.view(torch.float8_e8m0fnu)  # DeepSeek-V4 scale dtype
    assert mxfp4_fp8.count_out_of_window_blocks(as_e8m0) == 3
    blocks = torch.randint(0, 256, (2, 3, 8, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert mxfp4_fp8.mxfp4_to_fp8(blocks, scales).out_of_window_blocks == 3
    assert mxfp4_fp8.count_out_of_window_blocks(scales, group=32) == 0  # one block per group: never out
    assert mxfp4_fp8.count_out_of_window_blocks(scales, group=256) == 5  # 10, 0 and 24 now measured against 127


def test_nan_scales_propagate():
    blocks, scales, _ = grouped_mxfp4(2, 8, max_gap=14, seed=31)
    scales[0, 1] = mxfp4.E8M0_NAN  # one NaN block in group 0 of row 0
    scales[1, 4:8] = mxfp4.E8M0_NAN  # a whole group of NaN blocks
    result = mxfp4_fp8.mxfp4_to_fp8(blocks, scales)
    values = result.values.float()
    assert torch.isnan(values[0, 32:64]).all() and not torch.isnan(values[0, :32]).any()
    assert torch.isnan(result.scales[1, 1]) and torch.isnan(values[1, 128:]).all()
    assert not torch.isnan(result.scales[0]).any() and not torch.isnan(result.scales[1, 0])
    want = mxfp4_values(blocks.numpy(), scales.numpy())
    got = folded_values(result)
    finite = ~np.isnan(want)
    assert np.array_equal(np.isnan(got), ~finite) and np.array_equal(got[finite], want[finite])
    assert result.out_of_window_blocks == 0


def test_extreme_exponents():
    blocks = torch.randint(0, 256, (2, 4, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(41))
    scales = torch.tensor([[0, 0, 0, 0], [254, 254, 240, 253]], dtype=torch.uint8)
    result = mxfp4_fp8.mxfp4_to_fp8(blocks, scales)
    assert result.scales[0, 0].item() == 2.0**-133 and result.scales[1, 0].item() == 2.0**121
    assert np.array_equal(folded_values(result), mxfp4_values(blocks.numpy(), scales.numpy()))


def test_from_deepseek_v4_layout():
    blocks, scales, _ = grouped_mxfp4(4, 8, max_gap=20, seed=51)
    weight, scale = mxfp4.to_deepseek_v4(blocks, scales)
    direct = mxfp4_fp8.mxfp4_to_fp8(*mxfp4.from_deepseek_v4(weight, scale))
    result = mxfp4_fp8.mxfp4_to_fp8(blocks, scales)
    assert torch.equal(direct.values.view(torch.uint8), result.values.view(torch.uint8))
    assert torch.equal(direct.scales, result.scales)
    assert direct.out_of_window_blocks == mxfp4_fp8.count_out_of_window_blocks(scale)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: mxfp4_fp8.count_out_of_window_blocks(torch.zeros(4, dtype=torch.uint8), group=100), "multiple of 32"),
        (lambda: mxfp4_fp8.count_out_of_window_blocks(torch.zeros(4, dtype=torch.uint8), group=0), "multiple of 32"),
        (lambda: mxfp4_fp8.count_out_of_window_blocks(torch.zeros(4)), "scales"),
        (lambda: mxfp4_fp8.mxfp4_to_fp8(torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, dtype=torch.uint8)), "blocks"),
        (lambda: mxfp4_fp8.mxfp4_to_fp8(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8)), "scales"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
