"""The expert dispatch of an expert-parallel group on the CPU (gloo, 2 ranks of one group): all-reduce and
all-to-all give every rank the unsplit experts' output for every token, on fresh random inputs with as
few tokens as ranks or fewer (ranks with an empty share), shares that do not divide, slots routed to one
rank only, and gpt-oss's expert biases."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from dayzero import ops
from dayzero.ops.moe import Activation, ExpertWeights

EP, E, H, I, K = 2, 8, 16, 8, 3
TOKENS = (1, 2, 5, 13)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _case(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    if seed % 2:  # every slot on rank 1's experts
        ids = 4 + torch.stack([torch.randperm(4, generator=g)[:K] for _ in range(t)])
    weights = torch.rand(t, K, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / 4, torch.randn(E, H, I, generator=g) / 4
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    return x, ids, weights, w13, w2, b13, b2


def _rank(rank: int, port: int, results) -> None:
    from dayzero.parallel import current, init_process, shutdown
    from dayzero.parallel.dispatch import run_experts
    from dayzero.parallel.state import set_expert_dispatch

    torch.set_num_threads(1)
    init_process(1, EP, rank, f"tcp://127.0.0.1:{port}")
    try:
        start = rank * (E // EP)
        local = slice(start, start + E // EP)
        out = {}
        for mode in ("all_reduce", "all_to_all"):
            p = set_expert_dispatch(mode)
            for seed, t in enumerate(TOKENS):
                x, ids, weights, w13, w2, b13, b2 = _case(t, seed)
                experts = ExpertWeights("bf16", w13[local], w2[local], b13=b13[local], b2=b2[local])
                out[mode, t] = run_experts(current(), start, E // EP, ops.moe_experts_bf16, x, ids, weights, experts,
                                           Activation("swiglu_clamped", limit=7.0, alpha=1.702)).numpy()
        results.put((rank, p.expert_dispatch, out))
    finally:
        shutdown()


def test_all_reduce_and_all_to_all_give_the_unsplit_experts_output():
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(EP)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    activation = Activation("swiglu_clamped", limit=7.0, alpha=1.702)
    for rank, mode, out in got:
        assert mode == "all_to_all"
        for seed, t in enumerate(TOKENS):
            x, ids, weights, w13, w2, b13, b2 = _case(t, seed)
            want = ops.moe_experts_bf16(x, ids, weights, ExpertWeights("bf16", w13, w2, b13=b13, b2=b2), activation)
            for m in ("all_reduce", "all_to_all"):
                y = torch.from_numpy(out[m, t])
                assert y.shape == want.shape, (rank, m, t)
                assert torch.allclose(y, want, rtol=1e-5, atol=1e-5), (rank, m, t, (y - want).abs().max())
