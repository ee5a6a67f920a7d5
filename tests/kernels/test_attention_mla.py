"""paged_mla_attention "triton" (dayzero/kernels/attention/_mla_*.py) against the reference op, on fresh
seeded random problems: packed decodes (absorbed split-KV kernel, forced split counts including empty
splits), prefills and chunked prefills (expanded flash kernel, small key budgets forcing groups and
key chunks), mixed steps in any order, float32 / bfloat16 queries, BF16 / float32 / FP8 streams in
shuffled pages whose unused slots hold NaN. CPU tests run the kernels under Triton's interpreter at
small dims; the CUDA tests (skipped without a GPU) run DeepSeek-V3's shapes under
torch.cuda.set_sync_debug_mode("error") and in a CUDA graph."""

import random

import pytest
import torch

from dayzero.kernels.attention import _mla_decode, _mla_ops, _mla_prefill
from dayzero.ops.attention_mla import paged_mla_attention
from dayzero.ops.paged import SeqBatch
from dayzero.ops.registry import REGISTRY
from tests.kernels.conftest import cuda, interpreter
from tests.ops.paged_inputs import paged_stream


def _problem(rng: random.Random, query_lens, seq_lens, *, heads, dims, block, fp8, dtype=torch.float32,
             device="cpu", seed=0):
    """The op's arguments: q_nope, q_pe, latent and rope streams, w_uk and w_uv (strided halves of one
    kv_b weight, as a model splits kv_b_proj), scale, SeqBatch."""
    dn, dr, c, dv = dims
    g = torch.Generator().manual_seed(seed)
    seqs = SeqBatch.build(query_lens, seq_lens, device)
    latents = [torch.randn(s, c, generator=g).to(device, dtype) for s in seq_lens]
    pes = [torch.randn(s, dr, generator=g).to(device, dtype) for s in seq_lens]
    latent_s = paged_stream(latents, block, generator=g, fp8=fp8)
    pe_s = paged_stream(pes, rng.choice((block, 16)), generator=g, fp8=fp8)
    n = seqs.num_tokens
    q_nope = torch.randn(n, heads, dn, generator=g).to(device, dtype)
    q_pe = torch.randn(n, heads, dr, generator=g).to(device, dtype)
    kv_b = (torch.randn(heads, dn + dv, c, generator=g) / c ** 0.5).to(device, dtype)
    w_uk, w_uv = kv_b.split([dn, dv], dim=1)
    return q_nope, q_pe, latent_s, pe_s, w_uk, w_uv, (dn + dr) ** -0.5, seqs


def _dims(rng: random.Random):
    """(Dn, Dr, C, Dv): powers of two and not (C 160: two FP8 groups, the second partial)."""
    return rng.choice((16, 24)), rng.choice((8, 16)), rng.choice((32, 48, 160)), rng.choice((8, 16))


def _rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _reference(args):
    with REGISTRY.force_backend("reference"):
        return paged_mla_attention(*args)


@interpreter
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("fp8", [False, True])
def test_decode_matches_reference(seed, fp8):
    rng = random.Random(seed)
    heads = (1, 3, 72)[seed]  # 72: two head blocks of 64
    seq_lens = [rng.randint(1, 70) for _ in range(rng.randint(1, 4))]
    args = _problem(rng, [1] * len(seq_lens), seq_lens, heads=heads, dims=_dims(rng), block=rng.choice((1, 4, 16)),
                    fp8=fp8, seed=seed)
    out = torch.full((len(seq_lens), heads, args[5].shape[1]), float("nan"))
    splits = rng.choice((1, 2, 5))  # 5 splits of a sequence shorter than 5 tiles: empty splits
    _mla_decode.mla_decode(*args, 0, len(seq_lens), out, splits=splits)
    torch.testing.assert_close(out, _reference(args), rtol=1e-4, atol=1e-4)


@interpreter
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_matches_reference(seed, fp8):
    """Fresh and chunked prefills; a key budget smaller than the longest sequence takes it in key chunks
    merged through lse, and groups the others."""
    rng = random.Random(10 + seed)
    seq_lens = [rng.randint(2, 75) for _ in range(3)]
    query_lens = [rng.choice((s, rng.randint(2, s))) for s in seq_lens]
    args = _problem(rng, query_lens, seq_lens, heads=rng.choice((1, 2)), dims=_dims(rng), block=rng.choice((4, 16)),
                    fp8=fp8, seed=seed)
    out = torch.full((args[-1].num_tokens, args[0].shape[1], args[5].shape[1]), float("nan"))
    budget = (None, rng.randint(20, 40))[(seed + fp8) % 2]
    _mla_prefill.mla_prefill(*args, 0, len(seq_lens), out, key_budget=budget)
    torch.testing.assert_close(out, _reference(args), rtol=1e-4, atol=1e-4)


