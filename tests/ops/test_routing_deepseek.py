"""route_sigmoid_grouped against a per-token loop and against transformers' DeepseekV3TopkRouter."""

import pytest
import torch

from dayzero.ops.routing_deepseek import route_sigmoid_grouped



@pytest.fixture(autouse=True)
def _private_rng():
    """Deterministic draws here, and the global generator left as other test files expect it."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield

def _loop(logits, bias, top_k, n_group, topk_group, normalize, scale):
    """Per token: rank groups by the sum of their two best biased scores (max without bias), keep the
    best topk_group, then take the top_k biased scores among their experts."""
    t, e = logits.shape
    per = e // n_group
    ids, weights = [], []
    for row in logits:
        s = torch.sigmoid(row.double())
        b = s + (0 if bias is None else bias.double())
        groups = [sorted(b[g * per:(g + 1) * per].tolist(), reverse=True) for g in range(n_group)]
        group_score = [sum(v[:2]) if bias is not None else v[0] for v in groups]
        kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        eligible = [j for g in kept for j in range(g * per, (g + 1) * per)]
        chosen = sorted(eligible, key=lambda j: -float(b[j]))[:top_k]
        w = s[chosen]
        if normalize:
            w = w / w.sum()
        ids.append(chosen)
        weights.append((w * scale).tolist())
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


def _sorted(ids, weights):
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


CASES = [  # experts, top_k, n_group, topk_group, normalize, scale, bias
    (16, 4, 4, 2, True, 2.5, True),   # DeepSeek-V3 shape, scaled down
    (12, 3, 1, 1, True, 2.827, True),  # Kimi-K2: one group
    (16, 2, 8, 3, False, 1.0, True),
    (12, 3, 3, 2, True, 1.0, False),   # no correction bias: groups by their best expert
]


@pytest.mark.parametrize("experts, top_k, n_group, topk_group, normalize, scale, bias", CASES)
def test_matches_per_token_loop(experts, top_k, n_group, topk_group, normalize, scale, bias):
    g = torch.Generator().manual_seed(experts + top_k)
    logits = torch.randn(9, experts, generator=g) * 2
    correction = torch.rand(experts, generator=g) * 0.3 if bias else None
    ids, weights = route_sigmoid_grouped(logits, correction, top_k, n_group, topk_group, normalize, scale)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (9, top_k)
    want_ids, want_weights = _loop(logits, correction, top_k, n_group, topk_group, normalize, scale)
    got_ids, got_weights = _sorted(ids, weights)
    want_ids, want_weights = _sorted(want_ids, want_weights)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights.double(), want_weights, rtol=1e-6, atol=1e-7)


def test_matches_transformers_router():
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = AutoConfig.for_model("deepseek_v3", hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                               topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g) / 4)
        router.e_score_correction_bias.copy_(torch.rand(16, generator=g) * 0.2)
    x = torch.randn(11, 32, generator=g)
    with torch.no_grad():
        logits, want_weights, want_ids = router(x)
    ids, weights = route_sigmoid_grouped(logits, router.e_score_correction_bias, 4, 4, 2, True, 2.5)
    got_ids, got_weights = _sorted(ids, weights)
    want_ids, want_weights = _sorted(want_ids, want_weights)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-6, atol=1e-7)


def test_errors_name_the_problem():
    logits = torch.randn(3, 12)
    with pytest.raises(ValueError, match="n_group=5"):
        route_sigmoid_grouped(logits, None, 2, n_group=5, topk_group=1)
    with pytest.raises(ValueError, match="topk_group=4"):
        route_sigmoid_grouped(logits, None, 2, n_group=3, topk_group=4)
    with pytest.raises(ValueError, match="top_k=9"):
        route_sigmoid_grouped(logits, None, 9, n_group=3, topk_group=2)
    with pytest.raises(ValueError, match="correction_bias must be"):
        route_sigmoid_grouped(logits, torch.zeros(11), 2)
    with pytest.raises(ValueError, match=r"\[tokens, experts\]"):
        route_sigmoid_grouped(torch.randn(12), None, 2)
