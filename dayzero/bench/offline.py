"""The offline runner: the engine driven step by step, at most `max_concurrency` requests in it at
once (a new one admitted as soon as one finishes, as a client with that many connections would),
every token's arrival timed with time.perf_counter.

A request starts when it is added to the engine. `Engine.step()` returns once the step's sampled
tokens are on the host (the sampler copies them back), so the time read after it is when those
tokens exist for a caller; on CUDA the device is synchronized once before the clock starts, so no
earlier work is counted.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from dayzero.bench.metrics import PeakMemory, RequestRecord, RunResult
from dayzero.bench.workload import BenchRequest
from dayzero.engine.engine import Engine
from dayzero.engine.sampling import SamplingParams
from dayzero.structured import StructuredOutputs


def bench_params(request: BenchRequest, ignore_eos: bool) -> SamplingParams:
    """Greedy, exactly output_len tokens with ignore_eos (else at most); constrained to the request's JSON
    schema if it has one."""
    structured = None if request.json_schema is None else StructuredOutputs(json=request.json_schema,
                                                                             source="--json-schema")
    return SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=ignore_eos,
                          structured_outputs=structured)


def run_offline(engine: Engine, requests: list[BenchRequest], max_concurrency: int | None, ignore_eos: bool = True,
                progress=None, prefix: str = "bench") -> RunResult:
    """Run every request through `engine` (which must be idle) and time it. progress: an object with
    update(n) (a tqdm bar), told of every finished request. Every request is validated first, so a
    workload the model cannot hold fails before anything runs."""
    if engine.has_unfinished():
        raise RuntimeError("the engine is busy: a benchmark needs it to itself")
    checked = [engine.validate(r.prompt_token_ids, bench_params(r, ignore_eos), f"prompt {i}")
               for i, r in enumerate(requests)]
    limit = len(requests) if max_concurrency is None else max_concurrency
    records: list[RequestRecord | None] = [None] * len(requests)
    pending = deque(range(len(requests)))
    active: dict[str, int] = {}
    device = engine.model.device_

    def admit() -> None:
        while pending and len(active) < limit:
            i = pending.popleft()
            rid = f"{prefix}-{i}"
            engine.add_request(rid, *checked[i])
            active[rid] = i
            records[i] = RequestRecord(len(checked[i][0]), time.perf_counter())

    PeakMemory.reset(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    admit()
    while active:
        updates = engine.step()
        now = time.perf_counter()
        for update in updates:
            record = records[active[update.request_id]]
            record.token_times.extend([now] * len(update.new_token_ids))
            if update.finished:
                record.end = now
                record.output_len = len(engine.pop_finished(update.request_id).request.output_token_ids)
                if update.finish_reason == "abort":
                    record.error = "aborted"
                del active[update.request_id]
                if progress is not None:
                    progress.update(1)
        if not updates and not engine.has_unfinished():
            raise RuntimeError(f"the engine has no work but {len(active)} benchmark requests never finished")
        admit()
    duration = max(r.end for r in records) - start
    return RunResult(max_concurrency, records, duration, PeakMemory.read(device))
