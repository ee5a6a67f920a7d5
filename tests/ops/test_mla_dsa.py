"""MLA (absorbed form) against the expanded form through torch SDPA; the DSA indexer and top-k
selection against per-query loops; sparse MLA against dense MLA with an explicit key mask."""

import pytest
import torch
import torch.nn.functional as F

from dayzero.ops.attention_mla import mla_attention, sparse_mla_attention
from dayzero.ops.dsa import lightning_indexer, ranked_topk, topk_select

B, H, DN, DR, DV, C = 2, 3, 16, 8, 12, 20


@pytest.fixture(autouse=True)
def _private_rng():
    """Deterministic draws here, and the global generator left as other test files expect it."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield


def _inputs(t, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return dict(q_nope=r(B, t, H, DN), q_pe=r(B, t, H, DR), kv_latent=r(B, s, C), k_pe=r(B, s, DR),
                w_uk=r(H, DN, C) / C**0.5, w_uv=r(H, DV, C) / C**0.5)


def _expanded(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, scale, allowed):
    """Keys and values expanded per head through kv_b_proj, as transformers does; allowed [B, T, S]."""
    k_nope = torch.einsum("hnc,bsc->bhsn", w_uk, kv_latent)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, H, -1, -1)], dim=-1)
    v = torch.einsum("hvc,bsc->bhsv", w_uv, kv_latent)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale)
    return out.transpose(1, 2)


def _causal(t, s):
    return (torch.arange(s)[None, :] <= torch.arange(t)[:, None] + s - t).expand(B, t, s)


@pytest.mark.parametrize("t, s", [(7, 7), (1, 9), (3, 10)])
def test_mla_attention_matches_expanded_form(t, s):
    x = _inputs(t, s)
    got = mla_attention(**x, scale=0.3)
    want = _expanded(**x, scale=0.3, allowed=_causal(t, s))
    assert got.shape == (B, t, H, DV)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mla_attention_bfloat16_returns_bfloat16():
    x = {k: v.bfloat16() for k, v in _inputs(4, 6).items()}
    got = mla_attention(**x, scale=0.3)
    want = _expanded(**{k: v.float() for k, v in x.items()}, scale=0.3, allowed=_causal(4, 6))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_sparse_mla_attention_matches_masked_dense():
    t, s, k = 5, 12, 4
    x = _inputs(t, s, seed=1)
    g = torch.Generator().manual_seed(2)
    indices = torch.stack([torch.stack([torch.randperm(s, generator=g)[:k] for _ in range(t)]) for _ in range(B)])
    indices[0, 1, 2:] = -1  # unused slots
    allowed = torch.zeros(B, t, s, dtype=torch.bool)
    for b in range(B):
        for i in range(t):
            allowed[b, i, indices[b, i][indices[b, i] >= 0]] = True
    got = sparse_mla_attention(**x, scale=0.25, indices=indices.int())
    torch.testing.assert_close(got, _expanded(**x, scale=0.25, allowed=allowed), rtol=1e-5, atol=1e-5)


def test_sparse_over_all_causal_keys_equals_dense():
    t, s = 6, 9
    x = _inputs(t, s, seed=3)
    indices = topk_select(torch.randn(B, t, s), k=s)  # every visible key, -1 padded
    torch.testing.assert_close(sparse_mla_attention(**x, scale=0.2, indices=indices), mla_attention(**x, scale=0.2),
                               rtol=1e-5, atol=1e-6)


def test_sparse_mla_attention_all_unused_gives_zeros():
    x = _inputs(2, 4)
    out = sparse_mla_attention(**x, scale=0.2, indices=torch.full((B, 2, 3), -1))
    assert torch.equal(out, torch.zeros_like(out))


def test_lightning_indexer_matches_loop():
    t, s, hi, d = 4, 7, 5, 16
    g = torch.Generator().manual_seed(4)
    q, k, w = torch.randn(B, t, hi, d, generator=g), torch.randn(B, s, d, generator=g), torch.randn(B, t, hi, generator=g)
    got = lightning_indexer(q, k, w, 0.25)
    want = torch.zeros(B, t, s)
    for b in range(B):
        for i in range(t):
            for j in range(s):
                want[b, i, j] = sum(w[b, i, h] * max(0.0, 0.25 * float(q[b, i, h] @ k[b, j])) for h in range(hi))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t, s, k", [(5, 5, 3), (1, 12, 4), (4, 10, 16)])
def test_topk_select_is_causal_and_padded(t, s, k):
    scores = torch.randn(B, t, s, generator=torch.Generator().manual_seed(5))
    got = topk_select(scores, k)
    assert got.shape == (B, t, k) and got.dtype == torch.int64
    for b in range(B):
        for i in range(t):
            visible = list(range(s - t + i + 1))
            best = sorted(visible, key=lambda j: -float(scores[b, i, j]))[:k]
            assert got[b, i].tolist() == best + [-1] * (k - len(best))


def test_ranked_topk_breaks_ties_by_index_and_counts_minus_zero_as_zero():
    scores = torch.tensor([[0.0, -0.0, 2.0, 0.0, -1.0, -0.0, 2.0, float("-inf")]])
    values, indices = ranked_topk(scores, 6)
    assert indices.tolist() == [[2, 6, 0, 1, 3, 5]]
    assert values.tolist() == [[2.0, 2.0, 0.0, 0.0, 0.0, 0.0]]


def test_ranked_topk_matches_a_stable_sort_on_many_ties():
    g = torch.Generator().manual_seed(6)
    scores = torch.randint(-3, 3, (4, 9, 50), generator=g).float()  # six values: mostly ties
    values, indices = ranked_topk(scores, 17)
    for row, got in zip(scores.view(-1, 50), indices.view(-1, 17)):
        want = sorted(range(50), key=lambda j: (-float(row[j]), j))[:17]
        assert got.tolist() == want
    assert torch.equal(values, scores.gather(-1, indices))


def test_topk_select_with_ties_is_the_same_on_every_path():
    """One query's selection among tied scores does not depend on the rows around it: alone as a
    decode row, inside a prefill (keys after it masked) or as a padded batch row it gets the same
    keys, the tied ones by ascending index. (torch.topk picks none of these three zeros here, and
    other ones again in the padded row: its choice among ties follows the row's length.)"""
    s, k = 20, 6
    row = torch.zeros(s)
    row[[4, 11, 17]] = torch.tensor([0.3, 0.9, 0.5])  # three best, then 15 keys tied at 0 for 3 places
    row[[2, 8]] = -0.2
    decode = topk_select(row.view(1, 1, s), k)
    prefill = torch.randn(1, 9, s + 8, generator=torch.Generator().manual_seed(7))
    prefill[0, 0, :s] = row  # query 0 of 9 over s + 8 keys sees the first s
    in_prefill = topk_select(prefill, k)[:, :1]
    padded = torch.cat([torch.ones(5), row]).view(1, 1, s + 5).expand(2, 1, s + 5)
    in_batch = topk_select(padded, k, kv_lens=torch.tensor([s, s + 5]))[:1] - 5
    assert decode.tolist() == in_prefill.tolist() == in_batch.tolist() == [[[11, 17, 4, 0, 1, 3]]]


def test_errors_name_the_problem():
    x = _inputs(3, 5)
    with pytest.raises(ValueError, match="keys >= tokens"):
        mla_attention(**{**x, "kv_latent": x["kv_latent"][:, :2], "k_pe": x["k_pe"][:, :2]}, scale=1.0)
    with pytest.raises(ValueError, match="w_uk"):
        mla_attention(**{**x, "w_uk": x["w_uk"][:, :, :3]}, scale=1.0)
    with pytest.raises(ValueError, match=r"must lie in \[0, 5\)"):
        sparse_mla_attention(**x, scale=1.0, indices=torch.full((B, 3, 2), 5))
    with pytest.raises(ValueError, match="indices must be int32/int64"):
        sparse_mla_attention(**x, scale=1.0, indices=torch.zeros(B, 3, 2))
    with pytest.raises(ValueError, match="shapes disagree"):
        lightning_indexer(torch.randn(1, 2, 3, 4), torch.randn(1, 5, 6), torch.randn(1, 2, 3), 1.0)
    with pytest.raises(ValueError, match="cannot be the last"):
        topk_select(torch.randn(1, 4, 3), 2)
