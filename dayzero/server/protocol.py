"""Request bodies of the HTTP API and the OpenAI-style error.

OpenAI bodies forbid unknown fields (the OpenAI API answers "Unrecognized request argument");
the vLLM/SGLang sampling extensions clients send through `extra_body` (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, skip_special_tokens) are known fields. Types are
strict: "0.5" is not a number, true is not an integer. SGLang's /generate body and its
sampling_params forbid unknown fields too, as SGLang's dataclasses do.
"""

from __future__ import annotations

import json

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dayzero.engine.sampling import SamplingParams
from dayzero.structured import StructuredOutputs


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                              413: "invalid_request_error", 503: "server_overloaded"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAISampling(_Strict):
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM / SGLang extensions (sent by clients through extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    # structured outputs: OpenAI's response_format; SGLang's regex / ebnf / json_schema; vLLM's structured_outputs
    response_format: dict | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict | None = None
    structured_outputs: dict | None = None

    def constraint(self) -> StructuredOutputs | None:
        """The request's one output constraint, or None; APIError naming the field if it is malformed."""
        found = [c for c in (response_format_constraint(self.response_format), _sglang_constraint(self),
                             _vllm_constraint(self.structured_outputs)) if c is not None]
        if len(found) > 1:
            raise APIError(400, "give one output constraint: response_format, regex, ebnf, json_schema or "
                                f"structured_outputs (got {', '.join(c.source for c in found)})", found[1].source)
        return found[0] if found else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputs | None = None, skip_special_tokens: bool | None = None
                        ) -> SamplingParams:
        given = {k: v for k, v in dict(
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty).items() if v is not None}
        skip = self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        return SamplingParams(max_tokens=max_tokens, n=self.n, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
                              ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=skip,
                              structured_outputs=structured, **given)


def response_format_constraint(response_format: dict | None) -> StructuredOutputs | None:
    """OpenAI's response_format: text (None), json_object, json_schema (its schema, enforced whether strict or not)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, source="response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema: expected a JSON schema object",
                           "response_format.json_schema.schema")
        return StructuredOutputs(json=schema, source="response_format.json_schema.schema")
    raise APIError(400, f"response_format.type {kind!r} is not supported: expected text, json_object or json_schema",
                   "response_format.type")


def _sglang_constraint(req) -> StructuredOutputs | None:
    """SGLang's json_schema (JSON text or an object), regex, ebnf: at most one."""
    given = [(name, getattr(req, name)) for name in ("json_schema", "regex", "ebnf") if getattr(req, name) is not None]
    if len(given) > 1:
        raise APIError(400, f"give one of json_schema, regex, ebnf (got {', '.join(n for n, _ in given)})", given[1][0])
    if not given:
        return None
    name, value = given[0]
    if name == "json_schema":
        return StructuredOutputs(json=value, source=name)
    return StructuredOutputs(regex=value, source=name) if name == "regex" else StructuredOutputs(grammar=value, source=name)


_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _vllm_constraint(spec: dict | None) -> StructuredOutputs | None:
    """vLLM's structured_outputs: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} |
    {"json_object": true}."""
    if spec is None:
        return None
    given = {k: v for k, v in spec.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_VLLM_KEYS))
    if unknown or len(given) != 1:
        raise APIError(400, f"structured_outputs: give exactly one of {', '.join(_VLLM_KEYS)}"
                            + (f" (unknown: {', '.join(unknown)})" if unknown else ""), "structured_outputs")
    (key, value), = given.items()
    where = f"structured_outputs.{key}"
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise APIError(400, f"{where}: expected a non-empty list of strings", where)
        return StructuredOutputs(lark="start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value),
                                 source=where)
    if key == "json_object":
        return StructuredOutputs(json_object=True, source=where)
    if key == "json":
        return StructuredOutputs(json=value, source=where)
    if not isinstance(value, str):
        raise APIError(400, f"{where}: expected a string", where)
    return StructuredOutputs(regex=value, source=where) if key == "regex" else StructuredOutputs(grammar=value, source=where)


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_calls, ... are passed to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # passed to the chat template (the thinking switch: `thinking`, ...)
    reasoning_effort: str | None = None  # passed to the chat template too (gpt-oss: low, medium, high)
    separate_reasoning: bool = True  # SGLang: False leaves the reasoning in content


class SGLangSamplingParams(_Strict):
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    seed: int | None = None  # SGLang calls it sampling_seed; both are accepted
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    json_schema: str | dict | None = None  # structured outputs (at most one)
    regex: str | None = None
    ebnf: str | None = None

    def sampling_params(self, logprobs: int | None) -> SamplingParams:
        seed = self.sampling_seed if self.sampling_seed is not None else self.seed
        structured = _sglang_constraint(self)
        return SamplingParams(max_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
                              ignore_eos=self.ignore_eos, repetition_penalty=self.repetition_penalty,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              n=self.n, seed=seed, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                              structured_outputs=structured)


class GenerateRequest(_Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # per prompt: an image (data: URL, file:// path or base64) or a list of them; a list of those when batched
    image_data: str | list[str | list[str] | None] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # accepted for compatibility; prompt logprobs are not computed


def unpaired_surrogate(value: Any, path: str = "") -> str | None:
    """The field ("messages.0.content") of the first string in a parsed JSON body that holds an unpaired
    UTF-16 surrogate ("\\ud800" is valid JSON but no text: no tokenizer can encode it), or None."""
    todo = [(path, value)]
    while todo:
        where, v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(v, dict):
            todo.extend((f"{where}.{k}" if where else str(k), x) for k, x in v.items())
            bad_key = next((k for k in v if unpaired_surrogate(k) is not None), None)
            if bad_key is not None:  # named by its repr, which escapes the surrogate
                return f"{where}.{bad_key!r}" if where else repr(bad_key)
        elif isinstance(v, list):
            todo.extend((f"{where}.{i}" if where else str(i), x) for i, x in enumerate(v))
    return None


def parse(model: type[BaseModel], body: Any) -> Any:
    """model_validate, with a pydantic error turned into a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
        param = ".".join(loc) or None
        if err["type"] == "extra_forbidden":
            param = ".".join(loc)  # as sent, even "" (an empty key)
            message = f"unrecognized request argument supplied: {param!r}"
        elif err["type"] == "missing":
            message = f"missing required field: {param}"
        else:
            message = f"{param}: {err['msg']} (got {err.get('input')!r})"
        raise APIError(400, message, param) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "union", "TextPart",
              "SGLangSamplingParams", "StreamOptions"}
