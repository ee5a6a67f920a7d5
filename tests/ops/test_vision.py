"""The vision ops (dayzero/ops/vision.py) against independent computations: varlen_attention against
torch's SDPA per image, vision_pos_embed against transformers' gather form of the bicubic resample (its
`get_vision_interpolation_indices_and_weights`, not F.interpolate) and the sin/cos time table, the 2D
RoPE angles against their definition, the patch merge against an explicit loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dayzero import ops
from dayzero.models.moonvit import merge_patches
from dayzero.ops.vision import axial_rope_angles, packed_bounds, time_sincos


def test_varlen_attention_is_attention_within_each_image():
    g = torch.Generator().manual_seed(0)
    grids = ((1, 2, 3), (1, 4, 4), (2, 2, 2))
    bounds = packed_bounds(grids)
    assert bounds == (0, 6, 22, 30)
    q, k, v = (torch.randn(30, 3, 8, generator=g) for _ in range(3))
    out = ops.varlen_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32), bounds, 0.3)
    for a, b in zip(bounds[:-1], bounds[1:]):
        want = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=0.3).transpose(0, 1)
        assert torch.allclose(out[a:b], want, atol=1e-6)
    # a token of one image never sees another's: changing image 1 leaves images 0 and 2 alone
    k2 = k.clone()
    k2[6:22] += 5
    out2 = ops.varlen_attention(q, k2, v, torch.tensor(bounds, dtype=torch.int32), bounds, 0.3)
    assert torch.equal(out2[:6], out[:6]) and torch.equal(out2[22:], out[22:]) and not torch.allclose(out2[6:22], out[6:22])


def test_varlen_attention_refuses_bounds_that_do_not_cover_the_tokens():
    q = torch.randn(5, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.varlen_attention(q, q, q, torch.tensor([0, 4], dtype=torch.int32), (0, 4), 1.0)


def test_gelu_forms():
    x = torch.linspace(-4, 4, 33)
    assert torch.allclose(ops.gelu(x), x * 0.5 * (1 + torch.erf(x / 2**0.5)), atol=1e-6)
    tanh = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))
    assert torch.allclose(ops.gelu(x, "tanh"), tanh, atol=1e-6)
    with pytest.raises(ValueError, match="approximate"):
        ops.gelu(x, "sigmoid")


@pytest.mark.parametrize("grid", [(1, 8, 8), (1, 4, 2), (1, 12, 6), (1, 3, 14), (3, 6, 4)])
def test_pos_embed_is_the_bicubic_resample_plus_time(grid):
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    table = torch.randn(8, 8, 16, generator=torch.Generator().manual_seed(1))
    got = ops.vision_pos_embed(table, (grid,), 4)
    idx, w = get_vision_interpolation_indices_and_weights(torch.tensor([grid]), 8, mode="bicubic", align_corners=False)
    want = (table.reshape(64, 16)[idx] * w[..., None]).sum(1)
    t, h, wd = grid
    if t > 1:
        want = want + time_sincos(t, 16).repeat_interleave(h * wd, dim=0)
    assert got.shape == (t * h * wd, 16)
    assert torch.allclose(got, want, atol=1e-5)
    if grid == (1, 8, 8):  # the grid's own size: the table itself
        assert torch.equal(got, table.reshape(64, 16))


def test_time_table_is_the_fixed_sincos():
    tab = time_sincos(3, 8)
    w = 10000 ** (-torch.arange(0, 8, 2) / 8)
    assert torch.allclose(tab[2], torch.cat([(2 * w).sin(), (2 * w).cos()]))
    assert torch.equal(tab[0], torch.cat([torch.zeros(4), torch.ones(4)]))


def test_axial_rope_angles():
    angles = axial_rope_angles(((2, 2, 3),), head_dim=8, theta=100.0)
    assert angles.shape == (12, 4)
    w = 100.0 ** (-torch.arange(0, 8, 4) / 8)  # w_j = theta^(-4j / head_dim)
    for n in range(12):
        row, col = (n % 6) // 3, n % 3  # frame-major, raster in the frame
        assert torch.allclose(angles[n, 0::2], col * w) and torch.allclose(angles[n, 1::2], row * w)


def test_merge_patches_concatenates_each_2x2_block_and_pools_frames():
    t, h, w, d = 2, 4, 6, 3
    x = torch.randn(t * h * w, d, generator=torch.Generator().manual_seed(2))
    merged = merge_patches(x, ((t, h, w),), (2, 2))
    frames = x.view(t, h, w, d).mean(0)
    for i in range(h // 2):
        for j in range(w // 2):
            want = torch.cat([frames[2 * i + a, 2 * j + b] for a in range(2) for b in range(2)])
            assert torch.allclose(merged[i * (w // 2) + j], want, atol=1e-6)
    with pytest.raises(ValueError, match="blocks"):
        merge_patches(x[:15], ((1, 3, 5),), (2, 2))
