"""Routed-expert ops against a per-token loop over dense weights (dequantized independently)."""

import pytest
import torch

from dayzero import ops
from dayzero.formats import mxfp4
from dayzero.formats.fp8 import quantize_weight_blocks
from dayzero.ops import Activation, ExpertWeights

E, H, I, T, K = 6, 64, 32, 9, 2


def _per_token(x, ids, weights, w13, w2, act, b13=None, b2=None):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e] @ x[t] + (0 if b13 is None else b13[e])
            g, u = h[:I], h[I:]
            y = w2[e] @ act(g, u) + (0 if b2 is None else b2[e])
            out[t] += weights[t, k] * y
    return out


def _routing():
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    return ids, torch.rand(T, K)


@pytest.mark.parametrize("act", [Activation("swiglu"), Activation("swiglu", limit=1.0), Activation("swiglu_clamped", limit=7.0, alpha=1.702)])
def test_bf16_experts_with_bias(act):
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 8
    b13, b2 = torch.randn(E, 2 * I), torch.randn(E, H)
    ids, wts = _routing()
    got = ops.moe_experts_bf16(x, ids, wts, ExpertWeights("bf16", w13, w2, b13=b13, b2=b2), act)
    torch.testing.assert_close(got, _per_token(x, ids, wts, w13, w2, act, b13, b2), rtol=1e-5, atol=1e-5)


def test_fp8_experts():
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    q13, s13 = quantize_weight_blocks(w13)
    q2, s2 = quantize_weight_blocks(w2)
    d13 = q13.float() * s13.repeat_interleave(128, 1)[:, : 2 * I].repeat_interleave(128, 2)[:, :, :H]
    d2 = q2.float() * s2.repeat_interleave(128, 1)[:, :H].repeat_interleave(128, 2)[:, :, :I]
    ids, wts = _routing()
    act = Activation("swiglu")
    got = ops.moe_experts_fp8(x, ids, wts, ExpertWeights("fp8", q13, q2, s13, s2), act)
    torch.testing.assert_close(got, _per_token(x, ids, wts, d13, d2, act), rtol=1e-5, atol=1e-4)


def test_mxfp4_experts_match_ml_dtypes_dequantization():
    import ml_dtypes
    import numpy as np

    def ref_dequant(blocks, scales):
        b = blocks.numpy()
        codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 32)
        lut = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
        s = scales.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
        return torch.from_numpy((lut[codes] * s[..., None]).reshape(*b.shape[:-2], -1))

    x = torch.randn(T, H)
    b13, s13 = mxfp4.quantize(torch.randn(E, 2 * I, H))
    b2, s2 = mxfp4.quantize(torch.randn(E, H, I))
    ids, wts = _routing()
    act = Activation("swiglu_clamped", limit=7.0, alpha=1.702)
    got = ops.moe_experts_mxfp4(x, ids, wts, ExpertWeights("mxfp4", b13, b2, s13, s2), act)
    expected = _per_token(x, ids, wts, ref_dequant(b13, s13), ref_dequant(b2, s2), act)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_bad_routing_is_rejected():
    experts = ExpertWeights("bf16", torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 6\)"):
        ops.moe_experts_bf16(torch.randn(2, H), torch.tensor([[0, 6], [1, 2]]), torch.rand(2, 2), experts, Activation())
    with pytest.raises(ValueError, match="must both be"):
        ops.moe_experts_bf16(torch.randn(2, H), torch.tensor([[0, 1]]), torch.rand(2, 2), experts, Activation())
