"""The offline API: `LLM(model=PATH).generate(prompts, SamplingParams(...))` and `LLM.chat(messages)`.

One engine loop: the scheduler picks each step's work (continuous batching, token budget, chunked
prefill, preemption), the runner computes it, the sampler draws every request's next token in one
batched call, the scheduler records it (max_tokens, EOS, stop ids) and a per-request StopChecker
applies stop strings to the detokenized text. Every request is validated before any is scheduled:
a bad one raises ValueError naming the value and nothing runs.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from dayzero.cache import BlockPool, KVCacheManager
from dayzero.engine.request import Request, RequestStatus
from dayzero.engine.runner import ContiguousRunner
from dayzero.engine.sampling import Sampler, SamplingParams, SamplingState, StopChecker, TokenLogprobs
from dayzero.engine.scheduler import Scheduler

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string matched
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict = field(default_factory=dict)

    # the first completion's fields, for the common n=1 case
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class _Track:
    """The engine's view of one completion: the scheduler's request plus sampling and stop state."""

    request: Request
    state: SamplingState
    stop: StopChecker
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    final_text: str | None = None


class LLM:
    def __init__(self, model: str | Path | None = None, *, device: str = "cpu", dtype: str = "float32",
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 block_size: int = 16, num_kv_blocks: int | None = None, seed: int = 0, progress: bool = False):
        from dayzero.models import load_model

        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if model is None:
            from dayzero.demo import demo_checkpoint

            model = demo_checkpoint()
        self.path = Path(model)
        self.model = load_model(self.path, device=device, dtype=DTYPES[dtype], progress=progress)
        self.tokenizer = _load_tokenizer(self.path)
        self.vocab_size = self.model.spec.vocab_size
        context = self.model.spec.context.max_position_embeddings
        self.max_model_len = min(context, max_model_len or 8192)
        if num_kv_blocks is None:  # room for every sequence at full length
            num_kv_blocks = max_num_seqs * -(-self.max_model_len // block_size)
        kv = KVCacheManager(BlockPool(num_kv_blocks), block_size, enable_prefix_caching=False)
        self.scheduler = Scheduler(kv, max_num_seqs, max_num_batched_tokens, chunked_prefill=True,
                                   eos_token_ids=_eos_token_ids(self.path, self.tokenizer))
        self.runner = ContiguousRunner(self.model)
        self.sampler = Sampler(self.vocab_size, seed=seed, device=device)
        self._ids = itertools.count()
        self._tracks: dict[str, _Track] = {}  # request id -> its engine state, until its output is returned

    # -- public API -------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list (text, or token ids); outputs in the prompts' order."""
        prompts = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else list(prompts)
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        prepared = [self._prepare(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))]
        groups = [self._add(rid, text, ids, sp) for rid, text, ids, sp in prepared]
        for _ in self._steps():
            pass
        return [self._output(rid, text, ids, tracks) for (rid, text, ids, _), tracks in zip(prepared, groups)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (or a list) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        tokenizer = self._need_tokenizer("chat")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{self.path} has no chat template (tokenizer_config.json chat_template)")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as it becomes final (a possible stop-string prefix
        is held back until it resolves)."""
        rid, text, ids, sp = self._prepare(prompt, sampling_params or SamplingParams(), 0)
        (track, *_) = self._add(rid, text, ids, sp)
        sent = 0
        try:
            for _ in self._steps():
                current = track.final_text if track.final_text is not None else track.text[: track.stop.streamable_length(track.text)]
                if len(current) > sent:
                    yield current[sent:]
                    sent = len(current)
        finally:  # also when the consumer stops early: abort the request and free its blocks
            rid = track.request.request_id
            if not track.request.is_finished:
                self.scheduler.abort(rid)
                self.runner.free(rid)
            self._tracks.pop(rid, None)

    # -- internals --------------------------------------------------------------------------------
    def _prepare(self, prompt, params: SamplingParams, index: int) -> tuple[str, str | None, list[int], SamplingParams]:
        """Validate one request completely before anything is scheduled."""
        where = f"prompt {index}"
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{where}: sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        if isinstance(prompt, str):
            text = prompt
            ids = list(self._need_tokenizer("text prompts").encode(prompt))
        else:
            text, ids = None, list(prompt)
            bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{where}: token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise ValueError(f"{where} is empty; at least one token is needed")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"{where}: {len(ids)} prompt tokens + max_tokens {max_tokens} exceed the model's context "
                             f"of {self.max_model_len} tokens (max_model_len)")
        if params.max_tokens is None:
            params = _replace(params, max_tokens=max_tokens)
        return f"req-{next(self._ids)}", text, ids, params

    def _add(self, rid: str, text: str | None, ids: list[int], params: SamplingParams) -> list[_Track]:
        tracks = []
        for i in range(params.n):
            req = Request(f"{rid}-{i}" if params.n > 1 else rid, list(ids), params)
            state = self.sampler.new_state(params, req.prompt_token_ids, sample_index=i,
                                           output_token_ids=req.output_token_ids)
            self.scheduler.add(req)
            track = _Track(req, state, StopChecker(params, self.scheduler.eos_token_ids))
            self._tracks[req.request_id] = track
            tracks.append(track)
        return tracks

    def _steps(self) -> Iterator[None]:
        """Run engine steps until every queued request has finished; yields after each step."""
        while self.scheduler.has_unfinished():
            out = self.scheduler.schedule()
            for req in out.finished:  # ended while scheduling: the KV pool is full for them
                track = self._tracks[req.request_id]
                track.final_text = track.text
                self._close(track)
            logits = self.runner.execute(out)
            sampled: dict[str, int] = {}
            if logits:
                rids = list(logits)
                tracks = [self._tracks[r] for r in rids]
                result = self.sampler(torch.stack([logits[r] for r in rids]), [t.state for t in tracks])
                for rid, track, token, lp in zip(rids, tracks, result.token_ids.tolist(), result.logprobs):
                    sampled[rid] = token
                    if lp is not None:
                        track.logprobs.append(lp)
            finished = {r.request_id for r in self.scheduler.update(out, sampled)}
            for rid in sampled:
                self._after_token(self._tracks[rid], sampled[rid], rid in finished)
            yield

    def _after_token(self, track: _Track, token: int, finished_by_scheduler: bool) -> None:
        req = track.request
        track.text = self._decode(req.output_token_ids, req.sampling_params)
        decision = track.stop.check(track.text, token, len(req.output_token_ids))
        if decision.finish_reason is not None:
            track.final_text = decision.text
            if not finished_by_scheduler:  # a stop string: the scheduler cannot see text
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, decision.stop_reason)
        if req.is_finished:
            if track.final_text is None:
                track.final_text = track.text
            self._close(track)

    def _close(self, track: _Track) -> None:
        self.runner.free(track.request.request_id)

    def _output(self, rid: str, text: str | None, ids: list[int], tracks: list[_Track]) -> RequestOutput:
        outputs = []
        for i, t in enumerate(tracks):
            self._tracks.pop(t.request.request_id, None)
            outputs.append(CompletionOutput(
                i, t.final_text if t.final_text is not None else t.text, list(t.request.output_token_ids),
                t.request.finish_reason, t.request.stop_reason,
                t.logprobs if t.request.sampling_params.logprobs is not None else None))
        return RequestOutput(rid, text, ids, outputs)

    def _decode(self, token_ids: list[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"{self.path} has no tokenizer; {what} need one (pass token ids instead)")
        return self.tokenizer


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    from dataclasses import replace

    return replace(params, **changes)


def _load_tokenizer(path: Path):
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _eos_token_ids(path: Path, tokenizer) -> set[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return set(eos) if isinstance(eos, list) else {int(eos)}
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return {tokenizer.eos_token_id}
    return set()
