"""route_softmax_topk against softmax-then-select formulations and transformers' gpt-oss router."""

import pytest
import torch

from dayzero.ops.routing_softmax import route_softmax_topk


def test_renormalized_equals_softmax_then_topk_then_renormalize():
    logits = torch.randn(17, 12, dtype=torch.float64).float() * 3
    ids, weights = route_softmax_topk(logits, 4)
    probs = torch.softmax(logits.double(), -1)
    expected_ids = probs.argsort(-1, descending=True)[:, :4]
    assert torch.equal(ids, expected_ids)
    chosen = probs.gather(-1, expected_ids)
    torch.testing.assert_close(weights.double(), chosen / chosen.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32


def test_without_renormalize_keeps_full_softmax_probabilities():
    logits = torch.randn(9, 8)
    ids, weights = route_softmax_topk(logits, 3, renormalize=False)
    for t in range(9):
        p = torch.exp(logits[t].double()) / torch.exp(logits[t].double()).sum()
        torch.testing.assert_close(weights[t].double(), p[ids[t]], rtol=1e-6, atol=1e-7)
    assert (weights.sum(-1) < 1).all()


def test_matches_transformers_gpt_oss_router():
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = AutoConfig.for_model("gpt_oss", hidden_size=32, num_local_experts=8, num_experts_per_tok=3)
    router = GptOssTopKRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.bias.normal_()
    x = torch.randn(11, 32)
    logits, scores, indices = router(x)
    ids, weights = route_softmax_topk(logits, 3)
    assert torch.equal(ids, indices)
    torch.testing.assert_close(weights, scores, rtol=0, atol=0)


def test_bfloat16_logits_route_in_float32():
    logits = torch.randn(5, 6).bfloat16()
    ids, weights = route_softmax_topk(logits, 2)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))


@pytest.mark.parametrize("shape, k, match", [((4,), 1, r"\[tokens, experts\]"), ((4, 3), 4, "top_k=4"), ((4, 3), 0, "top_k=0")])
def test_errors(shape, k, match):
    with pytest.raises(ValueError, match=match):
        route_softmax_topk(torch.randn(shape), k)
