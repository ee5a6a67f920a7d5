"""The `dayzero` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dayzero.engine_args import add_engine_arguments, add_parallel_arguments, parallel_kwargs
from dayzero.model_path import checkpoint_dir, config_file
from dayzero.server.serve import DEMO_SERVED_NAME

DEMO_NOTE = ("the demo's weights are random, so its text is noise by design: it is there to run every part of "
             "the engine (loading, paging, batching, sampling, serving) without a download; give a checkpoint "
             "directory for real text")


def _demo_dir(note: bool = False) -> Path:
    from dayzero.demo import demo_checkpoint

    started = time.perf_counter()
    out = demo_checkpoint()
    print(f"[dayzero] no model given: using the demo checkpoint at {out} ({time.perf_counter() - started:.1f} s)"
          + (f"; {DEMO_NOTE}" if note else ""), file=sys.stderr)
    return out


def _model_dir(path: str | None, note: bool = False) -> Path:
    """The checkpoint directory to use: PATH (a directory or its config.json), or the demo (with
    `note`, saying once that its text is noise)."""
    return _demo_dir(note) if path is None else checkpoint_dir(path)


def _has_weights(model_dir: Path) -> bool:
    return any(model_dir.glob("*.safetensors")) or (model_dir / "model.safetensors.index.json").exists()


def cmd_inspect(args: argparse.Namespace) -> int:
    from dayzero.inspect import build_report, format_report

    config = _model_dir(None) / "config.json" if args.model is None else config_file(args.model)
    model_dir = config.parent
    plan_args = {"gpus": args.gpus, "tp": args.tp, "ep": args.ep, "layout": args.layout, "context": args.context}
    if args.gpu_mem_gib is not None:
        plan_args["gpu_mem_gib"] = args.gpu_mem_gib
    report = build_report(config, **plan_args)
    text = format_report(report)
    if _has_weights(model_dir):
        report["checkpoint"], checkpoint_text = _checkpoint_summary(model_dir, load=args.load, device=args.device)
        text += "\n\n" + checkpoint_text
    elif args.load:
        raise FileNotFoundError(f"--load: {model_dir} holds no *.safetensors weights (config.json only)")
    print(json.dumps(report, indent=2, default=str) if args.json else text)
    return 0


def _checkpoint_summary(model_dir: Path, load: bool, device: str) -> tuple[dict, str]:
    """What is on disk (files, tensors, bytes by dtype), as JSON and as text; with `load`,
    every tensor is read back to `device` one at a time, which validates every file."""
    from dayzero.weights import Checkpoint, LoadSummary, iter_tensors

    ckpt = Checkpoint.open(model_dir)
    summary = {
        "files": len(ckpt.files),
        "tensors": len(ckpt.tensors),
        "bytes": ckpt.total_bytes,
        "bytes_by_dtype": ckpt.bytes_by_dtype(),
    }
    text = "Checkpoint on disk\n" + ckpt.summary()
    if load:
        started = time.perf_counter()
        count = sum(1 for _ in iter_tensors(ckpt, device=device))
        loaded = LoadSummary(count, len(ckpt.files), ckpt.bytes_by_dtype(), time.perf_counter() - started, device)
        summary["loaded"] = {"tensors": count, "device": device, "seconds": round(loaded.seconds, 4)}
        text += "\n" + str(loaded)
    return summary, text


def cmd_verify(args: argparse.Namespace) -> int:
    from dayzero.verify import format_result, verify_checkpoint

    model_dir = _model_dir(args.model)
    result = verify_checkpoint(model_dir, prompt_len=args.prompt_len, decode_steps=args.decode_steps, seed=args.seed,
                               dtype=args.dtype, device=args.device, tolerance=args.tolerance,
                               reference_ties=args.reference_ties, tp=args.tp, ep=args.ep, images=args.image)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_result(result))
    if not result.passed:
        print(f"dayzero verify: {result.first_divergence['message']}", file=sys.stderr)
        return 1
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from dayzero.engine import SamplingParams
    from dayzero.engine.llm import LLM

    model_dir = _model_dir(args.model, note=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop or [],
                            ignore_eos=args.ignore_eos)
    llm = LLM(model_dir, device=args.device, dtype=args.dtype, cuda_graphs=args.cuda_graphs, **parallel_kwargs(args))
    try:
        prompt = args.prompt
        if args.chat:
            prompt = llm.apply_chat_template([{"role": "user", "content": prompt}])
        for piece in llm.stream(prompt, params):
            print(piece, end="", flush=True)
        print()
    finally:
        llm.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from dayzero.server.serve import serve

    if args.model is None and args.served_model_name is None:
        args.served_model_name = DEMO_SERVED_NAME
    return serve(args, _model_dir(args.model, note=True))


def cmd_bench(args: argparse.Namespace) -> int:
    from dayzero.bench.command import bench

    return bench(args, _model_dir(args.model))


def cmd_ops(args: argparse.Namespace) -> int:
    from dayzero.ops import coverage_table

    print(coverage_table())
    return 0


def _at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse's "invalid int value" for text that is not a number
    return parse


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _add_model_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """MODEL positional or --model / --model-path, as vLLM (`serve MODEL`) and SGLang (--model-path)
    take it; main() merges the two."""
    p.add_argument("model", nargs="?", metavar="MODEL", help=f"{what}; without it, the demo checkpoint")
    p.add_argument("--model", "--model-path", dest="model_option", metavar="MODEL", default=None,
                   help="the same as MODEL")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dayzero", description="Day-0 inference for sparse frontier MoE models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "inspect",
        help="features, ops and memory plan of a checkpoint (config.json alone is enough)",
        description="Recognise a checkpoint's architecture from its config.json and print its features, "
        "the ops each layer needs with the backends that cover them, and a memory plan. "
        "Without MODEL, the embedded demo checkpoint.",
    )
    _add_model_arguments(p, "checkpoint directory, or its config file (any name: only the config is read)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--gpus", type=_at_least(1), default=None,
                   help="GPUs to plan for (default tp x ep, else 1); alone, the valid tp x ep split with the longest "
                   "context is chosen and the others listed")
    p.add_argument("--tp", "--tp-size", "--tensor-parallel-size", dest="tp", type=_at_least(1), default=None,
                   help="plan this tensor-parallel split (default: --gpus / --ep, or chosen)")
    p.add_argument("--ep", "--ep-size", "--expert-parallel-size", dest="ep", type=_at_least(1), default=None,
                   help="plan this expert-parallel split (default: --gpus / --tp, or chosen)")
    p.add_argument("--layout", action="store_true",
                   help="also the fewest GPUs, and their split, that hold one sequence of --context tokens "
                   "(default max_position_embeddings)")
    p.add_argument("--gpu-mem-gib", type=float, default=None, help="memory per GPU in GiB (default: H200, 141)")
    p.add_argument("--context", type=_at_least(1), default=None, help="context length to size the KV cache for")
    p.add_argument("--load", action="store_true", help="also read every tensor back from disk, validating the files")
    p.add_argument("--device", default="cpu", help="device to load tensors to with --load (default cpu)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "verify",
        help="compare dayzero's logits and greedy tokens with transformers on a checkpoint",
        description="Load the checkpoint in dayzero and in transformers, prefill the same random prompt and "
        "decode greedily; run transformers on the same tokens with its cached generate and with one full "
        "forward without a cache, report where those two disagree (the reference is inconsistent), and judge "
        "dayzero against the full forward: the max relative logits error of the prefill and of every decode "
        "step (against both) and whether greedy tokens agree. Exits 1 at the first divergence. Without MODEL, "
        "the demo checkpoint.",
    )
    _add_model_arguments(p, "checkpoint directory")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--prompt-len", type=int, default=32, help="random prompt length (default 32)")
    p.add_argument("--decode-steps", type=int, default=8, help="greedy decode steps (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (default float32)")
    p.add_argument("--device", default="cpu", help="device for both models (default cpu)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max relative logits error allowed (default 1e-4 for float32, 5e-2 for bfloat16)")
    p.add_argument("--reference-ties", choices=["index", "torch"], default="index",
                   help="how transformers' DSA top-k (DeepSeek-V3.2) breaks exact score ties: index = equal scores "
                   "by ascending key index, dayzero's rule (default); torch = torch.topk's order, transformers as "
                   "installed, whose cached and full-forward paths then disagree where scores tie")
    p.add_argument("--tp", "--tp-size", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="dayzero's side split over this many tensor-parallel processes (default 1)")
    p.add_argument("--ep", "--ep-size", "--expert-parallel-size", dest="ep", type=int, default=1,
                   help="and its routed experts over this many; tp x ep processes (default 1)")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image placed in the prompt (repeatable; vision-language models such as kimi_k25): both "
                   "sides read the same pixels, dayzero through its own encoder")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "generate",
        help="generate text for a prompt, streaming tokens as they come",
        description="Load the checkpoint (without MODEL, the demo) and stream a completion of the prompt.",
    )
    _add_model_arguments(p, "checkpoint directory")
    p.add_argument("--prompt", "-p", default="The lighthouse keeper", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    add_parallel_arguments(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--no-cuda-graphs", "--enforce-eager", dest="cuda_graphs", action="store_false",
                   help="run every step eagerly (default on CUDA: decode steps replay captured CUDA graphs)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "serve",
        help="serve the model over HTTP: OpenAI API and SGLang's native API",
        description="Start an HTTP server with the OpenAI API (/v1/models, /v1/completions, "
        "/v1/chat/completions), SGLang's native API (/generate, /get_model_info, /get_server_info, /health, "
        "/health_generate, /flush_cache) and Prometheus /metrics. Without MODEL, the demo checkpoint "
        f"(served as {DEMO_SERVED_NAME!r}).",
    )
    _add_model_arguments(p, "checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=30000, help="port (default 30000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the checkpoint dir name)")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="sequences waiting beyond the running ones before new requests get 503 (default 256)")
    p.add_argument("--max-request-mib", type=float, default=32,
                   help="largest request body accepted, in MiB; a larger one gets 413 (default 32)")
    add_engine_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="global seed for requests without their own")
    p.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the tool-call format the output is read in: deepseek_v31, deepseek_v32, deepseek_v4, kimi_k2, "
                   "gpt_oss, or none (default: detected from the chat template and model type)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="the format whose reasoning blocks go to reasoning_content (same names; none: left in content; "
                   "default: detected)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "bench",
        help="throughput and latency over a random workload, offline or against a server (--url)",
        description="Offline throughput and latency of the engine over NUM_PROMPTS requests of random token ids "
        "(seeded: nothing is downloaded), each generating OUTPUT_LEN tokens greedily, at every --max-concurrency "
        "level; prints request and token throughput, TTFT, TPOT and inter-token latency (mean, median, p99) and "
        "peak memory as sglang.bench_serving / vllm bench serve do. --output-file writes the JSON and a PNG "
        "beside it; --vs transformers runs the same requests through transformers' generate and prints the "
        "ratio; --url benchmarks a running OpenAI-compatible server (dayzero serve, vLLM, SGLang) instead. "
        "Without MODEL, the demo checkpoint (with --url, MODEL only gives the vocabulary the ids are drawn from).",
    )
    _add_model_arguments(p, "checkpoint directory")
    p.add_argument("--num-prompts", type=_at_least(1), default=64, help="requests in the workload (default 64)")
    p.add_argument("--input-len", type=_at_least(1), default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--output-len", type=_at_least(1), default=128, help="output tokens per request (default 128)")
    p.add_argument("--random-range-ratio", type=_ratio, default=0.0,
                   help="spread lengths uniformly over [L*(1-R), L*(1+R)], as vLLM's random dataset (default 0: "
                   "every request exactly --input-len / --output-len)")
    p.add_argument("--max-concurrency", type=_at_least(1), nargs="+", default=None, metavar="N",
                   help="requests in flight at most; several values run one after another (a sweep) "
                   "(default: every request at once)")
    p.add_argument("--num-warmups", type=_at_least(0), default=None,
                   help="warm-up requests before each level, not timed (default: as many as the level runs at once)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the engine (default 0)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate past EOS, so every request reaches --output-len (default on)")
    p.add_argument("--output-file", default=None, metavar="JSON",
                   help="write the results as JSON here and a plot (throughput and latency against concurrency) "
                   "to the same stem .png (needs matplotlib)")
    p.add_argument("--vs", choices=["transformers"], default=None,
                   help="also run the same requests through transformers' generate in this process and print "
                   "the ratio of output tokens/s")
    p.add_argument("--url", default=None,
                   help="benchmark the OpenAI-compatible server at URL (streaming /v1/completions) instead of "
                   "the engine in this process")
    p.add_argument("--api-key", default=None, help="with --url: sent as 'Authorization: Bearer KEY'")
    p.add_argument("--json-schema", nargs="?", const="records", default=None, metavar="FILE",
                   help="constrain every request's output to a JSON schema (structured outputs): FILE, or without "
                   "a value an array of 1000+ records that no run completes; needs the checkpoint's tokenizer")
    p.add_argument("--profile-steps", type=_at_least(0), default=0, metavar="N",
                   help="after each level, profile N decode steps of its batch (torch.profiler, rank 0) and print "
                   "the time per step in collectives (NCCL kernels on CUDA, gloo on the CPU) and their share of "
                   "the step: the cost of --tp / --ep (default 0: off)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    add_engine_arguments(p, max_running_requests=None,
                         running_help="sequences decoded together (default: the largest --max-concurrency, or "
                         "--num-prompts)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("ops", help="the operator library's coverage: op x backend")
    p.set_defaults(func=cmd_ops)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if getattr(args, "model_option", None) is not None:
        if args.model is not None and args.model != args.model_option:
            parser.error(f"two models given: MODEL {args.model!r} and --model {args.model_option!r}; give one")
        args.model = args.model_option
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"dayzero {args.command}: error: {exc}", file=sys.stderr)
        return 2
