"""The paged lightning indexer kernel (dayzero/kernels/dsa) against the reference paged_index_topk, on
fresh random packed steps: decodes, fresh and chunked prefills mixed, shuffled pages with NaN in every
page and slot no sequence owns, top-k below and above the sequences' lengths, FP8 index keys.
CPU: Triton's interpreter, small shapes; CUDA (skipped without a GPU): DeepSeek-V3.2's indexer (64 heads
of 128, top-k 2048) at long contexts through the registry.

Selections are compared by the reference's own scores: the kernel sums in another order, so two keys
whose scores differ by a rounding may swap; what must hold is that each row selects as many keys as the
reference, in descending score order, with the reference's top-k scores."""

from __future__ import annotations

import random

import pytest
import torch

from dayzero.ops.dsa import lightning_indexer
from dayzero.ops.dsa import paged_index_topk as index_op
from dayzero.ops.paged import SeqBatch
from dayzero.ops.registry import REGISTRY
from tests.kernels.conftest import cuda, interpreter
from tests.ops.paged_inputs import paged_stream, random_batch

reference = index_op.reference.fn


def _step(seed, query_lens, seq_lens, heads, dim, *, fp8=False, block=16, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    seqs = SeqBatch.build(query_lens, seq_lens, device)
    keys = [torch.randn(s, dim, generator=g).to(dtype).to(device) for s in seq_lens]
    index_k = paged_stream(keys, block, generator=g, fp8=fp8)
    q = torch.randn(seqs.num_tokens, heads, dim, generator=g).to(dtype).to(device)
    w = (torch.randn(seqs.num_tokens, heads, generator=g) * heads ** -0.5).to(device)
    return q, w, index_k, dim ** -0.5, seqs


def _check(got, args, k, rel=1e-5):
    q, w, index_k, scale, seqs = args
    want = reference(q, w, index_k, scale, k, seqs)
    assert got.shape == want.shape and got.dtype == torch.int32
    same = 0
    for b in range(seqs.num_seqs):
        q0, ctx = seqs.query_start_host[b], seqs.context_lens[b]
        for i in range(seqs.query_lens[b]):
            r, p = q0 + i, ctx + i
            scores = lightning_indexer(q[None, r:r + 1], index_k.gather(b, 0, p + 1)[None], w[None, r:r + 1], scale)[0, 0]
            n = min(k, p + 1)
            assert (got[r, n:] == -1).all() and (got[r, :n] >= 0).all() and (got[r, :n] <= p).all(), (r, got[r])
            assert len(set(got[r, :n].tolist())) == n
            mine, theirs = scores[got[r, :n].long()], scores[want[r, :n].long()]
            tol = rel * float(scores.abs().max().clamp_min(1e-6))
            assert (mine[1:] <= mine[:-1] + tol).all(), "not in descending score order"
            torch.testing.assert_close(mine, theirs, rtol=0, atol=tol)
            same += bool(torch.equal(got[r], want[r]))
    return same / max(1, seqs.num_tokens)


@interpreter
@pytest.mark.parametrize("seed", range(6))
def test_index_topk_interpreted(seed):
    from dayzero.kernels.dsa._index import paged_index_topk

    rng = random.Random(seed)
    query_lens, seq_lens = random_batch(rng, rng.randint(1, 4), 150)
    heads, dim = rng.choice((1, 3, 16)), rng.choice((16, 32, 64))
    k = rng.choice((1, 4, 40, 200))  # below and above the sequences' lengths
    fp8 = rng.random() < 0.3
    dtype = rng.choice((torch.float32, torch.bfloat16))
    args = _step(seed, query_lens, seq_lens, heads, dim, fp8=fp8, block=rng.choice((16, 32)), dtype=dtype)
    # FP8 keys read back in bf16: Triton's interpreter rounds float32 -> bf16 its own way (not to nearest),
    # so keys may sit an ulp from the reference's (compiled, the rounding is torch's)
    rel = 1e-2 if fp8 and dtype == torch.bfloat16 else 1e-5
    same = _check(paged_index_topk(*args[:4], k, args[4]), args, k, rel)
    assert same >= (0.5 if rel > 1e-5 else 0.9), f"only {same:.0%} of the rows select exactly the reference's keys"


@interpreter
@pytest.mark.parametrize("seed", range(2))
def test_tied_scores_select_as_the_reference(seed):
    """Rows whose keys all score exactly 0 (q = 0), or -0.0 (q = 0 and negative weights), and rows where
    a few keys win and the rest tie at 0 (ReLU): the kernel's selection equals the reference's exactly,
    ties ranked by ascending position."""
    from dayzero.kernels.dsa._index import paged_index_topk

    rng = random.Random(seed)
    query_lens, seq_lens = random_batch(rng, 3, 120)
    q, w, index_k, scale, seqs = _step(seed, query_lens, seq_lens, 4, 16, block=16)
    q[0::3] = 0
    w[1::3] = -w[1::3].abs()
    q[1::3] = 0
    q[2::3, :, 1:] = 0  # one dim: about half the keys score 0 on every head
    for k in (3, 50):
        want = reference(q, w, index_k, scale, k, seqs)
        assert torch.equal(paged_index_topk(q, w, index_k, scale, k, seqs), want)


def test_unsupported_calls_run_the_reference():
    from dayzero.kernels.dsa import supports_paged_index_topk

    q, w, index_k, scale, seqs = _step(0, [3], [3], 2, 16)
    assert not supports_paged_index_topk(q, w, index_k, scale, 4, seqs)  # CPU tensors
    with REGISTRY.record_calls(by_backend=True) as calls:
        index_op(q, w, index_k, scale, 4, seqs)
    assert calls == {"paged_index_topk@reference": 1}


@cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_deepseek_v32_index_topk_cuda(fp8):
    """64 heads of 128, top-k 2048: decodes at up to 20K keys, a 3K chunk on a 5K prefix, short prefills."""
    rng = random.Random(3)
    for query_lens, seq_lens in (([1] * 4, [rng.randint(2048, 20000) for _ in range(4)]), ([3000], [8000]),
                                 random_batch(rng, 6, 600)):
        args = _step(5, query_lens, seq_lens, 64, 128, fp8=fp8, dtype=torch.bfloat16, device="cuda")
        with REGISTRY.record_calls(by_backend=True) as calls:
            got = index_op(*args[:4], 2048, args[4])
        assert calls == {"paged_index_topk@triton": 1}
        _check(got, args, 2048)


@interpreter
@pytest.mark.parametrize("seed", range(2))
def test_a_decode_step_with_a_graphs_host_lengths_selects_the_same_keys(seed):
    """A CUDA graph is captured with max_model_len as every sequence's host length (engine.graphs): the
    kernel then scores a wider row, but reads the real lengths from the device, so its selection is the
    step's own."""
    from dayzero.kernels.dsa._index import paged_index_topk

    rng = random.Random(seed)
    seq_lens = [rng.randint(1, 90) for _ in range(rng.randint(1, 4))]
    q, w, index_k, scale, seqs = _step(seed, [1] * len(seq_lens), seq_lens, 4, 16, block=16)
    wide = SeqBatch(seqs.query_start, seqs.seq_lens, seqs.query_start_host, (256,) * len(seq_lens))
    for k in (5, 64):
        assert torch.equal(paged_index_topk(q, w, index_k, scale, k, wide), paged_index_topk(q, w, index_k, scale, k, seqs))


def _order_keys(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The scores kernel's keys (dayzero/kernels/dsa/_index.py), built with torch ops."""
    bits = scores.masked_fill(scores == 0, 0.0).contiguous().view(torch.int32).to(torch.int64)
    sortable = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    keys = (sortable << 32) | (0x7FFFFFFF - torch.arange(scores.shape[-1], device=scores.device))
    return keys.masked_fill(~visible, -2**63)


@pytest.mark.parametrize("seed", range(4))
def test_order_keys_rank_as_the_reference_top_k(seed):
    """best_positions over the kernel's order keys selects the reference's ranked_topk positions: equal
    scores (zeros from the ReLU, -0.0) by ascending position, invisible keys -1, rows shorter than k."""
    from dayzero.kernels.dsa._topk import best_positions
    from dayzero.ops.dsa import ranked_topk

    g = torch.Generator().manual_seed(seed)
    rows, width, k = 3, 200 + 37 * seed, (5, 64, 256, 300)[seed]
    scores = (torch.randn(rows, width, generator=g) * 4).round() / 4  # many exact ties
    scores[:, ::7] = -0.0
    visible = torch.arange(width)[None, :] < torch.randint(1, width + 1, (rows, 1), generator=g)
    got = best_positions(_order_keys(scores, visible), k)
    _, want = ranked_topk(scores.masked_fill(~visible, float("-inf")), min(k, width))
    want = want.masked_fill(~torch.gather(visible, 1, want.clamp(min=0)), -1)
    assert torch.equal(got, want.to(got.dtype))
