"""Tensor and expert parallelism on the CPU (gloo): a tiny checkpoint split over 2 and 4 processes gives the
logits of the unsplit model, prefill and every decode step, in both layouts users have; each rank reads
only its share of the sharded tensors."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from dayzero.models import load_model
from tests.budget import ci_cases
from tests.models.deepseek_checkpoints import build_deepseek_v3_checkpoint, build_deepseek_v32_checkpoint
from tests.models.deepseek_v4_checkpoints import build_deepseek_v4_checkpoint
from tests.models.gpt_oss_checkpoints import build_gpt_oss_checkpoint
from tests.models.kimi_linear_checkpoints import build_kimi_linear_checkpoint

STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(vocab: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, prompt: torch.Tensor) -> list[torch.Tensor]:
    """The prompt's logits, then STEPS greedy decode steps' (each feeding the argmax back)."""
    cache = model.new_cache(1)
    t = prompt.shape[1]
    out = [model(prompt, torch.arange(t).unsqueeze(0), cache)[0]]
    for i in range(STEPS):
        nxt = out[-1][-1].argmax().view(1, 1)
        out.append(model(nxt, torch.tensor([[t + i]]), cache)[0])
    return out


def _rank(rank: int, size: int, port: int, path: str, prompt: torch.Tensor, results) -> None:
    from dayzero.parallel import init_process, shutdown

    init_process(size, 1, rank, f"tcp://127.0.0.1:{port}")
    try:
        model = load_model(path, device="cpu", dtype=torch.float32, progress=False)
        logits = _logits(model, prompt)
        read = sum(p.numel() * p.element_size() for p in model.parameters())
        results.put((rank, [x.numpy() for x in logits], read))  # by value: the process ends next
    finally:
        shutdown()


def _run_split(path, prompt, size: int = 2):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, size, port, str(path), prompt, results)) for r in range(size)]
    for p in procs:
        p.start()
    got = {r: ([torch.from_numpy(a) for a in x], n) for r, x, n in (results.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


@pytest.mark.parametrize("layout", ["mxfp4", "bf16"])  # the release layout; transformers' own save
def test_tensor_parallel_gpt_oss_gives_the_unsplit_models_logits(tmp_path, layout):
    seed = 3 if layout == "mxfp4" else 4
    path = build_gpt_oss_checkpoint(tmp_path, expert_format=layout, seed=seed, num_attention_heads=4,
                                    num_key_value_heads=2, sliding_window=5)
    prompt = _prompt(256, 11, seed)
    whole = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    want = _logits(whole, prompt)
    got = _run_split(path, prompt)
    for rank, (logits, _) in got.items():
        assert len(logits) == len(want)
        for step, (g, w) in enumerate(zip(logits, want)):
            err = ((g - w).norm() / w.norm()).item()
            assert err < 1e-5, (rank, step, err)
    attention = sum(p.numel() * p.element_size() for n, p in whole.named_parameters() if "self_attn" in n)
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    for rank, (_, held) in got.items():  # each holds half of every attention projection (and the vocab)
        assert held <= whole_bytes - attention // 2 + 1024, (rank, held, whole_bytes)


# FP8 block-scaled projections split on whole 128-blocks: dims whose per-rank shares are whole blocks at tp 2
V3_TP_DIMS = dict(qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, moe_intermediate_size=256)
CASES = {
    "gpt_oss": lambda d: build_gpt_oss_checkpoint(d, seed=5, num_attention_heads=4, num_key_value_heads=2,
                                                  sliding_window=5),
    "deepseek_v3-fp8": lambda d: build_deepseek_v3_checkpoint(d, seed=5, **V3_TP_DIMS),
    "deepseek_v32-bf16": lambda d: build_deepseek_v32_checkpoint(d, fp8=False, seed=5),
    "kimi_linear": lambda d: build_kimi_linear_checkpoint(d, seed=5),
    "deepseek_v4": lambda d: build_deepseek_v4_checkpoint(d),  # FP8 attention, FP4 experts, hash layers
}


@pytest.mark.parametrize("case,tp,ep,dispatch", [
    ("gpt_oss", 1, 2, "all_to_all"), ("gpt_oss", 2, 2, "all_reduce"), ("deepseek_v3-fp8", 2, 2, "all_to_all"),
    ("deepseek_v32-bf16", 2, 1, "all_reduce"),
    ("kimi_linear", 2, 2, "all_reduce"), ("deepseek_v4", 2, 2, "all_reduce")])
# every family at tp 2 x ep 2 (4 processes) or tp 2, ep alone once, each dispatch (the experts' all-reduce
# is one code path for every family): the suite's time on 2 cores (tests/parallel/test_k3_parallel.py: K3)
def test_llm_split_over_processes_gives_one_processs_tokens_and_logprobs(tmp_path, case, tp, ep, dispatch):
    """The LLM API (vLLM's tensor_parallel_size=, expert_parallel_size=): rank 0 schedules and samples, the
    workers run every step on their shares; prompts past the window / index_topk in one batch, chunked
    prefill, then a second turn that reuses the cached prefix. The experts' tokens cross the ranks by
    all-reduce or all-to-all (dayzero/parallel/dispatch.py)."""
    from dayzero.engine.llm import LLM
    from dayzero.engine.sampling import SamplingParams
    from dayzero.parallel import current

    path = CASES[case](tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 17, 40)]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    kwargs = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=4)

    def run(llm):
        first = llm.generate(prompts, params)
        second = llm.generate([prompts[3] + first[3].outputs[0].token_ids + [7, 8]], params)
        outs = [o.outputs[0] for o in first + second]
        hits = sum(pool.prefix_hits for pool in llm.engine.scheduler.kv.pools)
        return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs], hits

    one = LLM(path, **kwargs)
    want_tokens, want_logprobs, _ = run(one)
    split = LLM(path, tensor_parallel_size=tp, expert_parallel_size=ep, expert_dispatch=dispatch, **kwargs)
    try:
        tokens, logprobs, hits = run(split)
        assert current().expert_dispatch == dispatch
        assert split.workers is not None and split.workers.size == tp * ep
        layer = split.model.layers[-1] if case == "deepseek_v4" else split.model.model.layers[-1]
        moe = getattr(layer, "block_sparse_moe", None) or getattr(layer, "ffn", None) or layer.mlp
        attention = getattr(layer, "attn", None) or layer.self_attn
        assert moe.experts.num == 8 // ep and attention.heads == 4 // tp
    finally:
        split.close()
    assert tokens == want_tokens
    assert hits >= 2  # the second turn's prompt found the first turn's blocks
    for got, want in zip(logprobs, want_logprobs):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case,tp,ep", [("gpt_oss", 2, 2), ("deepseek_v4", 2, 1)])
def test_split_decode_graphs_and_async_scheduling_give_one_processs_outputs(tmp_path, case, tp, ep):
    """Every rank runs the decode graphs' padded static step (eagerly here: DAYZERO_STATIC_DECODE; on CUDA
    the captured graphs) for the steps rank 0 replays, 3 sequences padded to the bucket of 4, and takes the
    input ids still on rank 0's device (async scheduling) from its broadcast: one process's tokens and
    logprobs, synchronous and eager. A rank that ran the step unpadded, or with other ids, would not match
    rank 0's collectives or its logits."""
    from dayzero import settings
    from dayzero.engine.llm import LLM
    from dayzero.engine.sampling import SamplingParams

    path = CASES[case](tmp_path)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 11, 19)]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    kwargs = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=4)
    want = [o.outputs[0] for o in LLM(path, **kwargs).generate(prompts, params)]
    with settings.override(static_decode=True):
        split = LLM(path, tensor_parallel_size=tp, expert_parallel_size=ep, async_scheduling=True, **kwargs)
    try:
        got = [o.outputs[0] for o in split.generate(prompts, params)]
        assert split.runner.num_graph_steps >= 4 and split.runner.graphs.num_replays == 0  # static, uncaptured
        # V4's compressor states are snapshotted for prefix reuse: its steps stay synchronous
        assert (split.engine.num_overlapped_steps > 0) == (case != "deepseek_v4")
    finally:
        split.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for o, w in zip(got, want):
        assert torch.allclose(torch.tensor([lp.logprob for lp in o.logprobs]),
                              torch.tensor([lp.logprob for lp in w.logprobs]), rtol=1e-5, atol=1e-5)


