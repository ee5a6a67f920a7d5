"""DeepSeek-V4 routing ops against per-token Python formulations."""

import math

import pytest
import torch

from dayzero import ops  # noqa: F401  (built-in ops)
from dayzero.ops.routing_v4 import route_hash, route_sqrtsoftplus, scores_of


def sqrtsoftplus(x: float) -> float:
    return math.sqrt(math.log1p(math.exp(x)))


def test_route_sqrtsoftplus_matches_per_token_choice():
    gen = torch.Generator().manual_seed(0)
    t, e, k = 6, 8, 3
    logits, bias = torch.randn(t, e, generator=gen) * 2, torch.randn(e, generator=gen) * 0.5
    ids, weights = route_sqrtsoftplus(logits, bias, k, scaling=1.5)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    for row in range(t):
        scores = [sqrtsoftplus(float(v)) for v in logits[row]]
        chosen = sorted(range(e), key=lambda j: -(scores[j] + float(bias[j])))[:k]
        assert ids[row].tolist() == chosen
        total = sum(scores[j] for j in chosen)
        for slot, j in enumerate(chosen):
            assert weights[row, slot].item() == pytest.approx(scores[j] / total * 1.5, rel=1e-5)


def test_bias_changes_the_choice_not_the_weights():
    logits = torch.tensor([[1.0, 0.9, -3.0]])
    ids, _ = route_sqrtsoftplus(logits, None, 1)
    assert ids.tolist() == [[0]]
    ids, weights = route_sqrtsoftplus(logits, torch.tensor([0.0, 0.0, 10.0]), 2)
    assert ids.tolist() == [[2, 0]]
    s = [sqrtsoftplus(-3.0), sqrtsoftplus(1.0)]
    assert weights[0].tolist() == pytest.approx([s[0] / sum(s), s[1] / sum(s)], rel=1e-6)


def test_route_hash_uses_the_table():
    gen = torch.Generator().manual_seed(1)
    vocab, e, k = 10, 6, 2
    table = torch.rand(vocab, e, generator=gen).argsort(-1)[:, :k]
    tokens = torch.tensor([3, 3, 7, 0])
    logits = torch.randn(4, e, generator=gen)
    ids, weights = route_hash(logits, tokens, table, scaling=2.0)
    assert torch.equal(ids, table[tokens])
    for row in range(4):
        scores = [sqrtsoftplus(float(logits[row, j])) for j in ids[row]]
        assert weights[row].tolist() == pytest.approx([2.0 * s / sum(scores) for s in scores], rel=1e-5)
    ids32, w32 = route_hash(logits, tokens, table.int(), scaling=2.0)
    assert torch.equal(ids32, ids) and torch.equal(w32, weights)


def test_score_functions():
    x = torch.tensor([[-1.0, 0.0, 2.0]])
    torch.testing.assert_close(scores_of(x, "sigmoid"), torch.sigmoid(x))
    torch.testing.assert_close(scores_of(x, "softmax"), torch.softmax(x, -1))
    with pytest.raises(ValueError, match="unknown routing score function"):
        scores_of(x, "relu")


def test_errors():
    logits = torch.randn(3, 4)
    with pytest.raises(ValueError, match="top_k"):
        route_sqrtsoftplus(logits, None, 5)
    with pytest.raises(ValueError, match="correction_bias"):
        route_sqrtsoftplus(logits, torch.zeros(3), 2)
    table = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="token ids"):
        route_hash(logits, torch.tensor([0, 1, 2]), table)
    with pytest.raises(ValueError, match="experts outside"):
        route_hash(logits, torch.tensor([0, 1, 1]), table + 1)
    with pytest.raises(ValueError, match="tid2eid must be"):
        route_hash(logits, torch.tensor([0, 1, 1]), table.float())