@interpreter
@pytest.mark.parametrize("fp8", [False, True])
def test_mixed_step_matches_reference(fp8):
    """The op: decodes, prefills, a sequence with no query this step, in an interleaved order (several
    runs of each kind)."""
    rng = random.Random(20 + fp8)
    query_lens = [1, 9, 1, 1, 0, 30, 1, 2]
    seq_lens = [rng.randint(1, 60), 40, rng.randint(1, 60), 33, 12, 30, 65, 50]
    args = _problem(rng, query_lens, seq_lens, heads=2, dims=_dims(rng), block=4, fp8=fp8, seed=7)
    got = _mla_ops.paged_mla_attention(*args)
    torch.testing.assert_close(got, _reference(args), rtol=1e-4, atol=1e-4)


@interpreter
def test_bfloat16_step_matches_reference():
    """bf16 queries, weights and streams (operands rounded to bf16 where the GPU rounds them)."""
    rng = random.Random(30)
    args = _problem(rng, [1, 17, 1], [45, 17, 20], heads=4, dims=(16, 8, 64, 16), block=16, fp8=False,
                    dtype=torch.bfloat16, seed=3)
    got, want = _mla_ops.paged_mla_attention(*args), _reference(args)
    assert got.dtype == torch.bfloat16 and _rel_err(got, want) < 1e-2  # measured 4e-3 (outputs of size 0.4)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_runs_split_on_query_lens():
    assert _mla_ops.runs((1, 1, 5, 0, 1, 3, 2, 1)) == [("decode", 0, 2), ("prefill", 2, 3), ("decode", 4, 5),
                                                       ("prefill", 5, 7), ("decode", 7, 8)]
    assert _mla_ops.runs((0, 1, 0, 1)) == [("decode", 1, 2), ("decode", 3, 4)] and _mla_ops.runs(()) == []


def test_key_groups_bound_the_keys():
    lens = (5, 7, 30, 2, 2, 9)
    assert _mla_prefill.key_groups(lens, 0, 6, 12) == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert _mla_prefill.key_groups(lens, 1, 4, 100) == [(1, 4)]


def test_decode_split_count():
    cpu = torch.device("cpu")
    assert _mla_decode.num_splits(8192, 1, 2, 64, cpu) == 2  # 4 interpreter slots / 2 head blocks
    assert _mla_decode.num_splits(100, 1, 1, 64, cpu) == 1  # 2 tiles: below MIN_TILES_PER_SPLIT
    assert _mla_decode.num_splits(8192, 64, 1, 64, cpu) == 1


def test_supports_declines_what_the_kernels_do_not_take():
    rng = random.Random(40)
    args = list(_problem(rng, [1, 3], [5, 3], heads=2, dims=(16, 8, 32, 16), block=4, fp8=False,
                         dtype=torch.bfloat16))
    assert _mla_ops.supports_paged_mla(*args)
    fp32 = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
    assert not _mla_ops.supports_paged_mla(*fp32)  # float32 queries: the reference
    wide = _problem(rng, [1], [3], heads=2, dims=(16, 8, 1024, 16), block=4, fp8=False, dtype=torch.bfloat16)
    assert not _mla_ops.supports_paged_mla(*wide)  # a latent past MAX_LATENT
    no_scales = list(args)
    no_scales[2] = type(args[2])(args[2].data.to(torch.float8_e4m3fn), args[2].block_table, args[2].block_size)
    assert not _mla_ops.supports_paged_mla(*no_scales)


def test_registered_for_cuda_only():
    assert "triton" in REGISTRY.backends_for("paged_mla_attention")
    impl = next(k for k in REGISTRY.get("paged_mla_attention").kernels if k.backend == "triton")
    assert impl.devices == ("cuda",) and impl.supports is _mla_ops.supports_paged_mla
    assert REGISTRY.get("paged_mla_attention").select("cpu").backend == "reference"


# --- CUDA: DeepSeek-V3 shapes (Dn 128, Dr 64, C 512, Dv 128), bf16 ------------------------------------

DEEPSEEK = (128, 64, 512, 128)


