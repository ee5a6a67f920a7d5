"""The Triton kernels of paged_gqa_attention (dayzero/kernels/attention) against the reference op, on
fresh random steps: shuffled block tables, variable lengths, decodes, chunked and fresh prefills mixed,
sliding windows, sinks, FP8 streams, q as a strided view of a fused projection.

Every pool gets a NaN page in front of it and NaN in every slot no sequence owns (tests/ops/paged_inputs),
so a read through a -1 table entry, past a sequence's end or before its window shows as NaN.
CPU: Triton's interpreter, small shapes, float32 (exact products) and bf16 loads and stores. CUDA
(skipped without a GPU): gpt-oss-20b's shapes (64 query / 8 kv heads, dim 64, bf16) at long contexts,
through the registry, under torch.cuda.set_sync_debug_mode("error"), and replayed from a CUDA graph.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from dayzero.kernels.attention.gqa_choose import DecodeConfig, Plan, PrefillConfig, choose
from dayzero.ops.attention_gqa import paged_gqa_attention as paged_op
from dayzero.ops.paged import PagedStream, SeqBatch
from dayzero.ops.registry import REGISTRY
from tests.budget import ci_cases
from tests.kernels.conftest import cuda, interpreter
from tests.kernels.sm90_compile import register, report
from tests.ops.paged_inputs import paged_stream, random_batch

reference = paged_op.reference.fn


def _kernel(*args, **kwargs):
    from dayzero.kernels.attention.gqa import paged_gqa_attention

    return paged_gqa_attention(*args, **kwargs)


def _guarded(s: PagedStream) -> PagedStream:
    """s with one NaN page in front of its pool (same page stride): table entry -1 reads NaN."""
    def shift(t):
        if t is None:
            return None
        base = torch.full((t.shape[0] + 1, t.stride(0) // t.stride(1), *t.shape[2:]), float("nan"), device=t.device)
        base = base.to(t.dtype)
        base[1:, :t.shape[1]] = t
        return base[1:, :t.shape[1]]

    return replace(s, data=shift(s.data), scales=shift(s.scales))


def _step(seed, query_lens, seq_lens, hkv, group, d, dv, *, window=None, block=16, sinks=True, fp8=False,
          dtype=torch.float32, device="cpu", fused_q=True, shared=False):
    """(q, k, v, seqs, scale, window, sinks) of a random step; shared: k and v one stream of [k | v]
    entries (one table, as a cache group holds them; with FP8 one scale for both, d + dv <= 128)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hq = hkv * group
    keys = [torch.randn(s, hkv, d, generator=g, device=device).to(dtype) for s in seq_lens]
    values = [torch.randn(s, hkv, dv, generator=g, device=device).to(dtype) for s in seq_lens]
    seqs = SeqBatch.build(query_lens, seq_lens, device)
    firsts = [s - t + 1 for s, t in zip(seq_lens, query_lens)]  # the first query's window decides the pages kept
    cpu_gen = torch.Generator().manual_seed(seed)
    if shared:
        kv = _guarded(paged_stream([torch.cat(e, -1) for e in zip(keys, values)], block, generator=cpu_gen, fp8=fp8,
                                   window=window, seq_lens=firsts))
        k, v = replace(kv, data=kv.data[..., :d]), replace(kv, data=kv.data[..., d:])
    else:
        k = _guarded(paged_stream(keys, block, generator=cpu_gen, fp8=fp8, window=window, seq_lens=firsts))
        v = _guarded(paged_stream(values, block, generator=cpu_gen, fp8=fp8, window=window, seq_lens=firsts))
    if fused_q:  # q as the leading heads of a [tokens, hq + 2 hkv, d] projection: rows strided
        q = torch.randn(seqs.num_tokens, hq + 2 * hkv, d, generator=g, device=device).to(dtype)[:, :hq]
    else:
        q = torch.randn(seqs.num_tokens, hq, d, generator=g, device=device).to(dtype)
    s = torch.randn(hq, generator=g, device=device) * 2 if sinks else None
    return q, k, v, seqs, d ** -0.5, window, s


def _compare(args, plan=None, tol=2e-5):
    got = _kernel(*args, plan=plan)
    want = reference(*args)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any(), "read a page or slot the step does not own"
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    return got


