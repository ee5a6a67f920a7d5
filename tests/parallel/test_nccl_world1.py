"""On one GPU: the NCCL path joined at world size 1 runs the split code paths with their communication
(every collective of dayzero/models/sharded.py, eagerly and captured in the decode graphs) and gives the
unsplit engine's greedy tokens and logprobs, every family. Skips without CUDA."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from tests.parallel.test_tensor_parallel import CASES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(path, cuda_graphs: bool):
    from dayzero.engine.llm import LLM
    from dayzero.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 40)]
    llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=64, cuda_graphs=cuda_graphs)
    outs = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, logprobs=1))]
    graphs = llm.runner.num_graph_steps
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs], graphs


def _same(tokens, logprobs, want_tokens, want_logprobs) -> None:
    """Greedy tokens and logprobs equal: in a group of one every split module runs the unsplit kernels and
    NCCL's sum of one rank is the rank's tensor (compared eager with eager, graphs with graphs: a captured
    batch is padded to its graph's size, which may pick other matmul kernels)."""
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        diff = (torch.tensor(got) - torch.tensor(want)).abs().max().item()
        assert diff == 0.0, f"logprobs differ by up to {diff}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_nccl_at_world_size_one_gives_the_unsplit_tokens(tmp_path, case, monkeypatch):
    from dayzero.parallel import current, init_process, shutdown

    path = CASES[case](tmp_path)
    eager = _run(path, cuda_graphs=False)[:2]
    graphs = _run(path, cuda_graphs=True)[:2]
    init_process(1, 1, 0, f"tcp://127.0.0.1:{_free_port()}", "cuda:0")
    try:
        assert current().backend == "nccl" and current().tp_group is not None and current().ep_group is not None
        calls = []
        for name in ("all_reduce", "all_gather"):
            original = getattr(dist, name)
            monkeypatch.setattr(dist, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
        tokens, logprobs, _ = _run(path, cuda_graphs=False)
        assert {"all_reduce", "all_gather"} <= set(calls)  # the communication really ran
        _same(tokens, logprobs, *eager)
        tokens, logprobs, graph_steps = _run(path, cuda_graphs=True)
        assert graph_steps > 0  # decode steps replayed graphs with the collectives captured in them
        _same(tokens, logprobs, *graphs)
    finally:
        shutdown()
