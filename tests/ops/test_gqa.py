"""gqa_attention against a per-query loop, torch's SDPA, and transformers' gpt-oss eager attention."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dayzero.ops.attention_gqa import gqa_attention


def _loop(q, k, v, scale, window=None, sinks=None):
    """One query, one head at a time, with explicit positions (independent of the op's masking)."""
    b, t, hq, _ = q.shape
    s, hkv = k.shape[1], k.shape[2]
    out = torch.zeros(b, t, hq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            for i in range(t):
                pos = s - t + i
                keys = [j for j in range(s) if j <= pos and (window is None or pos - j < window)]
                logits = torch.stack([q[bi, i, h].double() @ k[bi, j, kv].double() * scale for j in keys])
                m = logits.max() if sinks is None else torch.maximum(logits.max(), sinks[h].double())
                w = torch.exp(logits - m)
                denom = w.sum() + (0 if sinks is None else torch.exp(sinks[h].double() - m))
                out[bi, i, h] = (w[:, None] * v[bi, keys, kv].double()).sum(0) / denom
    return out


def _inputs(b, t, s, hq, hkv, d, dv=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(b * 1000 + t * 100 + s)
    q = torch.randn(b, t, hq, d, generator=g).to(dtype)
    k = torch.randn(b, s, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, s, hkv, dv or d, generator=g).to(dtype)
    sinks = torch.randn(hq, generator=g) * 2
    return q, k, v, sinks


@pytest.mark.parametrize("b, t, s, hq, hkv, window", [
    (1, 5, 5, 4, 2, None), (2, 7, 7, 4, 1, 3), (1, 1, 9, 6, 3, None), (2, 1, 9, 4, 2, 4), (1, 3, 12, 8, 8, 1),
])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_matches_loop(b, t, s, hq, hkv, window, with_sinks):
    q, k, v, sinks = _inputs(b, t, s, hq, hkv, 8, dv=6)
    sinks = sinks if with_sinks else None
    scale = 8 ** -0.5
    got = gqa_attention(q, k, v, scale, window, sinks)
    assert got.shape == (b, t, hq, 6) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _loop(q, k, v, scale, window, sinks), rtol=1e-5, atol=1e-5)


def test_matches_sdpa_without_sinks():
    q, k, v, _ = _inputs(2, 6, 6, 8, 2, 16)
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(gqa_attention(q, k, v, 16 ** -0.5), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_matches_transformers_gpt_oss_eager(window):
    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    b, t, hq, hkv, d = 2, 10, 4, 2, 8
    q, k, v, sinks = _inputs(b, t, t, hq, hkv, d)
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    allowed = sdpa_mask(batch_size=b, q_length=t, kv_length=t, mask_function=fn, allow_is_causal_skip=False)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=hq // hkv, sinks=sinks, training=False)
    expected, _ = eager_attention_forward(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), additive,
                                          scaling=d ** -0.5)
    torch.testing.assert_close(gqa_attention(q, k, v, d ** -0.5, window, sinks), expected, rtol=1e-5, atol=1e-5)


def test_dropping_keys_outside_the_window_changes_nothing():
    q, k, v, sinks = _inputs(1, 3, 20, 4, 2, 8)
    full = gqa_attention(q, k, v, 0.3, 5, sinks)
    kept = 5 - 1 + 3  # the window of the first query reaches back window - 1 keys
    torch.testing.assert_close(gqa_attention(q, k[:, -kept:], v[:, -kept:], 0.3, 5, sinks), full, rtol=1e-6, atol=1e-6)


def test_bfloat16_in_bfloat16_out():
    q, k, v, sinks = _inputs(1, 4, 4, 4, 2, 8, dtype=torch.bfloat16)
    got = gqa_attention(q, k, v, 8 ** -0.5, None, sinks)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _loop(q, k, v, 8 ** -0.5, None, sinks), rtol=2e-2, atol=2e-2)


def test_sinks_only_take_probability_mass():
    q, k, v, _ = _inputs(1, 1, 1, 2, 1, 4)
    got = gqa_attention(q, k, v, 1.0, None, torch.tensor([0.0, math.log(3.0)]))
    # one key with logit l and a sink s: the key gets e^l / (e^l + e^s)
    logit = float(q[0, 0, 0] @ k[0, 0, 0])
    torch.testing.assert_close(got[0, 0, 0], v[0, 0, 0] * math.exp(logit) / (math.exp(logit) + 1.0))


@pytest.mark.parametrize("args, match", [
    (dict(q=(1, 2, 4), k=(1, 2, 2, 8), v=(1, 2, 2, 8)), r"\[batch, tokens, heads, dim\]"),
    (dict(q=(1, 2, 3, 8), k=(1, 2, 2, 8), v=(1, 2, 2, 8)), "not a multiple"),
    (dict(q=(1, 3, 4, 8), k=(1, 2, 2, 8), v=(1, 2, 2, 8)), "cannot hold"),
    (dict(q=(1, 2, 4, 8), k=(1, 2, 2, 4), v=(1, 2, 2, 4)), "head dim"),
    (dict(q=(1, 2, 4, 8), k=(1, 2, 2, 8), v=(1, 3, 2, 8)), "must share"),
    (dict(q=(1, 2, 4, 8), k=(1, 2, 2, 8), v=(1, 2, 2, 8), sinks=(2,)), "sinks must be"),
    (dict(q=(1, 2, 4, 8), k=(1, 2, 2, 8), v=(1, 2, 2, 8), window=0), "sliding_window"),
])
def test_errors(args, match):
    sinks = torch.randn(args["sinks"]) if "sinks" in args else None
    with pytest.raises(ValueError, match=match):
        gqa_attention(torch.randn(args["q"]), torch.randn(args["k"]), torch.randn(args["v"]), 1.0, args.get("window"), sinks)
