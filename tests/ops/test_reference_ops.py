"""Reference ops against independent formulations (torch.nn.functional, complex arithmetic, transformers)."""

import pytest
import torch
import torch.nn.functional as F

from dayzero import ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(dtype):
    x = torch.randn(5, 7, 64, dtype=dtype)
    w = torch.randn(64, dtype=dtype)
    expected = w * F.rms_norm(x.float(), (64,), eps=1e-6).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), expected, rtol=0, atol=0)


def test_rms_norm_matches_transformers_module():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    m = DeepseekV3RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(3, 48).bfloat16()
    m = m.bfloat16()
    torch.testing.assert_close(ops.rms_norm(x, m.weight, 1e-5), m(x), rtol=0, atol=0)


def test_layer_norm_matches_torch():
    x = torch.randn(4, 32)
    w, b = torch.randn(32), torch.randn(32)
    torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (32,), w, b, 1e-5))


def _angles(t, d, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    pos = torch.randint(0, 5000, (t,)).double()
    return torch.outer(pos, inv)


def test_rope_interleaved_is_complex_rotation():
    t, h, d = 6, 3, 16
    x = torch.randn(t, h, d, dtype=torch.float64)
    ang = _angles(t, d)
    z = torch.view_as_complex(x.reshape(t, h, d // 2, 2).contiguous())
    expected = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)[:, None, :]).flatten(-2)
    out = ops.rope(x, ang.cos(), ang.sin(), interleaved=True)
    torch.testing.assert_close(out, expected.to(out.dtype), rtol=1e-6, atol=1e-6)


def test_rope_half_split_matches_transformers_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t, h, d = 5, 2, 32
    x = torch.randn(t, h, d)
    ang = _angles(t, d).float()
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([ang.sin(), ang.sin()], -1)
    # transformers wants [batch, heads, seq, dim]
    q = x.permute(1, 0, 2)[None]
    expected, _ = apply_rotary_pos_emb(q, q, cos[None], sin[None])
    out = ops.rope(x, ang.cos(), ang.sin(), interleaved=False)
    torch.testing.assert_close(out, expected[0].permute(1, 0, 2), rtol=1e-5, atol=1e-5)


def test_rope_rejects_bad_shapes():
    with pytest.raises(ValueError, match="twice cos/sin last dim"):
        ops.rope(torch.randn(2, 3, 8), torch.randn(2, 3), torch.randn(2, 3), interleaved=True)
    with pytest.raises(ValueError, match="3 positions, x has 2 tokens"):
        ops.rope(torch.randn(2, 8), torch.randn(3, 4), torch.randn(3, 4), interleaved=False)


def test_swiglu_and_clamped_variant():
    g, u = torch.randn(4, 10) * 5, torch.randn(4, 10) * 5
    torch.testing.assert_close(ops.swiglu(g, u), g * torch.sigmoid(g) * u)
    gc = torch.minimum(g, torch.tensor(7.0))
    uc = u.clamp(-7, 7)
    torch.testing.assert_close(ops.swiglu_clamped(g, u), gc * torch.sigmoid(1.702 * gc) * (uc + 1))
    big = torch.full((1, 2), 100.0)
    assert torch.isfinite(ops.swiglu_clamped(big, big)).all()


def test_linear_and_error():
    x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    torch.testing.assert_close(ops.linear(x, w, b), x @ w.T + b)
    with pytest.raises(ValueError, match="disagree on K"):
        ops.linear(x, torch.randn(8, 15))


def test_linear_fp8_block_matches_float8_dequantization():
    from dayzero.formats.fp8 import quantize_weight_blocks

    w = torch.randn(200, 160)
    q, s = quantize_weight_blocks(w)
    x = torch.randn(3, 160)
    # independent dequantization: torch's own float8 -> float32 cast, scales expanded by hand
    s_full = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :160]
    expected = x @ (q.float() * s_full).T
    torch.testing.assert_close(ops.linear_fp8_block(x, q, s), expected)


def test_linear_mxfp4_matches_ml_dtypes_dequantization():
    import ml_dtypes
    import numpy as np

    from dayzero.formats import mxfp4

    w = torch.randn(24, 64)
    blocks, scales = mxfp4.quantize(w)
    b = blocks.numpy()
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(24, 2, 32)
    lut = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = scales.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    w_ref = torch.from_numpy((lut[codes] * scale[..., None]).reshape(24, 64))
    x = torch.randn(5, 64)
    torch.testing.assert_close(ops.linear_mxfp4(x, blocks, scales), x @ w_ref.T)
    torch.testing.assert_close(ops.mxfp4_dequantize(blocks, scales, torch.float32), w_ref, rtol=0, atol=0)
    conv = ops.mxfp4_to_fp8(blocks, scales)
    torch.testing.assert_close(conv.values.float() * conv.scales.repeat_interleave(128, -1)[:, :64], w_ref, rtol=0, atol=0)


def test_embedding_and_out_of_vocab_error():
    w = torch.randn(10, 4)
    ids = torch.tensor([[1, 9], [0, 3]])
    torch.testing.assert_close(ops.embedding(ids, w), F.embedding(ids, w))
    with pytest.raises(ValueError, match="token id 10 is outside the vocabulary"):
        ops.embedding(torch.tensor([10]), w)
    with pytest.raises(ValueError, match="int32 or int64"):
        ops.embedding(torch.tensor([1.0]), w)


def test_swiglu_limit_matches_deepseek_v4_mlp():
    from transformers import AutoConfig
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4MLP

    cfg = AutoConfig.for_model("deepseek_v4", hidden_size=16, intermediate_size=24, moe_intermediate_size=24, swiglu_limit=0.5)
    mlp = DeepseekV4MLP(cfg)
    x = torch.randn(5, 16) * 3
    with torch.no_grad():
        expected = mlp(x)
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        out = mlp.down_proj(ops.swiglu(gate, up, limit=cfg.swiglu_limit))
    torch.testing.assert_close(out, expected)