def test_a_bad_parallel_request_is_refused_before_any_process_starts(tmp_path):
    from dayzero.engine.llm import LLM
    from dayzero.models.base import CausalLM
    from dayzero.models.kimi_linear import KimiLinearForCausalLM

    with pytest.raises(ValueError, match="expert_parallel_size must be a whole number >= 1, got 0"):
        LLM(expert_parallel_size=0)
    with pytest.raises(ValueError, match=r"expert_dispatch \(--expert-dispatch\) must be one of all_reduce, "
                                         "all_to_all, got 'alltoall'"):
        LLM(expert_parallel_size=2, expert_dispatch="alltoall")
    assert not mp.active_children()

    class Unsplit(CausalLM):  # a family whose modules have no split yet
        pass

    with pytest.raises(NotImplementedError, match=r"expert parallelism \(--ep 2\) is not built for new_family"):
        Unsplit.check_parallel("new_family", 1, 2)
    Unsplit.check_parallel("new_family", 1, 1)
    KimiLinearForCausalLM.check_parallel("kimi_k3", 2, 2)  # K3 splits both ways (tests/parallel/test_k3_parallel.py)


@pytest.mark.parametrize("case,tp,ep", ci_cases([("gpt_oss", 2, 2), ("deepseek_v4", 2, 1), ("deepseek_v3-fp8", 2, 1),
                                                  ("deepseek_v32-bf16", 2, 1), ("kimi_linear", 2, 1)], keep=2))