@cuda
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_deepseek_shapes_on_gpu_without_host_sync(heads, fp8):
    rng = random.Random(50 + heads + fp8)
    query_lens = [1, 1, 257, 1, 700, 1, 1, 1]
    seq_lens = [rng.randint(1, 4000), 1, 1757, rng.randint(1, 4000), 700, 8192, rng.randint(1, 300), 64]
    args = _problem(rng, query_lens, seq_lens, heads=heads, dims=DEEPSEEK, block=64, fp8=fp8, dtype=torch.bfloat16,
                    device="cuda", seed=heads)
    want = _reference(args)
    paged_mla_attention(*args)  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with REGISTRY.record_calls(by_backend=True) as calls:
            got = paged_mla_attention(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert calls == {"paged_mla_attention@triton": 1}
    assert not got.isnan().any() and _rel_err(got, want) < 2e-2
    chunked = torch.full_like(got, float("nan"))  # the 1757-key sequence in key chunks of 512
    _mla_prefill.mla_prefill(*args, 2, 3, chunked, key_budget=512)
    rows = slice(args[-1].query_start_host[2], args[-1].query_start_host[3])
    assert _rel_err(chunked[rows], want[rows]) < 2e-2


@cuda
def test_decode_step_replays_in_a_cuda_graph():
    rng = random.Random(60)
    seq_lens = [rng.randint(1, 3000) for _ in range(8)]
    args = _problem(rng, [1] * 8, seq_lens, heads=128, dims=DEEPSEEK, block=64, fp8=False, dtype=torch.bfloat16,
                    device="cuda")
    q_nope = args[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_mla_attention(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = paged_mla_attention(*args)
    torch.cuda.current_stream().wait_stream(stream)
    q_nope.copy_(torch.randn_like(q_nope))
    graph.replay()
    assert _rel_err(out, _reference(args)) < 2e-2


# --- paged_sparse_mla_attention (DSA): every query row over its selected keys -------------------------

def _selection(g, seqs, k, *, empty_row=True):
    """Random causal selections [N, k] int32: distinct positions <= each query's own, -1 padded at the
    end (as paged_index_topk pads), one row with no key at all when empty_row."""
    rows = []
    for b in range(seqs.num_seqs):
        ctx = seqs.context_lens[b]
        for i in range(seqs.query_lens[b]):
            p = ctx + i
            n = int(torch.randint(0, min(k, p + 1) + 1, (1,), generator=g))
            picked = torch.randperm(p + 1, generator=g)[:n]
            rows.append(torch.cat([picked, torch.full((k - n,), -1, dtype=torch.long)]))
    idx = torch.stack(rows).int()
    if empty_row:
        idx[0] = -1
    return idx


def _sparse_reference(args, indices):
    from dayzero.ops.attention_mla import paged_sparse_mla_attention

    with REGISTRY.force_backend("reference"):
        return paged_sparse_mla_attention(*args, indices)


@interpreter
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_matches_reference(seed, fp8):
    """Decodes and prefill rows mixed, k below and above the sequences, forced split counts (empty
    splits, a row with no key), heads across two blocks."""
    rng = random.Random(90 + seed)
    query_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 3)):
        total = rng.randint(1, 40)
        query_lens.append(rng.choice((1, total, rng.randint(1, total))))
        seq_lens.append(total)
    heads = rng.choice((1, 3, 72))
    args = _problem(rng, query_lens, seq_lens, heads=heads, dims=_dims(rng), block=rng.choice((1, 4, 16)), fp8=fp8,
                    seed=seed)
    k = rng.choice((1, 5, 64))
    indices = _selection(torch.Generator().manual_seed(seed), args[-1], k)
    out = torch.full((args[0].shape[0], heads, args[5].shape[1]), float("nan"))
    _mla_decode.mla_sparse(*args, indices, out, splits=rng.choice((1, 2, 3)))
    want = _sparse_reference(args, indices)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no selected key: zeros, as the reference
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_sparse_registered_and_declines_int64_indices():
    from dayzero.ops.attention_mla import paged_sparse_mla_attention

    impl = next(k for k in REGISTRY.get("paged_sparse_mla_attention").kernels if k.backend == "triton")
    assert impl.devices == ("cuda",) and impl.supports is _mla_ops.supports_paged_sparse_mla
    args = _problem(random.Random(0), [2], [5], heads=2, dims=(16, 8, 32, 8), block=4, fp8=False)
    idx = _selection(torch.Generator().manual_seed(0), args[-1], 3)
    assert not _mla_ops.supports_paged_sparse_mla(*args, idx.long())
    with REGISTRY.record_calls(by_backend=True) as calls:
        paged_sparse_mla_attention(*args, idx)
    assert calls == {"paged_sparse_mla_attention@reference": 1}  # CPU tensors


@cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_deepseek_v32_sparse_on_gpu(fp8):
    """128 heads, top-k 2048 of contexts up to 12K: decodes, a 300-token chunk and short prefills."""
    rng = random.Random(7 + fp8)
    query_lens, seq_lens = [1, 1, 300, 1, 40], [12000, 3000, 5000, rng.randint(1, 2048), 40]
    args = _problem(rng, query_lens, seq_lens, heads=128, dims=DEEPSEEK, block=64, fp8=fp8, dtype=torch.bfloat16,
                    device="cuda", seed=3)
    indices = _selection(torch.Generator().manual_seed(1), args[-1], 2048).cuda()
    from dayzero.ops.attention_mla import paged_sparse_mla_attention

    with REGISTRY.record_calls(by_backend=True) as calls:
        got = paged_sparse_mla_attention(*args, indices)
    assert calls == {"paged_sparse_mla_attention@triton": 1}
    want = _sparse_reference(args, indices)
    assert not got.isnan().any() and _rel_err(got, want) < 2e-2
