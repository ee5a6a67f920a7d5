"""The paged attention references (packed queries, keys read through shuffled block tables) against
the contiguous per-sequence arithmetic, on seeded random batches mixing prefills, chunked prefills
and decodes, with and without sliding windows, sinks and FP8 streams."""

import random

import pytest
import torch

from dayzero.ops.attention_gqa import gqa_attention, paged_gqa_attention
from dayzero.ops.attention_mla import mla_attention, paged_mla_attention
from dayzero.ops.paged import SeqBatch, query_chunks
from tests.ops.paged_inputs import fp8_round, paged_stream


def _batch(rng: random.Random, num_seqs: int, max_len: int):
    """(query_lens, seq_lens): decodes (1 new token), chunked prefills (context + chunk), fresh prefills."""
    query_lens, seq_lens = [], []
    for _ in range(num_seqs):
        kind = rng.choice(("decode", "chunk", "fresh"))
        total = rng.randint(1, max_len)
        t = 1 if kind == "decode" else total if kind == "fresh" else rng.randint(1, total)
        query_lens.append(t)
        seq_lens.append(total)
    return query_lens, seq_lens


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_gqa_matches_contiguous(seed, fp8):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    hkv = rng.choice((1, 2, 4))
    hq, d, dv = hkv * rng.choice((1, 3)), rng.choice((8, 16)), rng.choice((8, 12))
    window = rng.choice((None, 1, 3, 7))
    block = rng.choice((1, 4, 16))
    query_lens, seq_lens = _batch(rng, rng.randint(1, 5), 40)
    sinks = torch.randn(hq, generator=g) if rng.random() < 0.7 else None
    keys = [torch.randn(s, hkv, d, generator=g) for s in seq_lens]
    values = [torch.randn(s, hkv, dv, generator=g) for s in seq_lens]
    seqs = SeqBatch.build(query_lens, seq_lens, "cpu")
    q = torch.randn(seqs.num_tokens, hq, d, generator=g)
    k = paged_stream(keys, block, generator=g, fp8=fp8, window=window, seq_lens=[s - t + 1 for s, t in zip(seq_lens, query_lens)])
    v = paged_stream(values, block, generator=g, fp8=fp8, window=window, seq_lens=[s - t + 1 for s, t in zip(seq_lens, query_lens)])
    got = paged_gqa_attention(q, k, v, seqs, d ** -0.5, window, sinks)
    assert got.shape == (seqs.num_tokens, hq, dv) and not got.isnan().any()
    for b in range(seqs.num_seqs):
        rows = slice(seqs.query_start_host[b], seqs.query_start_host[b + 1])
        kb, vb = (fp8_round(keys[b]), fp8_round(values[b])) if fp8 else (keys[b], values[b])
        want = gqa_attention(q[None, rows], kb[None], vb[None], d ** -0.5, window, sinks)[0]
        torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_mla_matches_contiguous(seed, fp8):
    rng = random.Random(100 + seed)
    g = torch.Generator().manual_seed(seed)
    h, dn, dr, c, dv = rng.choice((1, 4)), rng.choice((8, 16)), rng.choice((4, 8)), rng.choice((16, 32)), rng.choice((8, 16))
    block = rng.choice((2, 16))
    query_lens, seq_lens = _batch(rng, rng.randint(1, 4), 30)
    latents = [torch.randn(s, c, generator=g) for s in seq_lens]
    pes = [torch.randn(s, dr, generator=g) for s in seq_lens]
    seqs = SeqBatch.build(query_lens, seq_lens, "cpu")
    q_nope, q_pe = torch.randn(seqs.num_tokens, h, dn, generator=g), torch.randn(seqs.num_tokens, h, dr, generator=g)
    w_uk, w_uv = torch.randn(h, dn, c, generator=g) / c ** 0.5, torch.randn(h, dv, c, generator=g) / c ** 0.5
    latent_s, pe_s = paged_stream(latents, block, generator=g, fp8=fp8), paged_stream(pes, block, generator=g, fp8=fp8)
    got = paged_mla_attention(q_nope, q_pe, latent_s, pe_s, w_uk, w_uv, 0.3, seqs)
    for b in range(seqs.num_seqs):
        rows = slice(seqs.query_start_host[b], seqs.query_start_host[b + 1])
        lat, pe = (fp8_round(latents[b]), fp8_round(pes[b])) if fp8 else (latents[b], pes[b])
        want = mla_attention(q_nope[None, rows], q_pe[None, rows], lat[None], pe[None], w_uk, w_uv, 0.3)[0]
        torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-5)


def test_query_chunks_bound_the_scores():
    assert query_chunks(16384, 16384, 4, budget=1 << 26) == 1024
    assert query_chunks(3, 10, 2) == 3 and query_chunks(10, 1 << 30, 64) == 1


def test_long_prompt_reference_is_chunked():
    """A 4K-token prompt through the reference keeps its scores chunked: the chunked result equals
    the one-shot contiguous op (same arithmetic)."""
    g = torch.Generator().manual_seed(0)
    s, h, d = 600, 2, 8
    keys, values = [torch.randn(s, 1, d, generator=g)], [torch.randn(s, 1, d, generator=g)]
    seqs = SeqBatch.build([s], [s], "cpu")
    q = torch.randn(s, h, d, generator=g)
    k, v = paged_stream(keys, 16, generator=g), paged_stream(values, 16, generator=g)
    import dayzero.ops.attention_gqa as mod
    orig = mod.query_chunks
    mod.query_chunks = lambda t, n, heads: 64  # force several chunks
    try:
        got = paged_gqa_attention(q, k, v, seqs, 0.5, None, None)
    finally:
        mod.query_chunks = orig
    torch.testing.assert_close(got, gqa_attention(q[None], keys[0][None], values[0][None], 0.5)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_gather_rows_is_every_rows_gather_right_aligned(seed):
    """PagedStream.gather_rows: each row's entries lo .. hi - 1 (as `gather` reads them), right-aligned,
    the shorter rows' first columns zero, over pages in random order whose unowned slots hold NaN."""

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rate, fp8 = rng.choice((1, 4)), rng.random() < 0.4
    counts = [rng.randint(0, 30) for _ in range(rng.randint(1, 5))]
    stream = paged_stream([torch.randn(n, 2, 128 if fp8 else 24, generator=g) for n in counts], rng.choice((8, 16)),
                          generator=g, rate=rate, fp8=fp8)
    rows = rng.sample(range(len(counts)), rng.randint(1, len(counts)))
    lo = [rng.randint(0, counts[b]) for b in rows]
    hi = [rng.randint(a, counts[b]) for a, b in zip(lo, rows)]
    got = stream.gather_rows(rows, lo, hi)
    width = max(h - a for a, h in zip(lo, hi))
    assert got.shape == (len(rows), width, *stream.entry_shape) and torch.isfinite(got).all()
    for i, (b, a, h) in enumerate(zip(rows, lo, hi)):
        assert torch.equal(got[i, width - (h - a):], stream.gather(b, a, h))
        assert (got[i, :width - (h - a)] == 0).all()