@interpreter
@pytest.mark.parametrize("seed", range(5))
def test_decode_interpreted(seed):
    """Decode steps, one split (the kernel normalises) or several (partials + reduce, empty splits
    included), windows shorter and longer than a tile, pages of 1 .. 16 tokens."""
    rng = random.Random(seed)
    hkv, group = rng.choice(((1, 1), (2, 3), (1, 8), (4, 2)))
    d, dv = rng.choice(((16, 16), (8, 12), (32, 16)))
    n = rng.randint(1, 4)
    seq_lens = [rng.randint(1, 90) for _ in range(n)]
    args = _step(seed, [1] * n, seq_lens, hkv, group, d, dv, window=rng.choice((None, 1, 7, 40)),
                 block=rng.choice((1, 4, 16)), sinks=rng.random() < 0.7, fp8=seed % 2 == 1, shared=seed % 3 == 0)
    for splits in (1, rng.choice((2, 3, 9))):
        _compare(args, Plan(n, DecodeConfig(splits=splits, block_n=16), None))


@interpreter
@pytest.mark.parametrize("seed", range(5))
def test_prefill_interpreted(seed):
    """The prefill kernel alone over mixed steps (fresh prompts, chunks with a cached prefix, single
    queries), query tiles of 1 .. 16 tokens x the group, windows cutting tiles on both sides."""
    rng = random.Random(50 + seed)
    hkv, group = rng.choice(((1, 1), (2, 3), (1, 4), (2, 2)))
    d, dv = rng.choice(((16, 16), (8, 12), (16, 8)))
    query_lens, seq_lens = random_batch(rng, rng.randint(1, 4), 48)
    args = _step(100 + seed, query_lens, seq_lens, hkv, group, d, dv, window=rng.choice((None, 1, 5, 20)),
                 block=rng.choice((1, 4, 16)), sinks=rng.random() < 0.7, fp8=seed % 2 == 0, shared=seed % 2 == 1)
    block_m = rng.choice((16, 32)) if group < 4 else 16
    _compare(args, Plan(0, None, PrefillConfig(block_m=block_m, block_n=16)))


@interpreter
@pytest.mark.parametrize("seed", range(2))
def test_mixed_step_interpreted(seed):
    """Decodes first, then prefills: `choose` sends the leading decodes to the decode kernel and the
    rest (a decode after a prefill included) to the prefill kernel; both write their own rows."""
    rng = random.Random(200 + seed)
    dec = rng.randint(1, 3)
    chunks = [rng.randint(2, 30) for _ in range(3)]
    query_lens = [1] * dec + chunks + [1]
    seq_lens = [rng.randint(1, 60) for _ in range(dec)] + [t + rng.choice((0, rng.randint(1, 20))) for t in chunks] + [17]
    args = _step(300 + seed, query_lens, seq_lens, 2, 4, 16, 16, window=rng.choice((None, 6)), block=4, fp8=seed == 1,
                 shared=True)
    plan = choose(tuple(query_lens), tuple(seq_lens), 8, 2, 16, args[5])
    assert plan.decode_seqs == dec and plan.decode is not None and plan.prefill is not None
    small = Plan(dec, DecodeConfig(splits=plan.decode.splits, block_n=16), PrefillConfig(block_m=16, block_n=16))
    _compare(args, small)


@interpreter
def test_bf16_streams_interpreted():
    """bf16 q and streams (the interpreter multiplies in float32; loads, stores and the output cast are
    the compiled code's), and FP8 streams read back into bf16."""
    query_lens, seq_lens = [1, 1, 9, 5], [30, 3, 20, 5]
    for fp8 in (False, True):
        args = _step(7, query_lens, seq_lens, 2, 2, 16, 16, window=8, block=4, fp8=fp8, dtype=torch.bfloat16)
        out = _compare(args, Plan(2, DecodeConfig(splits=2, block_n=16), PrefillConfig(block_m=16, block_n=16)),
                       tol=2e-2)
        assert out.dtype == torch.bfloat16


@interpreter
def test_wide_fp8_entries_interpreted():
    """Head dims above one FP8 group (two scales per entry): both kernels dequantize by group."""
    args = _step(11, [1, 1, 6, 1], [20, 9, 14, 3], 1, 2, 144, 136, window=10, block=4, fp8=True)
    _compare(args, Plan(2, DecodeConfig(splits=2, block_n=16), PrefillConfig(block_m=16, block_n=16)))


