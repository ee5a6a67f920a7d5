"""Host (CPU) time of one eager routed-expert layer call (MXFP4, the kernel the library chooses) on CUDA: how
long the Python side of moe_experts_mxfp4 takes per call with the GPU running behind it, plain and
replaying the layer's CUDA graphs (kernels/moe/_graphs.py), (no synchronisation inside a timed chunk of calls;
the minimum over chunks), and where it goes (cProfile, cumulative, --top lines). Costs a few seconds of device time.

    python3 tools/profile_moe_host.py --tokens 1 8 --top 30
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import MODELS, random_experts  # noqa: E402
from dayzero import settings  # noqa: E402
from dayzero.kernels.moe import moe_experts_mxfp4  # noqa: E402

GRAPHS_OFF = {"moe_graph_max_tokens": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--calls", type=int, default=50, help="calls per timed chunk")
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--profile-graphs", action="store_true", help="cProfile the calls replaying the layer graphs "
                    "(default: the plain eager calls)")
    args = ap.parse_args()
    for name in args.models:
        E, k, H, I, act, bias = MODELS[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        experts = random_experts(E, H, I, bias, gen)
        for T in args.tokens:
            x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
            ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
            rw = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)
            for graphs in (False, True):  # plain eager calls, then the same calls replaying the layer's graphs
                with settings.override(**({} if graphs else GRAPHS_OFF)):
                    time_calls(name, T, graphs, x, ids, rw, experts, act, args)
            if not args.top:
                continue
            with settings.override(**({} if args.profile_graphs else GRAPHS_OFF)):
                profile_calls(x, ids, rw, experts, act, args)


def time_calls(name, T, graphs: bool, x, ids, rw, experts, act, args) -> None:
    for _ in range(5):
        moe_experts_mxfp4(x, ids, rw, experts, act)
    torch.cuda.synchronize()
    hosts, cpus = [], []  # per call, in chunks: wall time, and this process's CPU time
    for _ in range(args.chunks):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.calls):
            moe_experts_mxfp4(x, ids, rw, experts, act)
        hosts.append((time.perf_counter() - t0) / args.calls)
        cpus.append((time.process_time() - c0) / args.calls)
        torch.cuda.synchronize()
    mode = "layer graphs" if graphs else "plain eager"
    print(f"{name} T={T} {mode}: host {min(hosts) * 1e6:.1f} us per call (minimum over {args.chunks} "
          f"chunks of {args.calls}; median {statistics.median(hosts) * 1e6:.1f}), process CPU time "
          f"median {statistics.median(cpus) * 1e6:.1f}", flush=True)


def profile_calls(x, ids, rw, experts, act, args) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        moe_experts_mxfp4(x, ids, rw, experts, act)
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main()
