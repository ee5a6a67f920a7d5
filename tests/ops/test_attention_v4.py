"""DeepSeek-V4 attention ops against loop-by-loop formulations in float64."""

import math

import pytest
import torch

from dayzero import ops  # noqa: F401  (built-in ops)
from dayzero.ops.attention_v4 import kv_compressor, sparse_attention, v4_indexer, v4_topk_select


def randn(*shape, scale=1.0, gen):
    return torch.randn(*shape, generator=gen) * scale


def rms(x, weight, eps):
    return weight * x / math.sqrt(float((x * x).mean()) + eps)


def compress_loops(kv, gate, ape, weight, eps, overlap, prev_kv=None, prev_gate=None):
    """Entry w: per channel c, softmax over its slots of (gate + ape) weighting kv; then RMSNorm."""
    kv, gate, ape, weight = kv.double(), gate.double(), ape.double(), weight.double()
    b, n, ch = kv.shape
    ratio = ape.shape[0]
    dim = ch // 2 if overlap else ch
    out = torch.zeros(b, n // ratio, dim, dtype=torch.float64)
    for bi in range(b):
        for w in range(n // ratio):
            pooled = torch.zeros(dim, dtype=torch.float64)
            for c in range(dim):
                slots = []  # (kv value, logit)
                if overlap:
                    if w > 0:
                        slots += [(kv[bi, (w - 1) * ratio + j, c], gate[bi, (w - 1) * ratio + j, c] + ape[j, c]) for j in range(ratio)]
                    elif prev_kv is not None:
                        slots += [(prev_kv[bi, j, c].double(), prev_gate[bi, j, c].double() + ape[j, c]) for j in range(ratio)]
                    slots += [(kv[bi, w * ratio + j, dim + c], gate[bi, w * ratio + j, dim + c] + ape[j, dim + c]) for j in range(ratio)]
                else:
                    slots = [(kv[bi, w * ratio + j, c], gate[bi, w * ratio + j, c] + ape[j, c]) for j in range(ratio)]
                logits = torch.stack([g for _, g in slots])
                p = torch.softmax(logits, 0)
                pooled[c] = sum(p[i] * v for i, (v, _) in enumerate(slots))
            out[bi, w] = rms(pooled, weight, eps)
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_kv_compressor_matches_loops(overlap):
    gen = torch.Generator().manual_seed(0)
    ratio, dim, b, windows = 4, 8, 2, 3
    ch = 2 * dim if overlap else dim
    kv, gate = randn(b, windows * ratio, ch, gen=gen), randn(b, windows * ratio, ch, scale=2.0, gen=gen)
    ape, weight = randn(ratio, ch, scale=0.5, gen=gen), 1 + randn(dim, scale=0.1, gen=gen)
    got = kv_compressor(kv, gate, ape, weight, 1e-6, overlap)
    torch.testing.assert_close(got.double(), compress_loops(kv, gate, ape, weight, 1e-6, overlap), rtol=1e-5, atol=1e-5)
    if overlap:
        prev_kv, prev_gate = randn(b, ratio, ch, gen=gen), randn(b, ratio, ch, gen=gen)
        got = kv_compressor(kv, gate, ape, weight, 1e-6, True, prev_kv, prev_gate)
        want = compress_loops(kv, gate, ape, weight, 1e-6, True, prev_kv, prev_gate)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_kv_compressor_split_calls_equal_one_call():
    """Windows compressed in two calls, the second given the first call's last window, give the same entries."""
    gen = torch.Generator().manual_seed(1)
    ratio, dim = 4, 8
    kv, gate = randn(1, 5 * ratio, 2 * dim, gen=gen), randn(1, 5 * ratio, 2 * dim, gen=gen)
    ape, weight = randn(ratio, 2 * dim, gen=gen), 1 + randn(dim, scale=0.1, gen=gen)
    whole = kv_compressor(kv, gate, ape, weight, 1e-6, True)
    cut = 2 * ratio
    first = kv_compressor(kv[:, :cut], gate[:, :cut], ape, weight, 1e-6, True)
    second = kv_compressor(kv[:, cut:], gate[:, cut:], ape, weight, 1e-6, True,
                           kv[:, cut - ratio:cut], gate[:, cut - ratio:cut])
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=0, atol=1e-6)


def test_kv_compressor_errors():
    kv = torch.randn(1, 8, 16)
    ape, weight = torch.randn(4, 16), torch.ones(8)
    with pytest.raises(ValueError, match="whole windows"):
        kv_compressor(kv[:, :6], kv[:, :6], ape, weight, 1e-6, True)
    with pytest.raises(ValueError, match="norm_weight"):
        kv_compressor(kv, kv, ape, weight, 1e-6, False)
    with pytest.raises(ValueError, match="only with overlap"):
        kv_compressor(kv, kv, ape, torch.ones(16), 1e-6, False, kv[:, :4], kv[:, :4])
    with pytest.raises(ValueError, match="ape"):
        kv_compressor(kv, kv, torch.randn(4, 8), weight, 1e-6, True)


def test_v4_indexer_matches_loops():
    gen = torch.Generator().manual_seed(2)
    b, t, h, d, n, ratio = 2, 9, 3, 8, 6, 4
    q, keys, w = randn(b, t, h, d, gen=gen), randn(b, n, d, gen=gen), randn(b, t, h, gen=gen)
    positions = torch.arange(14, 14 + t).repeat(b, 1)
    got = v4_indexer(q, keys, w, positions, ratio)
    for bi in range(b):
        for ti in range(t):
            for s in range(n):
                if s >= (int(positions[bi, ti]) + 1) // ratio:
                    assert got[bi, ti, s] == float("-inf")
                    continue
                want = sum(float(w[bi, ti, hi]) / math.sqrt(h) * max(float(q[bi, ti, hi].double() @ keys[bi, s].double()), 0.0) / math.sqrt(d)
                           for hi in range(h))
                assert got[bi, ti, s].item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_v4_topk_select_best_first_and_invalid():
    inf = float("-inf")
    scores = torch.tensor([[0.5, 2.0, 0.25, -1.0, inf], [inf, inf, 3.0, inf, inf]])
    assert v4_topk_select(scores, 3).tolist() == [[1, 0, 2], [2, -1, -1]]
    assert v4_topk_select(scores, 10).shape == (2, 5)  # k capped at the entry count
    assert v4_topk_select(torch.zeros(2, 0), 4).shape == (2, 0)
    gen = torch.Generator().manual_seed(3)
    scores = randn(4, 7, 20, gen=gen)
    got = v4_topk_select(scores, 5)
    for row, picked in zip(scores.view(-1, 20), got.view(-1, 5)):
        assert picked.tolist() == sorted(range(20), key=lambda j: -float(row[j]))[:5]
    ties = v4_topk_select(torch.tensor([[0.0, 1.0, 0.0, 0.0, -2.0]]), 2)[0].tolist()  # either tied entry may win
    assert ties[0] == 1 and ties[1] in (0, 2, 3)
    with pytest.raises(ValueError, match="k must be"):
        v4_topk_select(scores, 0)


def attention_loops(q, kv, sinks, scale, window, compressed=None, indices=None, positions=None, ratio=None):
    """Per (batch, query, head): the visible keys listed explicitly, softmax with the sink in float64."""
    b, t, h, d = q.shape
    s = kv.shape[1]
    out = torch.zeros(b, t, h, d, dtype=torch.float64)
    for bi in range(b):
        for ti in range(t):
            i = s - t + ti
            keys = [kv[bi, j].double() for j in range(s) if 0 <= i - j < window]
            if compressed is not None and indices is not None:
                keys += [compressed[bi, e].double() for e in indices[bi, ti].tolist() if e >= 0]
            elif compressed is not None:
                limit = (int(positions[bi, ti]) + 1) // ratio
                keys += [compressed[bi, e].double() for e in range(compressed.shape[1]) if e < limit]
            keys = torch.stack(keys)
            for hi in range(h):
                logits = keys @ q[bi, ti, hi].double() * scale
                z = torch.logsumexp(torch.cat([logits, sinks[hi].double().view(1)]), 0)
                out[bi, ti, hi] = torch.exp(logits - z) @ keys
    return out


@pytest.mark.parametrize("mode", ["window", "hca", "csa"])
@pytest.mark.parametrize("past", [0, 5])
def test_sparse_attention_matches_loops(mode, past):
    gen = torch.Generator().manual_seed(4)
    b, t, h, d, window, ratio = 2, 7, 3, 16, 4, 2
    s = past + t
    q, kv, sinks = randn(b, t, h, d, gen=gen), randn(b, s, d, gen=gen), randn(h, gen=gen)
    positions = torch.arange(past, s).repeat(b, 1)
    n = s // ratio
    compressed = randn(b, n, d, gen=gen) if mode != "window" else None
    indices = None
    if mode == "csa":  # a random visible subset, padded with -1
        limit = (positions + 1) // ratio
        scores = torch.rand(b, t, n, generator=gen).masked_fill(torch.arange(n) >= limit.unsqueeze(-1), float("-inf"))
        indices = v4_topk_select(scores, 4)
        assert (indices == -1).any() and (indices >= 0).any()
    args = (q, kv, sinks, d**-0.5, window, compressed, indices, positions, ratio)
    torch.testing.assert_close(sparse_attention(*args).double(), attention_loops(*args), rtol=1e-5, atol=1e-5)


def test_sparse_attention_hca_equals_csa_choosing_everything():
    gen = torch.Generator().manual_seed(5)
    b, t, h, d, ratio = 1, 9, 2, 8, 2
    q, kv, sinks, compressed = randn(b, t, h, d, gen=gen), randn(b, t, d, gen=gen), randn(h, gen=gen), randn(b, 4, d, gen=gen)
    positions = torch.arange(t)[None]
    limit = (positions + 1) // ratio
    every = torch.arange(4).expand(b, t, 4).masked_fill(torch.arange(4) >= limit.unsqueeze(-1), -1)
    hca = sparse_attention(q, kv, sinks, 0.3, 3, compressed, None, positions, ratio)
    csa = sparse_attention(q, kv, sinks, 0.3, 3, compressed, every)
    torch.testing.assert_close(hca, csa, rtol=1e-6, atol=1e-6)


def test_sparse_attention_errors():
    q, kv, sinks = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 8), torch.randn(2)
    with pytest.raises(ValueError, match="window keys cannot hold"):
        sparse_attention(q, kv[:, :3], sinks, 1.0, 4)
    with pytest.raises(ValueError, match="sinks"):
        sparse_attention(q, kv, torch.randn(3), 1.0, 4)
    with pytest.raises(ValueError, match="positions"):
        sparse_attention(q, kv, sinks, 1.0, 4, torch.randn(1, 2, 8))
    with pytest.raises(ValueError, match="point past"):
        sparse_attention(q, kv, sinks, 1.0, 4, torch.randn(1, 2, 8), torch.full((1, 4, 1), 2))


