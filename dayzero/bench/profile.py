"""Where a parallel engine's decode steps spend their time in collectives: `dayzero bench --profile-steps N`.

After a level's timed run, the level's first requests (as many as run together) are added again and
stepped until every one has its first token, so that every later step is a decode step of that batch;
two more steps settle the pipeline (async scheduling), N steps are timed, N more run under torch.profiler
on rank 0, then the requests are aborted. From the profile:

    device collectives   NCCL kernels (CUDA): each kernel's device time, by kind (all_reduce, all_to_all,
                         all_gather, broadcast, ...); kernels replayed inside a CUDA graph are counted too
    host collectives     gloo's collectives, timed on gloo's threads (the CPU's collectives; on CUDA the
                         host group's broadcast of each step's schedule)

per decode step, and `share`: the collectives' time per step over the wall time of a step timed without
the profiler (whose own cost lengthens the profiled steps' host work, not their kernels) (device
collectives on CUDA, host ones on the CPU). Rank 0's view: a collective's time includes waiting for the
slowest rank to arrive."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

# name fragments (lower case, underscores removed) -> kind; the first match wins
_KINDS = (("allreduce", "all_reduce"), ("reducescatter", "reduce_scatter"), ("alltoall", "all_to_all"),
          ("allgather", "all_gather"), ("broadcast", "broadcast"), ("sendrecv", "send_recv"))
SETTLE_STEPS = 2


def tokens_needed(steps: int) -> int:
    """Output tokens a profiled request must be allowed: its first, the settling, timed and profiled steps."""
    return 2 * steps + SETTLE_STEPS + 1


def collective_kind(name: str) -> tuple[str, str] | None:
    """('device' | 'host', kind) for a profiler event's name that is a collective (an NCCL kernel, a gloo
    collective), else None. kind is 'other' for a collective of no kind named here."""
    flat = name.lower().replace("_", "")
    if flat.startswith("gloo:"):
        where = "host"
    elif "nccl" in flat and not flat.startswith(("nccl:", "c10d")):  # nccl:* / c10d::* are host-side launches
        where = "device"
    else:
        return None
    return where, next((kind for key, kind in _KINDS if key in flat), "other")


@dataclass
class CollectiveProfile:
    batch: int
    steps: int
    wall_s: float  # the N steps timed without the profiler
    profiled_wall_s: float
    device_s: dict[str, float] = field(default_factory=dict)
    host_s: dict[str, float] = field(default_factory=dict)
    on_cuda: bool = False

    def add(self, name: str, seconds: float) -> None:
        found = collective_kind(name)
        if found is not None:
            where, kind = found
            into = self.device_s if where == "device" else self.host_s
            into[kind] = into.get(kind, 0.0) + seconds

    def summary(self) -> dict:
        per = 1e3 / self.steps
        counted = self.device_s if self.on_cuda else self.host_s
        return {"batch": self.batch, "steps": self.steps, "step_ms": self.wall_s * per,
                "profiled_step_ms": self.profiled_wall_s * per,
                "device_ms_per_step": {k: v * per for k, v in sorted(self.device_s.items())},
                "host_ms_per_step": {k: v * per for k, v in sorted(self.host_s.items())},
                "share": sum(counted.values()) / self.wall_s if self.wall_s > 0 else 0.0,
                "share_of": "device collectives (NCCL kernels)" if self.on_cuda else "host collectives (gloo)"}


def profile_decode(engine, requests: list[tuple[list[int], object]], steps: int, prefix: str = "profile"
                   ) -> CollectiveProfile:
    """requests: (prompt ids, SamplingParams) already validated, each allowed at least tokens_needed(steps)
    tokens; the engine must be idle, and is idle again on return."""
    from torch.profiler import ProfilerActivity, profile

    if steps < 1:
        raise ValueError(f"--profile-steps must be at least 1, got {steps}")
    need = tokens_needed(steps)
    for i, (_, params) in enumerate(requests):
        if params.max_tokens < need:
            raise ValueError(f"profiled request {i}: max_tokens {params.max_tokens} ends it before the profile does "
                             f"({need} tokens: the first, {SETTLE_STEPS} settling steps, {steps} timed, {steps} profiled)")
    if engine.has_unfinished():
        raise RuntimeError("the engine is busy: a profile needs it to itself")
    device = engine.model.device_
    ids = [f"{prefix}-{i}" for i in range(len(requests))]
    for rid, (prompt, params) in zip(ids, requests):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    try:
        while len(started) < len(ids):  # prefills (and chunks) until every request decodes
            updates = engine.step()
            started.update(u.request_id for u in updates if u.new_token_ids)
            if not updates and not engine.has_unfinished():
                raise RuntimeError("the profiled requests finished before every one had its first token")
        for _ in range(SETTLE_STEPS):
            engine.step()
        on_cuda = device.type == "cuda"

        def run() -> float:
            if on_cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            if on_cuda:
                torch.cuda.synchronize(device)
            return time.perf_counter() - start

        wall = run()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])) as prof:
            profiled = run()
    finally:
        for rid in ids:  # abort also forgets a finished request's track
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    result = CollectiveProfile(len(ids), steps, wall, profiled, on_cuda=on_cuda)
    for event in prof.events():
        result.add(event.name, event.time_range.elapsed_us() / 1e6)
    return result
