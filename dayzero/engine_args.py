"""The engine's command-line flags, shared by `dayzero serve` and `dayzero bench`: named once (as SGLang
names them) and turned into `LLM` keyword arguments, each value checked with an error naming its flag.
The commands add their own `--seed` (LLM(seed=)) beside these."""

from __future__ import annotations

import argparse

from dayzero.parallel.state import EXPERT_DISPATCH

DTYPE_CHOICES = ["float32", "bfloat16", "float16"]


def add_engine_arguments(p: argparse.ArgumentParser, max_running_requests: int | None = 16,
                         running_help: str = "sequences decoded together (default 16)") -> None:
    p.add_argument("--max-running-requests", type=int, default=max_running_requests, help=running_help)
    p.add_argument("--chunked-prefill-size", type=int, default=2048,
                   help="tokens per engine step, prefill chunks included (default 2048; -1 = the context length)")
    p.add_argument("--mem-fraction", "--mem-fraction-static", dest="mem_fraction", type=float, default=None,
                   help="fraction of the device's memory (RAM on CPU) for weights + KV cache; sizes the KV "
                   "block pool (default: room for every running request at full context)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache size in GiB (overrides --mem-fraction)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                   help="KV cache entries in the model's dtype (auto) or FP8 E4M3 with a scale per 128 values")
    p.add_argument("--fp8-workspace-gib", type=float, default=None,
                   help="cross-layer FP8 expert workspace of MXFP4 models on CUDA (default: one layer's experts)")
    p.add_argument("--disable-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks (and saved states) of earlier requests' prefixes")
    p.add_argument("--max-model-len", "--context-length", dest="max_model_len", type=int, default=None,
                   help="context length to serve (default: the model's, at most 8192)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32")
    p.add_argument("--no-cuda-graphs", "--enforce-eager", dest="cuda_graphs", action="store_false",
                   help="run every step eagerly (default on CUDA: decode steps replay captured CUDA graphs)")
    add_parallel_arguments(p)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each step before the last one's sampled ids reach the host "
                        "(default: on for CUDA)")


def llm_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from the flags of add_engine_arguments (and --seed); ValueError naming
    the flag whose value cannot work."""
    if args.max_running_requests is None or args.max_running_requests < 1:
        raise ValueError(f"--max-running-requests must be at least 1, got {args.max_running_requests}")
    if args.mem_fraction is not None and not 0 < args.mem_fraction <= 1:
        raise ValueError(f"--mem-fraction must be in (0, 1], got {args.mem_fraction}")
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        raise ValueError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be at least 2 (a prompt token and a generated one), "
                         f"got {args.max_model_len}")
    if args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1:
        raise ValueError(f"--chunked-prefill-size must be at least 1, or -1 for the context length; "
                         f"got {args.chunked_prefill_size}")
    return dict(device=args.device, dtype=args.dtype, max_num_seqs=args.max_running_requests,
                max_num_batched_tokens=args.chunked_prefill_size if args.chunked_prefill_size > 0 else 1 << 30,
                max_model_len=args.max_model_len, mem_fraction=args.mem_fraction, kv_cache_gib=args.kv_cache_gib,
                kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=not args.disable_prefix_caching,
                fp8_workspace_gib=args.fp8_workspace_gib, seed=args.seed, cuda_graphs=args.cuda_graphs,
                async_scheduling=args.async_scheduling, **parallel_kwargs(args))


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """--tp and --ep (SGLang's names; vLLM's long forms too): also on `dayzero generate`."""
    p.add_argument("--tp", "--tp-size", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="processes the attention and dense layers are split over, one per device (default 1)")
    p.add_argument("--ep", "--ep-size", "--expert-parallel-size", dest="ep", type=int, default=1,
                   help="processes the routed experts are split over; the job runs tp x ep processes (default 1)")
    p.add_argument("--expert-dispatch", choices=EXPERT_DISPATCH, default="all_reduce",
                   help="with --ep > 1, how tokens reach the experts' ranks: all_reduce (every rank runs its experts "
                        "on every token, outputs summed; CUDA graphs) or all_to_all (each token's pairs sent to their "
                        "experts' ranks and back; eager decode) (default all_reduce; docs/parallel.md)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes the tp x ep processes run on, tp x ep / nnodes each (default 1)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's index in [0, nnodes): node 0 schedules and serves, the others run ranks")
    p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="node 0's rendezvous address, the same on every node (needed with --nnodes > 1)")


def parallel_kwargs(args: argparse.Namespace) -> dict:
    for flag, n in (("--tp", args.tp), ("--ep", args.ep)):
        if n < 1:
            raise ValueError(f"{flag} must be at least 1, got {n}")
    return dict(tensor_parallel_size=args.tp, expert_parallel_size=args.ep, expert_dispatch=args.expert_dispatch,
                nnodes=args.nnodes,
                node_rank=args.node_rank, dist_init_addr=args.dist_init_addr)


def worker_node(args: argparse.Namespace) -> int | None:
    """For a command run on a process that is not rank 0 (--node-rank > 0, torchrun's RANK > 0): run this
    node's ranks until rank 0 ends the job and return the exit code; None on rank 0 (run the command)."""
    from dayzero.engine import tp_workers
    from dayzero.parallel.launch import launch_of

    launch = launch_of(args.nnodes, args.node_rank, args.dist_init_addr)
    if launch.is_rank0():
        return None
    return tp_workers.run_ranks_here(args.tp, args.ep, args.device, launch)