def test_choose_rule():
    # gpt-oss decode: splits fill the H200 at small batches, one split once the batch does
    one = choose((1,), (8192,), 64, 8, 64, None)
    assert one.prefill is None and one.decode_seqs == 1 and one.decode.splits == 8192 // 256
    b64 = choose((1,) * 64, (8192,) * 64, 64, 8, 64, None)
    assert b64.decode.splits == 2
    assert choose((1,) * 256, (8192,) * 256, 64, 8, 64, None).decode.splits == 1
    assert choose((1,), (1 << 17,), 64, 8, 64, None).decode.splits == 64  # the cap
    assert choose((1,) * 4, (100000,) * 4, 64, 8, 64, 128).decode.splits == 1  # a window of 128 keys: one split
    # prefill tiles hold 16 tokens x 8 heads; short chunks get shorter tiles, never below the group
    p = choose((4096,), (4096,), 64, 8, 64, None)
    assert p.decode is None and p.prefill.block_m == 128
    assert choose((2, 1), (9, 5), 64, 8, 64, None).prefill.block_m == 16
    assert choose((2,), (2,), 32, 1, 64, None).prefill.block_m == 64
    assert choose((5,), (9,), 128, 1, 64, None).prefill.block_m == 128  # one token x 128 heads a tile
    mixed = choose((1, 1, 300, 1), (50, 60, 300, 9), 64, 8, 64, None)
    assert mixed.decode_seqs == 2 and mixed.prefill is not None
    # FA2 takes a step's full-attention prefills from FLASH_MIN_PAIRS query x key pairs, where it can
    big = choose((1, 8192), (5, 8192), 64, 8, 64, None, flash_ok=True)
    assert big.flash and big.decode_seqs == 1 and not choose((8192,), (8192,), 64, 8, 64, None).flash
    assert not choose((4096,), (8191,), 64, 8, 64, None, flash_ok=True).flash  # just below 2^26 pairs
    assert choose((2048,) * 4, (8192,) * 4, 64, 8, 64, None, flash_ok=True).flash  # 4 chunks on prefixes
    assert not choose((16384,), (16384,), 64, 8, 64, 128, flash_ok=True).flash  # windowed: Triton
    assert not choose((1,) * 64, (8192,) * 64, 64, 8, 64, None, flash_ok=True).flash  # decodes only


@pytest.mark.parametrize("args", register("sass_attention_gqa", [["prefill", "--page", "16", *a] for a in ci_cases([
    ["--heads", "8x2", "--dim", "32", "--query-len", "9", "--no-sinks"],
    ["--heads", "64x8", "--dim", "64", "--query-len", "5", "--window"],
    ["--heads", "32x4", "--dim", "128", "--query-len", "3000"],
    ["--heads", "16x16", "--dim", "256", "--query-len", "40"]], keep=2)]))
def test_prefill_tiles_choose_picks_compile_for_sm90(args):
    """The prefill kernel at the tiles choose picks, compiled for sm_90 here (Triton's bundled ptxas, no
    GPU; tools/sass_attention_gqa.py): ptxas finishes and nothing spills. The first case crashed ptxas
    (SIGSEGV: 64 x 64 tiles of 32-wide heads, 4 warps, 3 stages, pages of 16) on a Qwen3.5 test model."""
    code, out, err, _ = report("sass_attention_gqa", args)
    assert code == 0, (out + err)[-2000:]
    assert "stack (spills) 0 B" in out, out


def test_checks_name_the_argument():
    from dayzero.kernels.attention.gqa import supports

    q, k, v, seqs, scale, window, sinks = _step(1, [1, 3], [4, 3], 2, 2, 16, 16, block=4)
    assert not supports(q, k, v, seqs, scale, window, sinks)  # CPU tensors: the reference runs
    assert REGISTRY.get("paged_gqa_attention").select("cpu", (q, k, v, seqs, scale)).backend == "reference"
    bad = [
        ((q[:-1], k, v, seqs, scale), "num_tokens"),
        ((q, replace(k, block_table=k.block_table.long()), v, seqs, scale), "k.block_table"),
        ((q, k, replace(v, data=v.data.float().double()), seqs, scale), "v.data"),
        ((q, replace(k, scales=None, data=k.data.to(torch.float8_e4m3fn)), v, seqs, scale), "k.data"),
        ((q, k, v, seqs, scale, 0), "sliding_window"),
        ((q, k, v, seqs, scale, None, torch.zeros(3)), "sinks"),
        ((q, replace(k, block_table=k.block_table[:, :0]), v, seqs, scale), "hold 4 tokens"),
    ]
    for args, words in bad:
        with pytest.raises(ValueError, match=words):
            _kernel(*args)


# -- CUDA -------------------------------------------------------------------------------------------

