"""`dayzero bench`: the workload at every concurrency level of the sweep, through the engine in this
process (or a server behind --url), the transformers baseline with --vs transformers, the printed
report, and with --output-file the JSON and the PNG beside it.

Every level gets fresh prompts of the same lengths (workload.py) and, unless --num-warmups says
otherwise, a warm-up first: as many requests as the level runs at once (offline, at most
--max-running-requests), with at most WARMUP_OUTPUT_LEN output tokens each, so first-call allocation
and kernel compilation fall outside the timed run. The engine is built for the workload:
--max-running-requests defaults to the largest level, --max-model-len to the longest request (prompt
+ output), so the default KV pool holds exactly the requests that run together.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from dayzero.bench.plot import require_matplotlib, write_plot
from dayzero.bench.report import format_comparison, format_profile, format_run
from dayzero.bench.workload import WARMUP_DRAW, BenchRequest, Workload

WARMUP_OUTPUT_LEN = 16


def _bar(args: argparse.Namespace, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=args.disable_tqdm, leave=False)


def _levels(args: argparse.Namespace) -> list[int | None]:
    return list(args.max_concurrency) if args.max_concurrency else [None]


def _warmup(args: argparse.Namespace, workload: Workload, level: int | None, index: int,
            running: int | None = None) -> list[BenchRequest]:
    """The warm-up before level `index`: --num-warmups requests, by default as many as run at once
    (the level, at most the engine's `running` requests)."""
    count = args.num_warmups
    if count is None:
        count = min(level or workload.num_prompts, workload.num_prompts, running or workload.num_prompts)
    requests = workload.requests(WARMUP_DRAW + index)[:count]
    return [dataclasses.replace(r, output_len=min(r.output_len, WARMUP_OUTPUT_LEN)) for r in requests]


def _check(args: argparse.Namespace) -> Path | None:
    """The JSON path (or None); ValueError naming the flags that cannot go together."""
    if args.url is not None and args.vs is not None:
        raise ValueError("--vs transformers runs transformers in this process, next to the engine; it cannot be "
                         "combined with --url (benchmark the server, then run without --url)")
    if args.json_schema is not None and args.vs is not None:
        raise ValueError("--json-schema constrains dayzero's outputs; transformers' generate would run "
                         "unconstrained, so --vs transformers cannot be combined with it")
    if args.url is not None and args.profile_steps:
        raise ValueError("--profile-steps profiles the engine in this process; it cannot be combined with --url")
    if args.output_file is None:
        return None
    output = Path(args.output_file)
    if output.suffix.lower() == ".png":
        raise ValueError(f"--output-file {output} is the JSON; the PNG is written beside it with the same stem "
                         f"({output.with_suffix('.png').name} for {output.with_suffix('.json').name})")
    require_matplotlib()
    return output


def _json_schema(flag: str | None) -> dict | None:
    """--json-schema: None (unconstrained), "records" (RECORDS_SCHEMA) or a file holding a JSON schema."""
    from dayzero.bench.workload import RECORDS_SCHEMA

    if flag is None:
        return None
    if flag == "records":
        return RECORDS_SCHEMA
    path = Path(flag)
    if not path.is_file():
        raise ValueError(f"--json-schema {flag}: no such file (give a JSON schema file, or 'records')")
    try:
        schema = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"--json-schema {flag}: not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {flag}: a JSON schema is an object")
    return schema


