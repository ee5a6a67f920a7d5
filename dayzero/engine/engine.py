"""The engine core: requests in, one step at a time, per-request updates out.

`Engine.validate` checks a request completely (prompt, token ids, sampling values, context and
pool limits) before it is queued, so a bad request raises InvalidRequestError (a ValueError)
naming the value and the field, and nothing else changes. `Engine.step()` runs one scheduler step (continuous batching, token budget,
chunked prefill, preemption), the runner's forward, one batched sampler call, the scheduler's
update (max_tokens, EOS, stop ids), incremental detokenization (only the new tokens,
dayzero/engine/detokenizer.py) and the stop-string check on the new text, and returns
a `RequestUpdate` for every request that got a token or finished. `Engine.abort` frees a
request's blocks at once. The offline `LLM` and the server drive this same object.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch

from dayzero import settings
from dayzero.cache import BlockPool, KVCacheManager
from dayzero.engine.detokenizer import IncrementalDetokenizer
from dayzero.engine.encoder import ImageEncoder
from dayzero.engine.errors import InvalidRequestError
from dayzero.engine.request import Request, RequestStatus
from dayzero.cache.layout import DEFAULT_BLOCK_SIZE
from dayzero.cache.paged import PagedKVStorage, checked_layout
from dayzero.cache.snapshots import SnapshotCache
from dayzero import settings
from dayzero.engine.faults import FaultInjector
from dayzero.engine.graphs import DecodeGraphs, GraphCaptureError
from dayzero.engine.runner import PagedRunner
from dayzero.engine.sampling import Sampler, SamplingParams, SamplingState, StopChecker, TokenLogprobs
from dayzero.engine.scheduler import Scheduler, SchedulerOutput
from dayzero.engine.tp_workers import PoolConfig, RankFailure
from dayzero.model_path import read_json
from dayzero.models import CausalLM
from dayzero.multimodal.feature_cache import FeatureCache
from dayzero.multimodal.images import ImageError
from dayzero.multimodal.placeholders import ImagePlacement, place_images
from dayzero.parallel import comm, current, dispatch
from dayzero.startup import StartupTimer
from dayzero.structured.grammar import GrammarCompiler, GrammarError


log = logging.getLogger("dayzero")

ONE_TOKEN_OOM_RETRIES = 2  # a step of one token out of memory is retried this many times in a row, then fails
UNHEALTHY_AFTER_FAILED_STEPS = 8  # so many failed steps in a row (a broken device): the server's /health says 503


@dataclass
class RequestUpdate:
    """What one step did for one request: the tokens appended (0 or 1), the text that became final
    since the last update, and the finish reason once it ends."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: TokenLogprobs | None = None
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (OpenAI usage cached_tokens)
    error: str | None = None  # finish_reason "error": what made its step fail ("RuntimeError: ...")


class _InFlight:
    """A launched step whose sampled ids are on their way to the host (async scheduling)."""

    def __init__(self, output, rids: list[str], token_ids: torch.Tensor, logprobs: list):
        self.output, self.rids, self.token_ids, self.logprobs = output, rids, token_ids, logprobs
        self.grammars_advanced = False  # its tokens were accepted by their requests' grammars
        cuda = token_ids.is_cuda
        self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=cuda)
        self._host.copy_(token_ids, non_blocking=cuda)
        self._done = None
        if cuda:
            self._done = torch.cuda.Event()
            self._done.record()

    def host_ids(self) -> list[int]:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()


@dataclass
class _Track:
    """The engine's view of one request: the scheduler's request plus sampling, detokenizer and stop
    state. Text flows detokenizer -> stop checker -> `unsent` (released, not yet handed out as a
    text_delta: at most a possible stop-string prefix and the step's new text)."""

    request: Request
    state: SamplingState
    stop: StopChecker
    detokenizer: IncrementalDetokenizer | None  # None: no tokenizer, the text stays empty
    unsent: str = ""
    sent: int = 0  # characters already handed out as text_delta
    final_length: int | None = None  # characters of the output to return, once finished (stop string removed)
    final_text: str | None = None  # the returned text once finished
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str | None = None  # why its step failed (finish_reason "error")