GPT_OSS = dict(hkv=8, group=8, d=64, dv=64, dtype=torch.bfloat16, device="cuda")


def _cuda_compare(args, tol=2e-2):
    with REGISTRY.force_backend("reference"):
        want = paged_op(*args)
    assert REGISTRY.get("paged_gqa_attention").select("cuda", args).backend == "triton"
    got = paged_op(*args)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    return got


@cuda
@pytest.mark.parametrize("window,fp8,block", [(None, False, 16), (128, False, 16), (None, True, 16),
                                              (128, True, 32), (None, False, 64)])
def test_gpt_oss_decode_cuda(window, fp8, block):
    """Batches 1, 7 and 64 at contexts up to 128K (splits from 1 to the cap)."""
    rng = random.Random(7)
    for seq_lens in ([131072], [rng.randint(1, 32768) for _ in range(7)], [rng.randint(4096, 8192) for _ in range(64)]):
        _cuda_compare(_step(len(seq_lens), [1] * len(seq_lens), seq_lens, window=window, block=block, fp8=fp8,
                            **GPT_OSS))


@cuda
@pytest.mark.parametrize("window,fp8", [(None, False), (128, False), (None, True)])
def test_gpt_oss_prefill_cuda(window, fp8):
    """A 4K prompt, a 2K chunk on a 6K cached prefix, and a mixed step (decodes first, prefills, one
    decode after them)."""
    for query_lens, seq_lens in (([4096], [4096]), ([2048], [8192]),
                                 ([1, 1, 1, 700, 33, 1], [900, 5000, 17, 700, 2000, 3000])):
        _cuda_compare(_step(3, query_lens, seq_lens, window=window, fp8=fp8, **GPT_OSS))


@cuda
@pytest.mark.parametrize("window,fp8", [(None, False), (128, False), (None, True), (128, True)])
def test_gpt_oss_prefill_flash_cuda(window, fp8):
    """torch's FA2 backend pinned (the gather from shuffled pages, FP8 dequantized, the window's first key,
    sinks from the log-sum-exp) and the Triton kernel pinned, on the same steps: a 4K prompt, a 2K chunk on
    a 6K prefix, a mixed step, and many short prompts of random lengths."""
    from dayzero.kernels.attention.gqa import plan_for

    rng = random.Random(11)
    lens = [rng.randint(1, 300) for _ in range(40)]
    for query_lens, seq_lens in (([4096], [4096]), ([2048], [8192]),
                                 ([1, 1, 1, 700, 33, 1], [900, 5000, 17, 700, 2000, 3000]), (lens, lens)):
        args = _step(5, query_lens, seq_lens, window=window, fp8=fp8, **GPT_OSS)
        with REGISTRY.force_backend("reference"):
            want = paged_op(*args)
        plan = plan_for(args[0], args[1], args[3], window, args[2])
        for flash in (True, False):
            got = _kernel(*args, plan=replace(plan, flash=flash))
            assert not got.isnan().any()
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@cuda
def test_no_host_sync_cuda():
    """A decode step and a mixed step run without a host synchronisation (after a first call that
    compiles the kernels)."""
    for query_lens, seq_lens in (([1] * 64, [3000] * 64), ([1, 1, 300, 1], [900, 40, 1000, 64])):
        args = _step(5, query_lens, seq_lens, window=None, **GPT_OSS)
        _cuda_compare(args)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            paged_op(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@cuda
def test_cuda_graph_replay_cuda():
    """A decode step captured once replays correctly after the sequences grow (device lengths changed
    in place; the split count stays the one picked at capture)."""
    seq_lens = [1000, 2500, 40, 4000]
    grown = [s + 300 for s in seq_lens]
    q, k, v, _, scale, window, sinks = _step(9, [1] * 4, grown, window=None, **GPT_OSS)  # tables hold the grown
    seqs = SeqBatch.build([1] * 4, seq_lens, "cuda")
    paged_op(q, k, v, seqs, scale, window, sinks)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = paged_op(q, k, v, seqs, scale, window, sinks)
    torch.cuda.current_stream().wait_stream(stream)
    seqs.seq_lens.copy_(torch.tensor(grown, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    _cuda_compare((q, k, v, SeqBatch.build([1] * 4, grown, "cuda"), scale, window, sinks))
    with REGISTRY.force_backend("reference"):
        want = paged_op(q, k, v, SeqBatch.build([1] * 4, grown, "cuda"), scale, window, sinks)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