def bench(args: argparse.Namespace, model_dir: Path) -> int:
    """Run `dayzero bench`; model_dir: the checkpoint (with --url, only its vocabulary is read: the
    prompts' token ids are drawn from it)."""
    from dayzero.spec import load_spec

    output = _check(args)
    workload = Workload(args.num_prompts, args.input_len, args.output_len, load_spec(model_dir).vocab_size,
                        args.random_range_ratio, args.seed, _json_schema(args.json_schema))
    levels = _levels(args)
    if args.url is not None:
        backend, info, runs, baseline = _bench_remote(args, workload, levels)
    else:
        backend, info, runs, baseline = _bench_offline(args, model_dir, workload, levels)
    for run in runs:
        print(format_run(run, backend), flush=True)
        if "profile" in run:
            print(format_profile(run["profile"]), flush=True)
    if baseline:
        print(format_comparison(runs, baseline), flush=True)
    if output is not None:
        _write(args, output, backend, info, workload, runs, baseline)
    failed = [e for run in runs for e in run["errors"]]
    if failed:
        print(f"dayzero bench: {len(failed)} requests failed; the first: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def _bench_offline(args, model_dir: Path, workload: Workload, levels: list[int | None]):
    import torch

    from dayzero.bench.offline import run_offline
    from dayzero.engine.llm import DTYPES, LLM
    from dayzero.engine_args import llm_kwargs

    widest = min(max(level or workload.num_prompts for level in levels), workload.num_prompts)
    if args.max_running_requests is None:
        args.max_running_requests = widest
    elif args.max_running_requests < widest:
        print(f"[dayzero] up to {widest} requests are in flight (--max-concurrency, else --num-prompts) and "
              f"--max-running-requests is {args.max_running_requests}: the engine runs that many together, the "
              "rest wait in its queue (their TTFT includes the wait)", file=sys.stderr)
    if args.max_model_len is None:  # with --profile-steps, room for the profiled requests' longer outputs
        from dayzero.bench.profile import tokens_needed

        args.max_model_len = workload.max_request_len + (tokens_needed(args.profile_steps) if args.profile_steps else 0)
    llm = LLM(model_dir, **llm_kwargs(args), progress=not args.disable_tqdm)
    runs = []
    try:
        for index, level in enumerate(levels):
            warmup = _warmup(args, workload, level, index, args.max_running_requests)
            if warmup:
                run_offline(llm.engine, warmup, level, args.ignore_eos, prefix="warmup")
            with _bar(args, workload.num_prompts, f"dayzero, concurrency {level or 'all'}") as bar:
                run = run_offline(llm.engine, workload.requests(index), level, args.ignore_eos, progress=bar)
            runs.append(run.summary())
            if args.profile_steps:
                runs[-1]["profile"] = _profile(args, llm, workload, level, index)
    finally:  # --tp / --ep: the workers and this process leave the job (a later engine in-process is alone)
        llm.close()
    info = {"model": str(model_dir), "device": args.device, "dtype": args.dtype,
            "max_running_requests": args.max_running_requests, "max_model_len": llm.max_model_len,
            "kv_cache_blocks": llm.scheduler.kv.pool.num_blocks}
    baseline = None
    if args.vs is not None:
        from dayzero.bench.baseline import load_baseline, run_transformers
        from dayzero.engine.engine import eos_token_ids

        eos = eos_token_ids(llm.path, llm.tokenizer)
        del llm  # transformers' copy of the weights takes its place
        gc.collect()
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
        model = load_baseline(model_dir, DTYPES[args.dtype], args.device)
        baseline = []
        for index, level in enumerate(levels):
            with _bar(args, workload.num_prompts, f"transformers, concurrency {level or 'all'}") as bar:
                result = run_transformers(model, workload.requests(index), level, args.ignore_eos, eos, progress=bar)
            baseline.append(result.summary())
    split = f", tp {args.tp} x ep {args.ep}" if args.tp * args.ep > 1 else ""
    return f"dayzero ({args.device}, {args.dtype}{split})", info, runs, baseline


def _profile(args, llm, workload: Workload, level: int | None, index: int) -> dict:
    """--profile-steps: the collectives' share of decode steps of the level's batch (dayzero/bench/profile.py)."""
    from dayzero.bench.profile import profile_decode, tokens_needed
    from dayzero.engine.sampling import SamplingParams

    batch = min(level or workload.num_prompts, workload.num_prompts, args.max_running_requests)
    params = SamplingParams(max_tokens=tokens_needed(args.profile_steps), temperature=0.0, ignore_eos=True)
    requests = [llm.engine.validate(r.prompt_token_ids, params, f"profiled prompt {i}")
                for i, r in enumerate(workload.requests(index)[:batch])]
    return profile_decode(llm.engine, requests, args.profile_steps).summary()


def _bench_remote(args, workload: Workload, levels: list[int | None]):
    from dayzero.bench.client import base_url, run_remote, served_model

    url = base_url(args.url)
    model = served_model(url, args.api_key)
    runs = []
    for index, level in enumerate(levels):
        warmup = _warmup(args, workload, level, index)
        if warmup:
            run_remote(url, model, warmup, level, args.ignore_eos, args.api_key)
        with _bar(args, workload.num_prompts, f"{url}, concurrency {level or 'all'}") as bar:
            runs.append(run_remote(url, model, workload.requests(index), level, args.ignore_eos, args.api_key,
                                   progress=bar).summary())
    return f"{url} ({model}, /v1/completions)", {"url": url, "model": model}, runs, None


def _write(args, output: Path, backend: str, info: dict, workload: Workload, runs: list[dict],
           baseline: list[dict] | None) -> None:
    plot = output.with_suffix(".png")
    flags = {k: v for k, v in vars(args).items() if k not in ("func", "model_option")}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "backend": backend, **info,
              "ignore_eos": args.ignore_eos, "workload": workload.to_dict(), "args": flags, "runs": runs,
              "plot": plot.name}
    if baseline:
        result["transformers"] = [dict(b, ratio=r["output_throughput"] / b["output_throughput"])
                                  for r, b in zip(runs, baseline)]
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    write_plot(plot, runs, baseline, title=backend)
    print(f"[dayzero] wrote {output} and {plot}", file=sys.stderr)
