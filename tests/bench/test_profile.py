"""`dayzero bench --profile-steps`: the collectives' share of decode steps (dayzero/bench/profile.py), on the
CPU: gloo's collectives at --tp 2, none in one process; the engine idle afterwards."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from dayzero.bench.profile import CollectiveProfile, collective_kind, profile_decode
from dayzero.cli import main


@pytest.mark.parametrize("name,kind", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", ("device", "all_reduce")),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t", ("device", "all_gather")),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", ("device", "send_recv")),  # all_to_all_single
    ("ncclDevKernel_Broadcast_RING_LL", ("device", "broadcast")),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", ("device", "reduce_scatter")),
    ("gloo:all_reduce", ("host", "all_reduce")), ("gloo:all_to_all", ("host", "all_to_all")),
    ("gloo:broadcast", ("host", "broadcast")), ("gloo:barrier", ("host", "other")),
    ("nccl:all_reduce", None), ("c10d::allreduce_", None), ("record_param_comms", None), ("aten::mm", None),
    ("void cutlass::Kernel<all_reduce_like>", None),
])
def test_collective_kind(name, kind):
    assert collective_kind(name) == kind


def test_the_share_counts_the_device_on_cuda_and_the_host_on_the_cpu():
    p = CollectiveProfile(batch=4, steps=2, wall_s=0.010, profiled_wall_s=0.020, on_cuda=True)
    for name, s in (("ncclDevKernel_AllReduce_Sum", 0.002), ("ncclDevKernel_AllReduce_Sum", 0.001),
                    ("gloo:broadcast", 0.004), ("aten::mm", 0.005)):
        p.add(name, s)
    got = p.summary()
    assert got["device_ms_per_step"] == pytest.approx({"all_reduce": 1.5})
    assert got["host_ms_per_step"] == pytest.approx({"broadcast": 2.0})
    assert got["step_ms"] == pytest.approx(5.0) and got["profiled_step_ms"] == pytest.approx(10.0)
    assert got["share"] == pytest.approx(0.3)
    p.on_cuda = False
    assert p.summary()["share"] == pytest.approx(0.4)


def test_one_process_has_no_collectives_and_the_engine_is_idle_after():
    from dayzero.engine import SamplingParams
    from dayzero.engine.llm import LLM
    from tests.engine.test_llm import _assert_pool_free

    llm = LLM(None, max_num_seqs=3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    requests = [llm.engine.validate(list(range(5, 5 + n)), params) for n in (3, 9, 20)]
    got = profile_decode(llm.engine, requests, steps=3).summary()
    assert got["batch"] == 3 and got["steps"] == 3 and got["step_ms"] > 0
    assert got["device_ms_per_step"] == {} and got["host_ms_per_step"] == {} and got["share"] == 0.0
    _assert_pool_free(llm)
    with pytest.raises(ValueError, match="--profile-steps must be at least 1"):
        profile_decode(llm.engine, requests, steps=0)
    short = [llm.engine.validate([5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))]
    with pytest.raises(ValueError, match="profiled request 0: max_tokens 1 ends it before the profile does"):
        profile_decode(llm.engine, short + requests[:1], steps=3)
    _assert_pool_free(llm)


def test_bench_at_tp2_reports_gloo_collectives(tmp_path):
    out = tmp_path / "tp2.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["bench", "--tp", "2", "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                   "--num-warmups", "0", "--max-concurrency", "2", "--profile-steps", "3", "--output-file", str(out),
                   "--disable-tqdm"])
    assert rc == 0, stderr.getvalue()
    text = stdout.getvalue()
    assert "tp 2 x ep 1" in text and "Collectives: 3 decode steps of 2 (rank 0)" in text
    assert "all_reduce (host, ms/step):" in text and "Share of the step (host collectives):" in text
    profile = json.loads(out.read_text())["runs"][0]["profile"]
    assert profile["batch"] == 2 and profile["steps"] == 3
    assert profile["host_ms_per_step"]["all_reduce"] > 0  # the row-parallel projections' sums
    assert profile["host_ms_per_step"]["broadcast"] > 0  # rank 0's schedule of each step
    assert 0 < profile["share"] < 1 and profile["device_ms_per_step"] == {}
