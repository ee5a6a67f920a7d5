"""The HTTP server: OpenAI API (/v1/models, /v1/completions, /v1/chat/completions) and SGLang's
native API (/generate, /get_model_info, /get_server_info, /health, /health_generate,
/flush_cache), plus Prometheus /metrics, over one AsyncEngine.

Every request is validated completely (body, types, sampling values, prompt and context limits)
before any of it is queued, so a bad one answers 4xx with `{"error": {...}}` naming the field and
touches nothing else. A client that disconnects (streaming or not) aborts its requests, which frees
their KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from dayzero.engine.engine import UNHEALTHY_AFTER_FAILED_STEPS, RequestUpdate
from dayzero.engine.errors import InvalidRequestError
from dayzero.engine.llm import LLM
from dayzero.engine.sampling import SamplingParams
from dayzero.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, Submission
from dayzero.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, GenerateRequest,
                                     SGLangSamplingParams, parse, unpaired_surrogate)


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_running_requests: int = 16
    max_queued_requests: int = 256
    max_request_bytes: int = 32 << 20  # a larger body is refused with 413 before it is read whole
    extra_info: dict = field(default_factory=dict)  # reported by /get_server_info (the launch flags)


RETRY_AFTER_S = 1  # the Retry-After of a 503 (full queue, shutting down)


# ---------------------------------------------------------------------------------------------------
# One request's sequences and their collected output


@dataclass
class _Seq:
    prompt_index: int
    prompt_ids: list[int]
    pieces: list[str] = field(default_factory=list)  # the text deltas received, joined on demand
    num_chars: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached_tokens: int = 0

    def add(self, update: RequestUpdate) -> None:
        self.cached_tokens = max(self.cached_tokens, update.num_cached_tokens)
        if update.text_delta:
            self.pieces.append(update.text_delta)
            self.num_chars += len(update.text_delta)
        self.token_ids += update.new_token_ids
        if update.logprobs is not None:
            self.logprobs.append(update.logprobs)
        if update.finished:
            self.finish_reason, self.stop_reason = update.finish_reason, update.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _ranks(llm: LLM) -> dict:
    """The job's split and its processes (rank -> pid; ranks this process did not start are absent)."""
    w = llm.workers
    if w is None:
        return {"tp_size": 1, "ep_size": 1, "rank_pids": {"0": os.getpid()}}
    return {"tp_size": w.tp, "ep_size": w.ep, "rank_pids": {"0": os.getpid(), **{str(r): pid for r, pid in w.pids.items()}},
            "rank_failure": w.failure}