@pytest.mark.parametrize("seed", range(6))
def test_sparse_attention_in_query_chunks_equals_one_pass(seed, monkeypatch):
    """A budget that forces chunks of a few queries (each over the window keys it can see) gives the
    one-pass result: window only, HCA and CSA, rows of different lengths (kv_lens / compressed_lens)."""
    import random

    from dayzero.ops import attention_v4

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    b, t, h, d = rng.randint(1, 3), rng.randint(5, 40), rng.choice((1, 3)), 16
    window, ratio, past = rng.choice((1, 4, 9)), rng.choice((2, 4)), rng.choice((0, 3, 20))
    mode = rng.choice(("window", "hca", "csa"))
    s = past + t
    q, kv, sinks = randn(b, t, h, d, gen=gen), randn(b, s, d, gen=gen), randn(h, gen=gen)
    positions = torch.arange(past, s).repeat(b, 1)
    kv_lens = torch.tensor([s - rng.randint(0, past) for _ in range(b)]) if past and b > 1 else None
    n = s // ratio
    compressed = randn(b, n, d, gen=gen) if mode != "window" else None
    indices = None
    if mode == "csa":
        limit = (positions + 1) // ratio
        scores = torch.rand(b, t, n, generator=gen).masked_fill(torch.arange(n) >= limit.unsqueeze(-1), float("-inf"))
        indices = v4_topk_select(scores, rng.choice((1, 3, 8)))
    args = (q, kv, sinks, d**-0.5, window, compressed, indices, positions, ratio, kv_lens)
    whole = sparse_attention(*args)
    chunk = rng.choice((1, 2, 3))
    monkeypatch.setattr(attention_v4, "SCORE_ELEMENTS", b * h * chunk * (chunk + window + 8 + n))
    assert attention_v4.attention_chunk(t, window + (0 if compressed is None else n), b * h) < t
    torch.testing.assert_close(sparse_attention(*args), whole, rtol=1e-6, atol=1e-6)
