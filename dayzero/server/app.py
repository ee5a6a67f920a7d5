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
import dataclasses
import hmac
import json
import os
import threading
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
from dayzero.multimodal.chat import split_images
from dayzero.multimodal.images import ImageError
from dayzero.structured import StructuredOutputs
from dayzero.structured.grammar import GrammarError
from dayzero.server import chat
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
    tool_call_parser: str | None = None  # a chat format's name (dayzero/chat/formats.py), "none"; None: detected
    reasoning_parser: str | None = None


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
    chat_setup = chat.chat_setup(tokenizer, llm.model.spec.model_type, config.tool_call_parser, config.reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine.grammars is not None:  # llguidance's view of the tokenizer (seconds for 200K tokens), built early
            threading.Thread(target=lambda: engine.grammars.ll_tokenizer, name="dayzero-grammar-tokenizer",
                             daemon=True).start()
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

    async def with_images(prompt, images: list, where: str, param: str):
        """(prompt ids with the images' placeholders expanded, placements), or (prompt, ()) without images.
        Decoding and preprocessing run on a worker thread, not on the event loop."""
        if not images:
            return prompt, ()
        try:
            return await asyncio.to_thread(engine.prepare_images, prompt, images, where, param)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), exc.param or param, code=exc.code) from None

    def submissions(prompts: list[tuple[list[int], SamplingParams]], prefix: str, field_name: str,
                    rids: list[str] | None = None, images: list[tuple] | None = None
                    ) -> tuple[list[Submission], list[_Seq]]:
        total = sum(sp.n for _, sp in prompts)
        if total > async_engine.max_in_flight:  # could never be admitted: not a 503 to retry
            raise APIError(400, f"the request asks for {total} sequences ({len(prompts)} prompt(s) x n); this server "
                                f"holds at most {async_engine.max_in_flight} at once (--max-running-requests + "
                                "--max-queued-requests)", "n" if any(sp.n > 1 for _, sp in prompts) else field_name)
        subs, seqs = [], []
        for p, (ids, sp) in enumerate(prompts):
            base = rids[p] if rids else f"{prefix}-{p}"
            for i in range(sp.n):
                subs.append(Submission(f"{base}-{i}" if sp.n > 1 else base, ids, sp, i, images[p] if images else ()))
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

    def validate_constraint(spec) -> None:
        if engine.grammars is None:
            raise APIError(400, f"{spec.source}: constrained decoding needs the checkpoint's tokenizer", spec.source)
        try:
            engine.grammars.compile(spec)
        except GrammarError as exc:
            raise APIError(400, str(exc), exc.param) from None

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
        params = req.sampling_params(req.max_tokens, req.logprobs, req.constraint())
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
        unsupported("logit_bias", req.logit_bias or None, None)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        tools = chat.check_tools(req.tools)
        mode, tool_name = chat.check_tool_choice(req.tool_choice, tools)
        if tools and not chat_setup.template_has_tools:
            raise APIError(400, f"tools: the chat template of {name!r} has no tools; this checkpoint cannot take them",
                           "tools")
        if tools and mode != "none" and not chat_setup.tools:
            raise APIError(400, "tools: this server reads no tool calls for this checkpoint (no tool-call parser: "
                                "start it with --tool-call-parser)", "tools")
        constraint = req.constraint()
        if constraint is not None and mode in ("required", "named"):
            raise APIError(400, f"{constraint.source} cannot be combined with tool_choice {req.tool_choice!r}: a tool "
                                "call is the constrained output", constraint.source)
        try:  # image parts become the model's placeholder text (dayzero.multimodal.chat)
            messages, images = split_images([m.model_dump(exclude_none=True) for m in req.messages],
                                            engine.image_placeholder, engine.model.spec.model_type)
        except ImageError as exc:
            raise APIError(400, str(exc), "messages") from None
        template_kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            template_kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        ids = chat.render(llm, messages, tools, template_kwargs)
        ids, placements = await with_images(ids, images, "messages", "messages")
        in_reasoning = chat.prompt_in_reasoning(chat_setup, tokenizer, ids)
        setup = chat_setup if req.separate_reasoning else dataclasses.replace(chat_setup, reasoning=False)
        plan = chat.ChatPlan(setup, parse_tools=bool(tools) and mode != "none" and chat_setup.tools,
                             in_reasoning=in_reasoning)
        if mode in ("required", "named"):
            for i, tool in enumerate(tools):  # each schema is checked where the grammar would cite it
                spec = StructuredOutputs(json=tool["function"].get("parameters") or {"type": "object"},
                                         source=f"tools.{i}.function.parameters")
                validate_constraint(spec)
            constraint = chat.tool_choice_constraint(chat_setup, tools, mode, tool_name,
                                                     req.parallel_tool_calls is not False, in_reasoning)
        elif chat_setup.format is not None:
            constraint = chat.reasoning_gate(chat_setup, constraint, in_reasoning)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        skip = False if plan.active and chat_setup.special_markers else None
        prompt_ids, params = validate(ids, req.sampling_params(max_tokens, logprobs, constraint, skip), "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        subs, seqs = submissions([(prompt_ids, params)], rid, "messages", images=[placements])
        created = int(time.time())

        if req.stream:
            parsers = [plan.new_parser() for _ in seqs]

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
                    parser = parsers[index]
                    if parser is None:
                        delta = {"content": update.text_delta} if update.text_delta else {}
                    else:
                        parsed = parser.feed(update.text_delta)
                        if update.finished:
                            parsed.extend(parser.finish())
                        delta = chat.delta_fields(parsed)
                    if delta or update.finished or (req.logprobs and update.logprobs):
                        lp = chat_logprobs([update.logprobs] if update.logprobs else []) if req.logprobs else None
                        finish = chat.finish_reason(update.finish_reason, parser) if update.finished else None
                        yield chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}])
                if req.stream_options and req.stream_options.include_usage:
                    yield chunk([], usage(seqs, len(prompt_ids)))

            return await first_then_stream(subs, events)

        await collect(request, subs, seqs)
        choices = []
        for i, s in enumerate(seqs):
            parsed = chat.parse_whole(plan.new_parser(), s.text)
            choices.append({"index": i, "message": chat.message(parsed, s.text),
                            "logprobs": chat_logprobs(s.logprobs) if req.logprobs else None,
                            "finish_reason": chat.finish_reason(s.finish_reason, None, parsed),
                            "stop_reason": s.stop_reason})
        return {"id": rid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
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
        images = _images_per_prompt(req.image_data, len(prompts), batched)
        placed = [await with_images(p, ims, field_name if len(prompts) == 1 else f"{field_name} {i}", "image_data")
                  for i, (p, ims) in enumerate(zip(prompts, images))]
        checked = [validate(p, sp.sampling_params(logprobs), field_name if len(prompts) == 1 else f"{field_name} {i}")
                   for i, ((p, _), sp) in enumerate(zip(placed, sps))]
        subs, seqs = submissions(checked, f"gen-{uuid.uuid4().hex}", field_name, rids, [pl for _, pl in placed])
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
                "has_image_understanding": engine.image_placeholder is not None, "has_audio_understanding": False,
                "served_model_name": name,
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


def _images_per_prompt(image_data, num_prompts: int, batched: bool) -> list[list]:
    """SGLang's image_data as one list of images per prompt: one prompt takes an image or a list; a batch
    takes one entry per prompt (an image, a list, or null)."""
    if image_data is None:
        return [[] for _ in range(num_prompts)]
    if not batched:
        return [image_data if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list) or len(image_data) != num_prompts:
        raise APIError(400, f"image_data: a batch of {num_prompts} prompts takes a list of {num_prompts} entries (an "
                            "image, a list of images or null per prompt)", "image_data")
    return [[] if d is None else d if isinstance(d, list) else [d] for d in image_data]


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