def create_app(llm: LLM, config: ServerConfig) -> FastAPI:
    engine = llm.engine
    async_engine = AsyncEngine(engine, config.max_running_requests, config.max_queued_requests)
    tokenizer = llm.tokenizer
    name = config.served_model_name
    started = time.time()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="dayzero", lifespan=lifespan)
    app.state.async_engine = async_engine

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):  # the message only: no traceback in answers
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)

    @app.middleware("http")
    async def _check_api_key(request: Request, call_next):
        if config.api_key is not None and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), config.api_key.encode()):
                err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (--api-key)",
                               code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    # -- helpers ----------------------------------------------------------------------------------
    async def read_json(request: Request):
        limit = config.max_request_bytes
        too_large = APIError(413, f"the request body is larger than this server accepts ({limit} bytes, "
                                  "--max-request-mib)", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():  # counted as it arrives: a body without a length is bounded too
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except RecursionError:
            raise APIError(400, "the request body is not valid JSON: nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        if isinstance(body, dict) and (where := unpaired_surrogate(body)) is not None:
            raise APIError(400, f"{where}: the text holds an unpaired UTF-16 surrogate (a \\ud800-\\udfff escape "
                                "that is not half of a pair), which is not text; send valid Unicode", where)
        return body

    def validate(prompt, params: SamplingParams, where: str) -> tuple[list[int], SamplingParams]:
        if isinstance(prompt, str) and not prompt.strip():
            raise APIError(400, f"{where} is empty; give some text", where.split(" ")[0])
        try:
            return engine.validate(prompt, params, where)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), exc.param or where.split(" ")[0], code=exc.code) from None

    def submissions(prompts: list[tuple[list[int], SamplingParams]], prefix: str, field_name: str,
                    rids: list[str] | None = None) -> tuple[list[Submission], list[_Seq]]:
        total = sum(sp.n for _, sp in prompts)
        if total > async_engine.max_in_flight:  # could never be admitted: not a 503 to retry
            raise APIError(400, f"the request asks for {total} sequences ({len(prompts)} prompt(s) x n); this server "
                                f"holds at most {async_engine.max_in_flight} at once (--max-running-requests + "
                                "--max-queued-requests)", "n" if any(sp.n > 1 for _, sp in prompts) else field_name)
        subs, seqs = [], []
        for p, (ids, sp) in enumerate(prompts):
            base = rids[p] if rids else f"{prefix}-{p}"
            for i in range(sp.n):
                subs.append(Submission(f"{base}-{i}" if sp.n > 1 else base, ids, sp, i))
                seqs.append(_Seq(p, ids))
        return subs, seqs

    async def run(subs: list[Submission]) -> AsyncIterator[tuple[int, RequestUpdate]]:
        """The group's updates; a sequence whose engine step failed ends the request with a 500 naming why
        (its other sequences are aborted)."""
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        try:
            async for item in async_engine.generate(subs):
                if item[1].finish_reason == "error":
                    raise APIError(500, item[1].error or "the engine step running this request failed",
                                   code="internal_error")
                yield item
        except QueueFullError as exc:
            raise APIError(503, str(exc), code="queue_full", headers=retry) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable", headers=retry) from None
        except ValueError as exc:
            raise APIError(400, str(exc), "rid") from None

    async def collect(request: Request, subs: list[Submission], seqs: list[_Seq]) -> None:
        """Run to the end, or abort everything when the client disconnects first."""
        async def consume():
            async for index, update in run(subs):
                seqs[index].add(update)

        task = asyncio.ensure_future(consume())
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():  # the client is gone (or this handler is cancelled): abort its requests
                task.cancel()  # the generator's finally aborts them
                await asyncio.gather(task, return_exceptions=True)  # (cancel() only asks: wait until it is done)
        if not task.cancelled():
            task.result()  # re-raise an APIError (queue full, engine gone, a failed step)

    async def first_then_stream(subs, events: Callable[[AsyncIterator], AsyncIterator[str]]) -> StreamingResponse:
        """Start generating before answering, so a full queue is a 503, not a broken stream."""
        agen = run(subs)
        try:
            first = await agen.__anext__()
        except StopAsyncIteration:
            first = None

        async def chained():
            if first is not None:
                yield first
            async for item in agen:
                yield item

        async def body():
            try:
                async for line in events(chained()):
                    yield line
            except APIError as exc:
                yield f"data: {json.dumps(exc.body())}\n\n"
            finally:
                await agen.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    def check_model(model: str | None) -> None:
        if model is not None and model != name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {name!r} (GET /v1/models)",
                           "model", code="model_not_found")

    def unsupported(param: str, value, default) -> None:
        if value != default:
            raise APIError(400, f"{param}={value!r} is not supported by this server", param)

    def usage(seqs: list[_Seq], prompt_tokens: int) -> dict:
        """OpenAI usage; prompt_tokens_details.cached_tokens: prompt tokens reused from the prefix cache
        (of each prompt's first completion, as prompt_tokens counts each prompt once)."""
        completion = sum(len(s.token_ids) for s in seqs)
        cached = sum(max((s.cached_tokens for s in seqs if s.prompt_index == i), default=0)
                     for i in {s.prompt_index for s in seqs})
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)

    def completion_logprobs(lps: list, offset: int = 0) -> dict:
        tokens = [token_text(lp.token_id) for lp in lps]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in lps], "text_offset": offsets}

    def chat_logprobs(lps: list) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in lps]}

    # -- OpenAI API -------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(started),
                                            "owned_by": "dayzero", "root": str(llm.path),
                                            "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = parse(CompletionRequest, await read_json(request))
        check_model(req.model)
        unsupported("echo", req.echo, False)
        unsupported("suffix", req.suffix, None)
        unsupported("best_of", req.best_of, None if req.best_of is None else req.n)
        unsupported("logit_bias", req.logit_bias or None, None)
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise APIError(400, f"logprobs={req.logprobs} is invalid: expected an integer in [0, 5]", "logprobs")
        p = req.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts:
            raise APIError(400, "prompt is empty; at least one token is needed", "prompt")
        params = req.sampling_params(req.max_tokens, req.logprobs)
        checked = [validate(pr, params, "prompt" if len(prompts) == 1 else f"prompt {i}") for i, pr in enumerate(prompts)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        subs, seqs = submissions(checked, rid, "prompt")
        prompt_tokens = sum(len(ids) for ids, _ in checked)
        created = int(time.time())
        want_lp = req.logprobs is not None

        def chunk(choices: list, use: dict | None = None) -> str:
            body = {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices}
            if use is not None or (req.stream_options and req.stream_options.include_usage):
                body["usage"] = use
            return f"data: {json.dumps(body)}\n\n"

        if req.stream:
            async def events(items):
                async for index, update in items:
                    seq = seqs[index]
                    offset = seq.num_chars
                    seq.add(update)
                    if update.text_delta or update.finished or (want_lp and update.logprobs):
                        lp = completion_logprobs([update.logprobs] if update.logprobs else [], offset) if want_lp else None
                        yield chunk([{"index": index, "text": update.text_delta, "logprobs": lp,
                                      "finish_reason": update.finish_reason if update.finished else None}])
                if req.stream_options and req.stream_options.include_usage:
                    yield chunk([], usage(seqs, prompt_tokens))

            return await first_then_stream(subs, events)

        await collect(request, subs, seqs)
        return {"id": rid, "object": "text_completion", "created": created, "model": name,
                "choices": [{"index": i, "text": s.text, "logprobs": completion_logprobs(s.logprobs) if want_lp else None,
                             "finish_reason": s.finish_reason, "stop_reason": s.stop_reason} for i, s in enumerate(seqs)],
                "usage": usage(seqs, prompt_tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await read_json(request))
        check_model(req.model)
        unsupported("tools", req.tools, None)
        unsupported("response_format", (req.response_format or {}).get("type", "text"), "text")
        unsupported("logit_bias", req.logit_bias or None, None)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        messages = []
        for i, m in enumerate(req.messages):
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                if any(part.type != "text" or part.text is None for part in m.content):
                    raise APIError(400, f"messages.{i}.content: only text parts are supported", f"messages.{i}.content")
                msg["content"] = "".join(part.text for part in m.content)
            messages.append(msg)
        try:
            ids = llm.apply_chat_template(messages)
        except Exception as exc:  # the template rejects the conversation (roles out of order, ...)
            raise APIError(400, f"messages: the chat template failed: {exc}", "messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_ids, params = validate(ids, req.sampling_params(max_tokens, logprobs), "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        subs, seqs = submissions([(prompt_ids, params)], rid, "messages")
        created = int(time.time())

        if req.stream:
            def chunk(choices: list, use: dict | None = None) -> str:
                body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                        "choices": choices}
                if use is not None or (req.stream_options and req.stream_options.include_usage):
                    body["usage"] = use
                return f"data: {json.dumps(body)}\n\n"

            async def events(items):
                for i in range(len(seqs)):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                async for index, update in items:
                    seqs[index].add(update)
                    if update.text_delta or update.finished or (req.logprobs and update.logprobs):
                        lp = chat_logprobs([update.logprobs] if update.logprobs else []) if req.logprobs else None
                        delta = {"content": update.text_delta} if update.text_delta else {}
                        yield chunk([{"index": index, "delta": delta, "logprobs": lp,
                                      "finish_reason": update.finish_reason if update.finished else None}])
                if req.stream_options and req.stream_options.include_usage:
                    yield chunk([], usage(seqs, len(prompt_ids)))

            return await first_then_stream(subs, events)

        await collect(request, subs, seqs)
        return {"id": rid, "object": "chat.completion", "created": created, "model": name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": s.text},
                             "logprobs": chat_logprobs(s.logprobs) if req.logprobs else None,
                             "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
                            for i, s in enumerate(seqs)],
                "usage": usage(seqs, len(prompt_ids))}

    # -- SGLang native API ------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        req: GenerateRequest = parse(GenerateRequest, await read_json(request))
        if (req.text is None) == (req.input_ids is None):
            raise APIError(400, "give exactly one of text or input_ids", "text")
        batched = isinstance(req.text, list) or bool(req.input_ids and isinstance(req.input_ids[0], list))
        prompts = (req.text if isinstance(req.text, list) else [req.text]) if req.text is not None else (
            req.input_ids if batched else [req.input_ids])
        if not prompts:
            raise APIError(400, "text/input_ids is an empty list", "text" if req.text is not None else "input_ids")
        sps = req.sampling_params
        if isinstance(sps, list) and len(sps) != len(prompts):
            raise APIError(400, f"got {len(sps)} sampling_params for {len(prompts)} prompts", "sampling_params")
        if not isinstance(sps, list):
            sps = [sps or SGLangSamplingParams()] * len(prompts)
        rids = req.rid if isinstance(req.rid, list) else ([req.rid] if req.rid is not None else None)
        if rids is not None and len(rids) != len(prompts):
            raise APIError(400, f"got {len(rids)} rids for {len(prompts)} prompts", "rid")
        logprobs = req.top_logprobs_num if req.return_logprob else None
        field_name = "text" if req.text is not None else "input_ids"
        checked = [validate(p, sp.sampling_params(logprobs), field_name if len(prompts) == 1 else f"{field_name} {i}")
                   for i, (p, sp) in enumerate(zip(prompts, sps))]
        subs, seqs = submissions(checked, f"gen-{uuid.uuid4().hex}", field_name, rids)
        arrival = time.perf_counter()
        many = batched or len(seqs) > 1

        def result(i: int) -> dict:
            s = seqs[i]
            if s.finish_reason == "length":
                finish = {"type": "length", "length": len(s.token_ids)}
            elif s.finish_reason == "stop":
                finish = {"type": "stop", "matched": s.stop_reason}
            elif s.finish_reason == "abort":
                finish = {"type": "abort", "message": "aborted"}
            else:
                finish = None
            meta = {"id": subs[i].request_id, "prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.token_ids),
                    "cached_tokens": s.cached_tokens, "finish_reason": finish, "e2e_latency": time.perf_counter() - arrival}
            if req.return_logprob:
                meta["output_token_logprobs"] = [[lp.logprob, lp.token_id, None] for lp in s.logprobs]
                meta["output_top_logprobs"] = [[[v, t, None] for t, v in lp.top] for lp in s.logprobs]
            out = {"text": s.text, "output_ids": list(s.token_ids), "meta_info": meta}
            if many:
                out["index"] = i
            return out

        if req.stream:
            async def events(items):
                async for index, update in items:
                    seqs[index].add(update)
                    if update.new_token_ids or update.finished:
                        yield f"data: {json.dumps(result(index))}\n\n"

            return await first_then_stream(subs, events)

        await collect(request, subs, seqs)
        outs = [result(i) for i in range(len(seqs))]
        for o in outs:
            o.pop("index", None)
        return outs if many else outs[0]

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": str(llm.path), "tokenizer_path": str(llm.path) if tokenizer is not None else None,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False, "served_model_name": name,
                "max_model_len": llm.max_model_len}

    def kv_state(e) -> dict:
        s, pool = e.scheduler, e.scheduler.kv.pool
        return {"kv_pool": {"num_blocks": pool.num_blocks, "num_free_blocks": pool.num_free,
                            "block_size": s.kv.block_size, "usage": pool.usage},
                "num_running_reqs": s.num_running, "num_queued_reqs": s.num_waiting,
                # what the engine still tracks (0 and 0 when idle: nothing leaks) and its recoveries
                "num_tracked_reqs": len(e.tracks), "num_state_slots_held": e.runner.num_requests,
                "token_budget": s.token_budget, "num_failed_steps": e.num_failed_steps,
                "num_oom_retries": e.num_oom_retries}

    @app.get("/get_server_info")
    async def get_server_info():
        try:
            state = await asyncio.wait_for(async_engine.call(kv_state), 30)
        except (EngineDeadError, asyncio.TimeoutError) as exc:
            raise APIError(503, f"the engine is not answering: {exc!r}") from None
        return {**config.extra_info, "served_model_name": name, "model_path": str(llm.path),
                "max_model_len": llm.max_model_len, "max_running_requests": config.max_running_requests,
                "max_queued_requests": config.max_queued_requests,
                "max_total_num_tokens": engine.scheduler.kv.pool.num_blocks * engine.scheduler.kv.block_size,
                "num_in_flight_reqs": async_engine.num_in_flight, "uptime_s": time.time() - started,
                **_ranks(llm), **state}

    @app.get("/health")
    async def health():
        if llm.workers is not None and llm.workers.failure is not None:
            raise APIError(503, f"a rank of the tensor/expert-parallel job failed: {llm.workers.failure}")
        if not async_engine.is_alive:
            raise APIError(503, f"the engine is not running ({async_engine.error!r})")
        if engine.failed_steps_in_a_row >= UNHEALTHY_AFTER_FAILED_STEPS:
            raise APIError(503, f"the last {engine.failed_steps_in_a_row} engine steps failed (the latest: "
                                f"{engine.last_failure}); the device may be broken")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        ids = [tokenizer.bos_token_id or 0] if tokenizer is not None else [0]
        sub = Submission(f"health-{uuid.uuid4().hex}", ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        await asyncio.wait_for(collect(request, [sub], [_Seq(0, ids)]), 60)
        return Response(status_code=200)

    @app.post("/flush_cache")
    async def flush_cache():
        flushed = await async_engine.call(lambda e: e.scheduler.kv.reset_prefix_cache())
        if not flushed:
            raise APIError(400, "the prefix cache was not flushed: requests are running or queued; retry when idle")
        return PlainTextResponse("Cache flushed.\n")

    @app.get("/metrics")
    async def metrics():
        s = engine.scheduler
        pool = s.kv.pool
        admitted = async_engine.metrics.prompt_tokens
        gauges = {
            "num_running_reqs": ("Requests running (holding KV blocks).", s.num_running),
            "num_queued_reqs": ("Requests accepted and waiting to run.",
                                max(async_engine.num_in_flight - s.num_running, 0)),
            "kv_cache_usage": ("Fraction of KV blocks held by requests (0..1).", pool.usage),
            "num_kv_blocks_free": ("Free KV blocks.", pool.num_free),
            "num_kv_blocks_total": ("KV blocks in the pool.", pool.num_blocks),
            "prefix_cache_hit_rate": ("Prompt tokens found in the prefix cache / prompt tokens admitted.",
                                      s.num_prefix_cached_tokens / admitted if admitted else 0.0),
            "num_preemptions": ("Requests preempted (recomputed) so far.", s.num_preemptions),
            "num_failed_steps": ("Engine steps that raised so far (their requests failed, or retried after OOM).",
                                 engine.num_failed_steps),
            "num_oom_retries": ("Steps out of device memory retried within a smaller token budget so far.",
                                engine.num_oom_retries),
            "token_budget": ("Tokens per step now (below --chunked-prefill-size for a while after OOM).",
                             s.token_budget),
        }
        return PlainTextResponse(async_engine.metrics.render(name, gauges),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