@dataclass(frozen=True)
class StepFailure:
    """A step's exception, kept without its traceback (which would hold the step's tensors)."""

    out_of_memory: bool
    cause: str  # "RuntimeError: message"

    @classmethod
    def of(cls, exc: BaseException) -> "StepFailure":
        text = str(exc)
        oom = isinstance(exc, torch.OutOfMemoryError) or any(s in text for s in _OOM_MESSAGES)
        return cls(oom, f"{type(exc).__name__}: {text}")


# allocation failures that libraries report as a RuntimeError of their own (cuBLAS' workspace, a raw cudaMalloc)
_OOM_MESSAGES = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDA out of memory", "CUDA error: out of memory")


class Engine:
    def __init__(self, model: CausalLM, tokenizer=None, *, eos_token_ids: set[int] = frozenset(),
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, num_kv_blocks: int | None = None, kv_cache_bytes: float | None = None,
                 enable_prefix_caching: bool = True, num_state_snapshots: int | None = None,
                 kv_cache_dtype: str = "auto", seed: int = 0, cuda_graphs: bool = True, progress: bool = False,
                 async_scheduling: bool | None = None,
                 startup: StartupTimer | None = None, peers=None, image_processor=None):
        """KV pool: num_kv_blocks blocks of block_size tokens, else as many as kv_cache_bytes holds,
        else room for max_num_seqs requests of max_model_len. The KV lives in the pool's pages
        (PagedRunner) with prefix caching (enable_prefix_caching) and, for models with recurrent
        state, num_state_snapshots saved states (default max_num_seqs) from the same budget.
        kv_cache_dtype: "auto" (the model's dtype) or "fp8_e4m3". cuda_graphs: on CUDA, decode steps replay
        graphs captured per batch-size bucket (dayzero.engine.graphs) where the model allows it (else
        the log says why); progress: a bar while capturing. startup: the timer the engine's phases are
        recorded in (cache_layout, kv_pool, capture; self.startup, a fresh one when not given). peers: the
        other tensor-parallel ranks (dayzero.engine.tp_workers.Workers): they size their pools as this one,
        capture the same decode graphs and run every step as this one does.
        image_processor: for a model that reads images (`encode_images`), what turns a request's images into
        its inputs (dayzero.multimodal.processor.ImageProcessor); the encoder's outputs are kept in a
        FeatureCache of DAYZERO_ENCODER_CACHE_TOKENS rows (`self.feature_cache`)."""
        self.startup = startup if startup is not None else StartupTimer()
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = model.spec.vocab_size
        self.max_model_len = min(model.spec.context.max_position_embeddings, max_model_len or 8192)
        blocks_per_seq = -(-self.max_model_len // block_size)
        with self.startup.phase("cache_layout", detail="planned streams checked by a probe forward"):
            layout = checked_layout(model, kv_cache_dtype)
        stateful = bool(layout.states)
        if num_state_snapshots is None:
            num_state_snapshots = max_num_seqs if stateful and enable_prefix_caching else 0
        page_bytes = layout.page_bytes(block_size)
        # a window group's pool: its last window - 1 tokens per running request plus a step's new tokens
        blocks = [None if w is None else window_pool_blocks(w, block_size, max_num_seqs, max_num_batched_tokens)
                  for w in layout.windows]
        if num_kv_blocks is None and kv_cache_bytes is not None:
            fixed = sum(n * p for n, p in zip(blocks, page_bytes) if n is not None)
            fixed += sum(page_bytes) + layout.state_bytes  # the storage's scratch page per group and scratch slot
            num_kv_blocks = _blocks_in_budget(kv_cache_bytes - fixed, page_bytes[0], block_size,
                                              layout.state_bytes, max_num_seqs + num_state_snapshots)
        if num_kv_blocks is None:
            num_kv_blocks = max_num_seqs * blocks_per_seq
        blocks = [num_kv_blocks if n is None else n for n in blocks]
        if layout.windows[0] is not None:  # no full-attention group: the first window pool bounds nothing
            blocks[0] = max(blocks[0], num_kv_blocks)
        snapshots = SnapshotCache(num_state_snapshots) if stateful and enable_prefix_caching else None
        kv = KVCacheManager([BlockPool(n) for n in blocks], block_size, enable_prefix_caching, layout.windows, snapshots)
        with self.startup.phase("kv_pool") as phase:
            storage = PagedKVStorage(layout, blocks, block_size, max_num_seqs, num_state_snapshots, model.device_,
                                     scratch=True)
            phase.bytes = storage.nbytes
            phase.detail = f"{' + '.join(map(str, blocks))} blocks of {block_size} tokens"
        self.runner = PagedRunner(model, kv, storage, snapshots)
        self.image_processor = image_processor if hasattr(model, "encode_images") else None
        self.feature_cache = None
        if self.image_processor is not None:
            self.feature_cache = FeatureCache(settings.get().encoder_cache_tokens)
            self.runner.encoder = ImageEncoder(model, self.feature_cache)
        graph_mode, blocker = None, None  # "capture", "static" (the padded step, eagerly) or None
        if cuda_graphs and model.device_.type == "cuda":
            blocker = model.cuda_graph_blocker(self.max_model_len) or dispatch.cuda_graph_blocker(current())
            graph_mode = "capture" if blocker is None else None
        if graph_mode is None and settings.get().static_decode:
            graph_mode = "static"
        if peers is not None:  # every rank sizes its pool as this one and captures the same graphs
            peers.configure(PoolConfig(blocks, block_size, max_num_seqs, num_state_snapshots, self.max_model_len,
                                       graph_mode))
            self.runner.peers = peers
        if graph_mode == "static":
            self.runner.graphs = DecodeGraphs(model, storage, block_size, max_num_seqs, self.max_model_len, capture=False)
        elif graph_mode == "capture":
            with self.startup.phase("capture") as phase:
                try:
                    graphs = DecodeGraphs(model, storage, block_size, max_num_seqs, self.max_model_len,
                                          progress=progress, agree=comm.first_error)
                    phase.detail = f"{len(graphs.graphs)} decode graphs, batch {','.join(map(str, graphs.buckets))}"
                    self.runner.graphs = graphs
                except GraphCaptureError as e:
                    blocker = str(e)
                    phase.detail = "failed: decode runs eagerly"
                    torch.cuda.synchronize(model.device_)
        if blocker is not None:
            log.info("%s: decode steps run eagerly, without CUDA graphs: %s", model.spec.model_type, blocker)
        self.scheduler = Scheduler(kv, max_num_seqs, max_num_batched_tokens, chunked_prefill=True,
                                   eos_token_ids=eos_token_ids, align_chunks=block_size if snapshots is not None else None)
        self.sampler = Sampler(self.vocab_size, seed=seed, device=model.device_)
        # structured outputs (dayzero.structured): grammars over this tokenizer, masks of the model's vocabulary
        self.grammars = None if tokenizer is None else GrammarCompiler(tokenizer, self.vocab_size, eos_token_ids)
        if async_scheduling is None:  # on where the host's work overlaps the device's
            async_scheduling = model.device_.type == "cuda"
        self.async_scheduling = async_scheduling and snapshots is None
        if async_scheduling and snapshots is not None:
            log.info("%s: async scheduling is off: recurrent-state snapshots (prefix caching) key on the sampled ids",
                     model.spec.model_type)
        self._inflight: _InFlight | None = None
        self.num_overlapped_steps = 0  # steps launched before the previous step's ids were on the host
        self.num_grammar_waits = 0  # of those, steps whose sampling waited for them (a constrained row's mask)
        self.num_failed_steps = 0  # steps that raised (their requests failed, or were retried after OOM)
        self.num_oom_retries = 0  # out-of-memory steps retried within a smaller token budget
        self._one_token_ooms = 0  # steps of one token out of memory in a row
        self.failed_steps_in_a_row = 0  # /health answers 503 from UNHEALTHY_AFTER_FAILED_STEPS on
        self.last_failure: str | None = None  # the cause of the latest failed step
        if settings.get().inject_faults:
            self.runner.faults = FaultInjector(settings.get().inject_faults)
        self.tracks: dict[str, _Track] = {}

    # -- requests ---------------------------------------------------------------------------------
    def validate(self, prompt: str | Sequence[int], params: SamplingParams, where: str = "prompt"
                 ) -> tuple[list[int], SamplingParams]:
        """(prompt token ids, params with max_tokens resolved) or InvalidRequestError (a ValueError)
        naming what is wrong; its `param` is the field ("prompt", "max_tokens", ...)."""
        field_name = where.split(" ")[0]
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"{where}: sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        if params.structured_outputs is not None:
            spec = params.structured_outputs
            if self.grammars is None:
                raise InvalidRequestError(f"{spec.source}: constrained decoding needs the checkpoint's tokenizer, and "
                                          "this checkpoint has none", spec.source)
            try:
                self.grammars.compile(spec)
            except GrammarError as exc:
                raise InvalidRequestError(str(exc), exc.param) from None
        ids = self._token_ids(prompt, where)
        if not ids:
            raise InvalidRequestError(f"{where} is empty; at least one token is needed", field_name)
        n, context = len(ids), self.max_model_len
        if n >= context:
            raise InvalidRequestError(f"{where} is too long: {n} tokens, and the model's context of {context} tokens "
                                      "(max_model_len) must also hold at least one generated token; shorten it to at "
                                      f"most {context - 1} tokens", field_name, "context_length_exceeded")
        max_tokens = params.max_tokens if params.max_tokens is not None else context - n
        if n + max_tokens > context:
            raise InvalidRequestError(f"{where}: max_tokens {max_tokens} is too many: {n} prompt tokens leave room for "
                                      f"{context - n} in the model's context of {context} tokens (max_model_len)",
                                      "max_tokens", "context_length_exceeded")
        kv = self.scheduler.kv
        need = kv.max_blocks_for(n + max_tokens - 1)
        if need > kv.pool.num_blocks:
            raise InvalidRequestError(f"{where}: {n} prompt tokens + max_tokens {max_tokens} need {need} KV blocks, "
                                      f"the pool has {kv.pool.num_blocks}; lower max_tokens or give the KV cache more "
                                      "memory", "max_tokens", "context_length_exceeded")
        return ids, replace(params, max_tokens=max_tokens)

    def _token_ids(self, prompt: str | Sequence[int], where: str) -> list[int]:
        field_name = where.split(" ")[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"{where}: this checkpoint has no tokenizer; pass token ids instead of text",
                                          field_name)
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"{where}: token id {bad!r} is outside the vocabulary [0, {self.vocab_size})",
                                      field_name)
        return ids

    @property
    def image_placeholder(self) -> str | None:
        """The text a prompt marks an image with (Kimi K2.5: <|media_begin|>image<|media_content|><|media_pad|>
        <|media_end|>), None for a model that reads no images."""
        return getattr(self.model, "image_placeholder", None) if self.image_processor is not None else None

    def prepare_images(self, prompt: str | Sequence[int], images: Sequence, where: str = "prompt",
                       param: str = "images") -> tuple[list[int], tuple[ImagePlacement, ...]]:
        """(the prompt's token ids with each image's placeholder expanded, the images' placements) for
        `validate` and `add_request`; InvalidRequestError (param `param`) for an image that cannot be
        decoded or is over the size limit, a model without a vision tower, or images that do not match
        the prompt's placeholders (dayzero.multimodal.placeholders). Nothing is queued or encoded here."""
        if self.image_processor is None:
            raise InvalidRequestError(f"{param}: {self.model.spec.model_type} reads no images (it has no vision tower "
                                      "or was loaded without an image processor); send text only", param)
        ids = self._token_ids(prompt, where)
        try:
            inputs = [self.image_processor(source, f"{param}[{i}]") for i, source in enumerate(images)]
            return place_images(ids, inputs, self.model.image_token_id, where)
        except ImageError as exc:
            raise InvalidRequestError(str(exc), param) from None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    sample_index: int = 0, images: tuple[ImagePlacement, ...] = ()) -> None:
        """Queue a request whose prompt and params `validate` returned (and images, `prepare_images`)."""
        req = Request(request_id, list(prompt_token_ids), params, images=tuple(images))
        state = self.sampler.new_state(params, req.prompt_token_ids, sample_index=sample_index,
                                       output_token_ids=req.output_token_ids)
        if params.structured_outputs is not None:
            state.grammar = self.grammars.new(params.structured_outputs)
        self.scheduler.add(req)
        detokenizer = (None if self.tokenizer is None else
                       IncrementalDetokenizer(self.tokenizer, req.output_token_ids, params.skip_special_tokens))
        self.tracks[request_id] = _Track(req, state, StopChecker(params, self.scheduler.eos_token_ids), detokenizer)

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks at once; False if it is unknown or already done."""
        track = self.tracks.pop(request_id, None)
        if track is None:
            return False
        self.runner.free(request_id)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestUpdate]:
        """One engine step; the updates of the tokens that reached the host (with async scheduling,
        those of the step before this one)."""
        if self.async_scheduling:
            return self._step_async()
        out = self.scheduler.schedule()
        updates: list[RequestUpdate] = []
        for req in out.finished:  # ended while scheduling: the KV pool is full for them
            updates.append(self._finish_update(self.tracks[req.request_id], []))
        step, failure = self._forward(out, None, self._collect_sync)
        if failure is not None:
            return updates + self._recover(out, failure)
        sampled, step_logprobs = step or ({}, {})  # {request id: token id}, {request id: TokenLogprobs | None}
        finished = {r.request_id for r in self.scheduler.update(out, sampled)}
        return updates + self._apply(sampled, step_logprobs, finished)

    def _step_async(self) -> list[RequestUpdate]:
        """Schedule and launch this step before the last step's ids reach the host (a decode's input
        token still on the device is read from there), then take the last step's ids: the host's
        scheduling, metadata and detokenizing overlap the GPU's work. (Penalties count a request's
        tokens on the device as they are sampled: they need no host ids.)

        Structured outputs: a constrained request's mask depends on its previous token, so a step with
        a constrained row waits for the last step's ids after launching its forward and before sampling
        (the grammars accept them, then the masks are filled on the host while the GPU runs the forward);
        a step without one never waits."""
        updates: list[RequestUpdate] = []
        prev, self._inflight = self._inflight, None
        out = self.scheduler.schedule()
        for req in out.finished:  # ended while scheduling; one with a token in flight ends when it arrives
            if not req.num_pending:
                updates.append(self._finish_update(self.tracks[req.request_id], []))
            else:
                self.runner.free(req.request_id)  # its state slot is free for this step's admissions
        current, failure = self._forward(out, None if prev is None else (prev.rids, prev.token_ids),
                                         lambda rids, states, result: _InFlight(out, rids, result.token_ids,
                                                                                result.logprobs), prev)
        if failure is not None:  # the step launched before this one is still good: take its tokens first
            if prev is not None:
                try:
                    updates += self._resolve(prev)
                except RankFailure:
                    raise
                except Exception as exc:  # it failed too (a device error surfaces at the copy)
                    updates += self._fail([s.request for s in prev.output.scheduled], self._failed(exc))
            return updates + self._recover(out, failure)
        for req in self.scheduler.advance(out):  # at max_tokens: their slots serve the next step's admissions
            self.runner.free(req.request_id)
        if prev is not None:
            updates += self._resolve(prev)
            self.num_overlapped_steps += 1
        self._inflight = current
        return updates

    def _forward(self, out: SchedulerOutput, pending, collect, prev: "_InFlight | None" = None):
        """The runner's forward and the sampler for `out` (pending: async scheduling's ids still on the
        device, those of the launched step `prev`), then collect(request ids, their sampling states, the
        sampler's result) where a step samples: (what collect returned or None, None), or (None, the
        StepFailure) when any of it raised. The exception and its traceback, which hold the step's
        tensors, are gone before the caller recovers. A constrained row's mask needs its last token: with
        async scheduling, only a step holding one waits for `prev`'s ids (num_grammar_waits)."""
        try:
            rids, logits = self.runner.execute(out, pending)
            step = None
            if rids:
                states = [self.tracks[r].state for r in rids]
                if prev is not None and any(s.grammar is not None for s in states):
                    self._advance_grammars(prev)
                    self.num_grammar_waits += 1
                step = collect(rids, states, self.sampler(logits, states))
        except RankFailure:  # the ranks are out of step: the job ends
            raise
        except Exception as exc:
            return None, self._failed(exc)
        self._one_token_ooms = self.failed_steps_in_a_row = 0
        return step, None

    @staticmethod
    def _collect_sync(rids, states, result) -> tuple[dict[str, int], dict[str, TokenLogprobs | None]]:
        """A synchronous step's sampled ids and logprobs by request; constrained requests accept theirs."""
        sampled, step_logprobs = {}, {}
        for rid, state, token, lp in zip(rids, states, result.token_ids.tolist(), result.logprobs):
            sampled[rid], step_logprobs[rid] = token, lp
            if state.grammar is not None:
                state.grammar.accept(token)
        return sampled, step_logprobs

    # -- a failed step ---------------------------------------------------------------------------------
    def _failed(self, exc: BaseException) -> StepFailure:
        """Log a step's exception (with its traceback, for the operator) and keep what the requests get."""
        self.num_failed_steps += 1
        self.failed_steps_in_a_row += 1
        failure = StepFailure.of(exc)
        self.last_failure = failure.cause
        if not failure.out_of_memory:  # (out of memory is retried: _recover says so)
            log.error("an engine step failed: %s", failure.cause, exc_info=True)
        return failure

    def _recover(self, out: SchedulerOutput, failure: StepFailure) -> list[RequestUpdate]:
        """After a step of `out` raised: out of memory, retry its requests within half its tokens
        (preempted where the step may have advanced recurrent states in place; a step of one token is
        retried as it is, ONE_TOKEN_OOM_RETRIES times in a row at most); any other exception, or out of
        memory at one token once more, fails the step's requests (finish_reason "error") and nothing else."""
        if failure.out_of_memory:
            if self.model.device_.type == "cuda":
                torch.cuda.empty_cache()  # what the step allocated is free again (its tensors are gone)
            self._one_token_ooms = self._one_token_ooms + 1 if out.num_batched_tokens <= 1 else 0
            if self._one_token_ooms <= ONE_TOKEN_OOM_RETRIES:
                self.num_oom_retries += 1
                self.scheduler.limit_budget(max(1, out.num_batched_tokens // 2))
                for req in self.scheduler.unschedule(out, preempt=self.runner.stateful):
                    self.runner.free(req.request_id)
                log.warning("out of device memory in a step of %d tokens: retrying its %d request(s) at most %d "
                            "tokens per step (--chunked-prefill-size %d comes back gradually)", out.num_batched_tokens,
                            len(out.scheduled), self.scheduler.token_budget, self.scheduler.max_num_batched_tokens)
                return []
            self._one_token_ooms = 0
            log.error("out of device memory in a step of one token, %d times in a row: its request fails (%s)",
                      ONE_TOKEN_OOM_RETRIES + 1, failure.cause)
        return self._fail([s.request for s in out.scheduled], failure)

    def _fail(self, requests: list[Request], failure: StepFailure) -> list[RequestUpdate]:
        """End the unfinished ones of `requests` with finish_reason "error" naming the failure."""
        updates = []
        for req in requests:
            track = self.tracks.get(req.request_id)
            if track is None or req.is_finished:
                continue
            track.error = f"the engine step running this request failed: {failure.cause}"
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            req.num_pending = 0  # a token still in flight for it is dropped
            updates.append(self._finish_update(track, []))
        return updates

    def _resolve(self, step: "_InFlight") -> list[RequestUpdate]:
        """The ids of a launched step: appended (scheduler.resolve), then text, stop strings, updates."""
        self._advance_grammars(step)
        tokens = step.host_ids()
        appended, finished = self.scheduler.resolve(step.output, dict(zip(step.rids, tokens)))
        appended = {rid: t for rid, t in appended.items() if rid in self.tracks}  # not aborted meanwhile
        logprobs = dict(zip(step.rids, step.logprobs))
        return self._apply(appended, {rid: logprobs[rid] for rid in appended}, {r.request_id for r in finished})

    def _advance_grammars(self, step: "_InFlight") -> None:
        """Each constrained request of a launched step accepts its token (once; before scheduler.resolve,
        which appends the same tokens: those of requests not stopped or aborted since)."""
        if step.grammars_advanced:
            return
        step.grammars_advanced = True
        tracks = [self.tracks.get(rid) for rid in step.rids]
        if not any(t is not None and t.state.grammar is not None for t in tracks):
            return
        for track, token in zip(tracks, step.host_ids()):
            if track is None or track.state.grammar is None:
                continue
            if track.request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED):
                track.state.grammar.accept(token)

    def _apply(self, sampled: dict[str, int], step_logprobs: dict[str, TokenLogprobs | None],
               finished: set[str]) -> list[RequestUpdate]:
        """Updates for the tokens appended to their requests: detokenize, check stop strings, finish."""
        updates: list[RequestUpdate] = []
        for rid, token in sampled.items():
            track = self.tracks[rid]
            if step_logprobs[rid] is not None:
                track.logprobs.append(step_logprobs[rid])
            req = track.request
            done = rid in finished  # (a request can be finished in the scheduler with tokens still in flight)
            piece = self._release(track, flush=done)  # no more tokens come: the tail is final too
            decision = track.stop.check(piece, token, len(req.output_token_ids))
            if decision.finish_reason is not None:
                track.final_length = decision.length
                if not done:  # a stop string: the scheduler cannot see text
                    self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, decision.stop_reason)
                    done = True
            if done:
                updates.append(self._finish_update(track, [token], step_logprobs[rid]))
            else:
                ready = track.stop.streamable_length() - track.sent  # characters that cannot become a stop string
                delta, track.unsent = track.unsent[:ready], track.unsent[ready:]
                track.sent += len(delta)
                updates.append(RequestUpdate(rid, [token], delta, False, logprobs=step_logprobs[rid],
                                             num_cached_tokens=req.num_cached_tokens))
        return updates

    @staticmethod
    def _release(track: _Track, flush: bool) -> str:
        """The text the request's new tokens made final (all of it when flush), also kept as unsent."""
        if track.detokenizer is None:
            return ""
        piece = track.detokenizer.step()
        if flush:
            piece += track.detokenizer.flush()
        track.unsent += piece
        return piece

    def _finish_update(self, track: _Track, tokens: list[int], lp: TokenLogprobs | None = None) -> RequestUpdate:
        req = track.request
        if track.final_length is None:  # finished while scheduling (the pool is full): release the tail
            track.final_length = track.stop.check(self._release(track, flush=True), -1, len(req.output_token_ids)).length
        text = track.detokenizer.text if track.detokenizer is not None else ""
        track.final_text = text[:track.final_length]
        self.runner.free(req.request_id)
        delta = track.final_text[track.sent:]
        track.sent = len(track.final_text)
        return RequestUpdate(req.request_id, tokens, delta, True, req.finish_reason, req.stop_reason, lp,
                             req.num_cached_tokens, track.error)

    def pop_finished(self, request_id: str) -> _Track:
        """Hand over a finished request's track (its text, tokens, logprobs) and forget it."""
        return self.tracks.pop(request_id)


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks a sliding-window group can hold at once: per running request the blocks of its last
    window - 1 tokens and of its new tokens (2 partial blocks at the ends), and a step's new tokens
    (at most max_num_batched_tokens) in all; reclaim returns the rest after every step."""
    return max_num_seqs * (-(-(window - 1) // block_size) + 3) + -(-max_num_batched_tokens // block_size)


def _blocks_in_budget(kv_cache_bytes: float, page_bytes: int, block_size: int, state_bytes: int, state_slots: int) -> int:
    """Blocks of page_bytes that kv_cache_bytes holds after state_slots states of state_bytes."""
    blocks = int((kv_cache_bytes - state_bytes * state_slots) // page_bytes)
    if blocks < 1:
        raise ValueError(
            f"a KV cache budget of {kv_cache_bytes / 2**30:.3f} GiB holds no block of {block_size} tokens "
            f"({page_bytes} B per block, {state_bytes / 2**20:.1f} MiB of recurrent state x {state_slots} slots "
            f"(running requests + snapshots)); raise --mem-fraction / --kv-cache-gib or lower --max-running-requests")
    return blocks


def load_tokenizer(path: Path):
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(path: Path, tokenizer) -> set[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = read_json(f).get("eos_token_id")
            if eos is not None:
                return set(eos) if isinstance(eos, list) else {int(eos)}
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return {tokenizer.eos_token_id}
    return set()
