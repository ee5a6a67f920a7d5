"""Tensor and expert parallelism against one GPU, in one run: decode tokens/s of each tp x ep split at each
batch, the collectives' share of its decode step, and the roofline.

    python bench/parallel.py --model /tmp/gpt-oss-20b --make --splits 1x1 2x1 1x2
    python bench/parallel.py --model /tmp/dsv4 --make deepseek-v4-flash --layers 12 --splits 1x1 2x1 1x2
    python bench/parallel.py --device cpu --dtype float32 --splits 1x1 2x1 --levels 1 4 --input-len 16 \
        --output-len 16 --profile-steps 4                    # the demo checkpoint over gloo (no GPU)

Each split runs in a process of its own (the checkpoint loaded once per split; one split's memory gone
before the next starts). Per batch B: a warm-up of B requests, then B requests of --input-len random ids
generating --output-len greedy tokens each, all at once (prefix caching off): decode tok/s = B / median
TPOT; then --profile-steps decode steps of a batch of B profiled on rank 0 (dayzero/bench/profile.py:
NCCL kernels' time per step by kind, and their share of the step). Roofline of a decode step at B (CUDA):
the bytes it reads (bench/e2e.py's SpecShapes: weights in their stored format, the experts B tokens route
to, the KV cache at the mean context) spread evenly over the tp x ep GPUs at the copy bandwidth measured on
GPU 0 after the splits ran: B / (bytes / (tp x ep x bandwidth)) tok/s (no communication counted).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _split(text: str) -> tuple[int, int]:
    try:
        tp, ep = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a split is TPxEP (2x1, 1x2), got {text!r}") from None
    if tp < 1 or ep < 1:
        raise argparse.ArgumentTypeError(f"tp and ep must be at least 1, got {text!r}")
    return tp, ep


def one_split(args) -> dict:
    """This process's split: every level's decode numbers and profile."""
    import torch

    from dayzero.bench.offline import run_offline
    from dayzero.bench.profile import profile_decode, tokens_needed
    from dayzero.bench.workload import Workload
    from dayzero.engine.llm import LLM
    from dayzero.engine.sampling import SamplingParams

    tp, ep = args.one
    profile_tokens = tokens_needed(args.profile_steps)
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, tensor_parallel_size=tp, expert_parallel_size=ep,
              expert_dispatch=args.expert_dispatch, max_num_seqs=max(args.levels), enable_prefix_caching=False,
              max_num_batched_tokens=args.budget, kv_cache_gib=args.kv_cache_gib,
              max_model_len=args.input_len + max(args.output_len, profile_tokens) + 8, progress=False)
    out = {"tp": tp, "ep": ep, "start_s": time.perf_counter() - t0, "levels": []}
    for i, batch in enumerate(args.levels):
        work = Workload(batch, args.input_len, args.output_len, llm.vocab_size, seed=batch)
        warm = Workload(batch, args.input_len, min(args.output_len, 8), llm.vocab_size, seed=batch)
        run_offline(llm.engine, warm.requests(1000 + i), batch, prefix="warmup")
        s = run_offline(llm.engine, work.requests(i), batch).summary()
        level = {"batch": batch, "median_tpot_ms": s["median_tpot_ms"], "output_throughput": s["output_throughput"],
                 "decode_tok_s": batch / (s["median_tpot_ms"] / 1e3), "failed": s["failed"]}
        if args.profile_steps:
            params = SamplingParams(max_tokens=profile_tokens, temperature=0.0, ignore_eos=True)
            requests = [llm.engine.validate(r.prompt_token_ids, params) for r in work.requests(2000 + i)]
            level["profile"] = profile_decode(llm.engine, requests, args.profile_steps).summary()
        out["levels"].append(level)
        print(f"[parallel] {tp}x{ep} batch {batch}: {level['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    if args.device == "cuda":
        out["peak_gib_rank0"] = torch.cuda.max_memory_allocated() / 2**30
    llm.close()
    return out


def _roofline(model, levels: list[int], context: int) -> dict[int, float] | None:
    """Bytes a decode step reads at each batch, or None where they cannot be counted (the demo)."""
    from bench.e2e import SpecShapes

    if model is None:
        return None
    shapes = SpecShapes(Path(model))
    return {b: shapes.decode_bytes(b, context) for b in levels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the demo)")
    ap.add_argument("--make", nargs="?", const="gpt-oss-20b", metavar="KIND",
                    help="write the random checkpoint KIND (bench/checkpoints.py; default gpt-oss-20b) there if absent")
    ap.add_argument("--layers", type=int, default=None, help="with --make: layers to write")
    ap.add_argument("--splits", type=_split, nargs="+", default=[(1, 1), (2, 1), (1, 2)], metavar="TPxEP",
                    help="the splits to run, one after another (default 1x1 2x1 1x2); 1x1 is the baseline")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 64, 256], metavar="B", help="decode batches")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=16, help="decode steps profiled per batch (0: none)")
    ap.add_argument("--expert-dispatch", default="all_reduce", choices=["all_reduce", "all_to_all"])
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--kv-cache-gib", type=float, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", type=Path, default=None, help="write every split's numbers here")
    ap.add_argument("--one", type=_split, default=None, help=argparse.SUPPRESS)  # a child: run this split
    ap.add_argument("--one-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        args.one_out.write_text(json.dumps(one_split(args)))
        return
    if args.make and args.model is not None and not (args.model / "config.json").exists():
        from bench.checkpoints import write_checkpoint

        t0 = time.perf_counter()
        write_checkpoint(args.make, args.model, args.device, args.layers)
        print(f"wrote {args.model} in {time.perf_counter() - t0:.0f} s", flush=True)
    results = []
    for tp, ep in args.splits:
        out = Path(f"/tmp/dayzero-parallel-{tp}x{ep}.json")
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", f"{tp}x{ep}", "--one-out", str(out)]
        t0 = time.perf_counter()
        run = subprocess.run(cmd)
        if run.returncode != 0:
            print(f"split {tp}x{ep} failed (exit {run.returncode}) after {time.perf_counter() - t0:.0f} s", flush=True)
            continue
        results.append(json.loads(out.read_text()))
    bandwidth = None
    if args.device == "cuda":
        from bench.moe import copy_bandwidth

        bandwidth = copy_bandwidth()
        print(f"copy bandwidth (GPU 0): {bandwidth / 1e12:.2f} TB/s", flush=True)
    context = args.input_len + args.output_len // 2
    reads = _roofline(args.model, args.levels, context) if bandwidth else None
    base = {lv["batch"]: lv["decode_tok_s"] for r in results if (r["tp"], r["ep"]) == (1, 1) for lv in r["levels"]}
    print(f"\n{'split':6} {'batch':>5} {'tok/s':>10} {'TPOT ms':>8} {'vs 1x1':>7} {'roofline':>10} {'ours/roof':>9} "
          f"{'collectives ms/step':>30} {'share':>6}")
    for r in results:
        world = r["tp"] * r["ep"]
        for lv in r["levels"]:
            b = lv["batch"]
            roof = b / (reads[b] / (world * bandwidth)) if reads else None
            p = lv.get("profile") or {}
            comm = p.get("device_ms_per_step") if args.device == "cuda" else p.get("host_ms_per_step")
            comm_text = ", ".join(f"{k} {v:.3f}" for k, v in (comm or {}).items()) or "-"
            tok = lv["decode_tok_s"]
            vs = f"{tok / base[b]:.2f}x" if b in base else "-"
            roof_text = f"{roof:.0f}" if roof else "-"
            ratio = f"{tok / roof:.2f}" if roof else "-"
            share = f"{100 * p['share']:.1f}%" if p else "-"
            split = f"{r['tp']}x{r['ep']}"
            print(f"{split:6} {b:>5} {tok:>10.1f} {lv['median_tpot_ms']:>8.3f} {vs:>7} {roof_text:>10} {ratio:>9} "
                  f"{comm_text:>30} {share:>6}")
    if args.json:
        args.json.write_text(json.dumps({"splits": results, "copy_Bps": bandwidth, "context": context,
                                         "decode_bytes": reads, "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=1))


if __name__ == "__main__":
    main()
