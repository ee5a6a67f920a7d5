"""Continuous batching: which requests compute how many tokens in the next step.

Plain Python on the CPU; the runner executes a SchedulerOutput and reports the sampled tokens back
through `update`. One step is:

    output = scheduler.schedule()
    sampled = runner.execute(output)          # {request_id: token id, or None for a partial prefill chunk}
    finished = scheduler.update(output, sampled)

With async scheduling the update comes in two halves, so that the next step can be scheduled while
this one's tokens are still on the device: `advance(output)` right after the step is launched (the
requests move on by the tokens computed; each sampled token is counted as pending; a request that
reaches max_tokens leaves the running set), and `resolve(output, sampled)` once the ids arrive (one
step later: the tokens are appended and the stop checks run; a token of a request that ended in the
meantime, by a stop string or an abort, is dropped).

Policy (vLLM V1's, without priorities)
- Token budget: at most max_num_batched_tokens tokens per step, at most max_num_seqs running requests.
- Running requests first, in arrival order: a decode takes 1 token; an unfinished prefill takes what
  is left of it, up to the remaining budget. Then waiting requests, first come first served: a
  request is admitted with its prefix-cache hit, and its prefill is chunked to the remaining budget
  (chunked_prefill) or waits for a step with room for all of it. The queue is never reordered: a
  head that cannot be admitted blocks those behind it.
- Preemption by recompute: when a running request cannot get a block, the most recently arrived
  running request gives back all its blocks, keeps its output tokens and goes to the front of the
  waiting queue, to recompute prompt + output later (its own blocks may still be found in the
  prefix cache then). No request is admitted in a step that preempted.
- Without chunked prefill, a preempted request whose prompt + output exceeds the budget is still
  recomputed in chunks: otherwise it could never run again.
- Out of device memory (the engine's recovery from a step that raised torch.OutOfMemoryError):
  `limit_budget` caps the token budget at half the failed step's tokens, doubling back every
  RELAX_STEPS steps; `unschedule` takes the failed step back (or preempts its requests).
- `align_chunks` B (models with recurrent state and prefix caching): a chunk of several tokens that
  crosses a multiple of B ends there (the rest follows next step), so that the runner can save the
  recurrent state at every block boundary a prompt reaches (the state exists only at a step's end).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from dayzero.cache.kv_manager import KVCacheManager
from dayzero.engine.request import Request, RequestStatus


RELAX_STEPS = 64  # steps at a lowered token budget (limit_budget) before it doubles again


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens to compute this step: positions [num_computed_tokens, + num_new_tokens)
    num_computed_tokens: int  # tokens already in the cache when the step starts
    samples: bool = field(init=False)  # the step reaches the request's last known token: the runner samples for it

    def __post_init__(self):
        self.samples = self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # running first, then new admissions
    preempted: list[str] = field(default_factory=list)  # request ids preempted while scheduling this step
    finished: list[Request] = field(default_factory=list)  # ended while scheduling (the pool is full for them)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request.request_id: s.num_new_tokens for s in self.scheduled}

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, eos_token_ids: int | list[int] | set[int] | None = None,
                 align_chunks: int | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must both be >= 1")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.align_chunks = align_chunks
        if eos_token_ids is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_ids, int):
            self.eos_token_ids = frozenset([eos_token_ids])
        else:
            self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()  # WAITING and PREEMPTED, FCFS (preempted in front)
        self.running: list[Request] = []  # RUNNING, sorted by arrival
        self._next_arrival = 0
        # counters (units: tokens, except num_preemptions)
        self.budget_cap: int | None = None  # a lower token budget after an out-of-memory step (limit_budget)
        self._steps_at_cap = 0
        self.num_prefix_cached_tokens = 0  # tokens found in the prefix cache at admission
        self.num_computed_tokens_total = 0  # tokens the model computed
        self.num_preemptions = 0

    # -- queue ------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add(self, req: Request) -> None:
        """Queue a request. Raises ValueError for a request that could not run even alone."""
        rid = req.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already queued or running; request ids must be unique")
        if not req.prompt_token_ids:
            raise ValueError(f"request {rid!r} has an empty prompt; at least one token is needed")
        if req.status is not RequestStatus.WAITING or req.num_computed_tokens or req.output_token_ids:
            raise ValueError(f"request {rid!r} must be new (WAITING, nothing computed or generated)")
        # KV entries it needs at most: every token but the last generated one.
        max_tokens = req.sampling_params.max_tokens or 1
        need = self.kv.max_blocks_for(req.num_prompt_tokens + max_tokens - 1)
        pool = self.kv.pool.num_blocks
        if need > pool:
            raise ValueError(
                f"request {rid!r} needs {need} KV blocks of {self.kv.block_size} tokens "
                f"({req.num_prompt_tokens} prompt + {req.sampling_params.max_tokens} max_tokens) but the pool "
                f"has {pool}; shorten the prompt, lower max_tokens, or give the KV cache more memory "
                f"(--kv-cache-gib / --mem-fraction)")
        if not self.chunked_prefill and req.num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"request {rid!r} has {req.num_prompt_tokens} prompt tokens, more than max_num_batched_tokens="
                f"{self.max_num_batched_tokens}, and chunked prefill is off; enable chunked prefill or raise "
                f"max_num_batched_tokens")
        req.arrival = self._next_arrival
        self._next_arrival += 1
        self.requests[rid] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request, waiting or running; its blocks go back to the pool at once. Returns it,
        or None if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """End a request and free its blocks. The hook for checks the scheduler cannot make itself:
        the detokenizer calls it with FINISHED_STOPPED and the stop string when one matches."""
        if not status.is_finished:
            raise ValueError(f"finish needs a FINISHED_* status, got {status}")
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.is_finished:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        req.stop_reason = stop_reason
        self.requests.pop(req.request_id, None)

    # -- one step ---------------------------------------------------------------------------------
    @property
    def token_budget(self) -> int:
        """This step's token budget: max_num_batched_tokens, or the cap limit_budget set."""
        return self.max_num_batched_tokens if self.budget_cap is None else min(self.budget_cap, self.max_num_batched_tokens)

    def limit_budget(self, tokens: int) -> None:
        """Schedule at most `tokens` tokens per step (a step of more ran out of device memory); the cap
        doubles after every RELAX_STEPS steps until it reaches max_num_batched_tokens again."""
        self.budget_cap, self._steps_at_cap = max(1, tokens), 0

    def unschedule(self, output: SchedulerOutput, preempt: bool) -> list[Request]:
        """Take back a step that was scheduled but failed before its tokens were recorded (update /
        advance not called), so that its requests run again. Their blocks and progress stay as they
        were before the step (a step's new entries land past num_computed_tokens and are written
        again); with `preempt` (the step may have advanced recurrent states in place) every one of them
        is preempted instead, to recompute from its prefix. Returns the requests preempted."""
        if not preempt:
            return []
        reqs = sorted((s.request for s in output.scheduled if s.request.status is RequestStatus.RUNNING),
                      key=lambda r: r.arrival, reverse=True)
        for req in reqs:  # the latest first, so that the earliest ends at the queue's front
            self._preempt(req)
        return reqs

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        if self.budget_cap is not None:
            self._steps_at_cap += 1
            if self._steps_at_cap >= RELAX_STEPS:
                self.budget_cap, self._steps_at_cap = self.budget_cap * 2, 0
                if self.budget_cap >= self.max_num_batched_tokens:
                    self.budget_cap = None

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk(req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget))
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running[-1]  # the most recently arrived; not scheduled yet (index >= i)
                if victim is req and i == 0:
                    # Alone and still out of blocks: the pool is its context limit (max_tokens=None).
                    self.finish(req, RequestStatus.FINISHED_LENGTH)
                    out.finished.append(req)
                    break
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens))
                budget -= num_new
                i += 1

        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            num_cached = self.kv.match_prefix(req)
            remaining = req.num_tokens - num_cached
            may_chunk = self.chunked_prefill or req.status is RequestStatus.PREEMPTED
            if remaining > budget and not may_chunk:
                self.kv.free(req)
                break
            num_new = self._chunk(num_cached, min(remaining, budget))
            req.num_computed_tokens = num_cached
            if not self.kv.allocate_slots(req, num_new):
                self.kv.free(req)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.status is RequestStatus.WAITING:  # first admission (a preempted one recomputes its own)
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.num_prefix_cached_tokens += num_cached
            bisect.insort(self.running, req, key=lambda r: r.arrival)
            out.scheduled.append(ScheduledRequest(req, num_new, num_cached))
            budget -= num_new
        return out

    def _chunk(self, start: int, num_new: int) -> int:
        """num_new, or with align_chunks B the tokens up to the last multiple of B it crosses."""
        b = self.align_chunks
        if b is None or num_new <= 1:
            return num_new
        boundary = (start + num_new) // b * b
        return boundary - start if start < boundary < start + num_new else num_new

    def update(self, output: SchedulerOutput, sampled_token_ids: dict[str, int | None]) -> list[Request]:
        """Record a finished step: advance each request by the tokens computed, append the token
        sampled for each request whose step reached its last token, and end the requests that
        stopped (their blocks go back to the pool). Returns the requests finished by this step."""
        finished = []
        for s in output.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:  # aborted after schedule()
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.num_computed_tokens_total += s.num_new_tokens
            self.kv.cache_full_blocks(req)
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: nothing sampled
            token = sampled_token_ids.get(req.request_id)
            if token is None:
                raise RuntimeError(f"request {req.request_id!r} reached its last token this step but no "
                                   f"sampled token id was reported for it")
            req.output_token_ids.append(token)
            status, reason = self._check_stop(req, token)
            if status is not None:
                self.finish(req, status, reason)
                finished.append(req)
        return finished

    def advance(self, output: SchedulerOutput) -> list[Request]:
        """The first half of update for async scheduling: the step is launched, its tokens are not known.
        Returns the requests that reached max_tokens (ended here; their last token is in flight)."""
        ended = []
        for s in output.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.num_computed_tokens_total += s.num_new_tokens
            self._cache_known_blocks(req)
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: nothing sampled
            req.num_pending += 1
            max_tokens = req.sampling_params.max_tokens
            if max_tokens is not None and req.num_output_tokens >= max_tokens:
                # its last token is in flight: nothing more to compute; resolve decides stop or length
                self.finish(req, RequestStatus.FINISHED_LENGTH)
                ended.append(req)
        return ended

    def resolve(self, output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> tuple[dict[str, int], list[Request]]:
        """The second half: the ids of the step `advance` recorded. Returns ({request id: token} of the
        tokens appended, the requests finished by them). A token of a request stopped or aborted since
        is dropped; a request that ended at max_tokens or out of pool blocks keeps its last token
        (and an EOS or stop id among them makes it "stop")."""
        appended: dict[str, int] = {}
        finished: list[Request] = []
        for s in output.scheduled:
            req = s.request
            if not s.samples or req.request_id not in sampled_token_ids:
                continue
            if req.num_pending < 1:
                raise RuntimeError(f"request {req.request_id!r}: a token resolved that advance() did not count")
            req.num_pending -= 1
            if req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
                continue  # ended after this step was launched: its token is not part of the output
            token = sampled_token_ids[req.request_id]
            req.output_token_ids.append(token)
            appended[req.request_id] = token
            status, reason = self._check_stop(req, token)
            if req.status is RequestStatus.FINISHED_LENGTH:  # ended while its tokens were in flight
                if status is RequestStatus.FINISHED_STOPPED:  # an EOS or stop id first: later ones are dropped
                    req.status, req.stop_reason = status, reason
                    finished.append(req)
                elif not req.num_pending:  # its last token
                    finished.append(req)
                continue
            if req.status is RequestStatus.RUNNING:
                self._cache_known_blocks(req)
            if status is not None:
                self.finish(req, status, reason)
                finished.append(req)
        return appended, finished

    def _cache_known_blocks(self, req: Request) -> None:
        """cache_full_blocks where the computed tokens' ids are all on the host (else the window
        reclaim only; the hashes follow when the ids arrive)."""
        if req.num_known_tokens >= req.num_computed_tokens:
            self.kv.cache_full_blocks(req)
        else:
            self.kv.reclaim(req)

    # -- internals --------------------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _check_stop(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        params = req.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if params.max_tokens is not None and len(req.output_token_ids) >= params.max_tokens:  # known ones
            return RequestStatus.FINISHED_LENGTH, None
        return None, None