def test_server_on_a_split_model_gives_the_offline_outputs(tmp_path, case, tp, ep):
    """`dayzero serve --tp 2 --ep 2`'s engine behind the HTTP API (SGLang's /generate and the OpenAI
    completions route, token ids in): the outputs of one process's offline LLM; the flags map to the LLM.
    CI serves gpt-oss at tp 2 x ep 2 and DeepSeek-V4 at tp 2; DAYZERO_FULL_TESTS=1 every family. (Every
    family at tp 2 x ep 2 through the LLM API: above; 2 processes here for CI's time.)"""
    import argparse

    import httpx

    from dayzero.engine.llm import LLM
    from dayzero.engine.sampling import SamplingParams
    from dayzero.engine_args import add_engine_arguments, llm_kwargs
    from tests.server.conftest import start_server, stop_server

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flags = parser.parse_args(["--tp", "2", "--ep", "2"])
    flags.seed = 0
    kwargs = llm_kwargs(flags)
    assert (kwargs["tensor_parallel_size"], kwargs["expert_parallel_size"]) == (2, 2)
    path = CASES[case](tmp_path)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 23)]
    want = [o.outputs[0].token_ids for o in LLM(path).generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))]
    running = start_server(dict(model=path, tensor_parallel_size=tp, expert_parallel_size=ep))
    try:
        sp = {"max_new_tokens": 6, "temperature": 0}
        for p, w in zip(prompts, want):
            r = httpx.post(f"{running.url}/generate", json={"input_ids": p, "sampling_params": sp}, timeout=60)
            assert r.json()["output_ids"] == w
        r = httpx.post(f"{running.url}/v1/completions", json={"model": "demo", "prompt": prompts[1],
                                                                "max_tokens": 6, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    finally:
        stop_server(running)
        running.llm.close()


def test_generate_command_on_the_demo_splits_over_processes(capsys):
    """`dayzero generate --tp 2 --ep 2` (the demo: a tiny DeepSeek-V4 with its tokenizer) prints one process's text."""
    from dayzero.cli import main

    args = ["generate", "--prompt", "The lighthouse keeper", "--max-tokens", "6"]
    assert main(args) == 0
    one = capsys.readouterr().out
    assert main([*args, "--tp", "2", "--ep", "2"]) == 0
    assert capsys.readouterr().out == one and one.strip()
