"""The HTTP API under hypothesis: random bodies for every route that takes one (built from the request
models in dayzero/server/protocol.py, so a field added there is fuzzed without touching this file), with
wrong types, huge and non-finite numbers, unicode (lone surrogates included), deep nesting, unknown
fields, oversized and non-JSON bodies. Every answer is a 200 (a stream ending in data: [DONE]) or a 4xx
whose error names a field the API has (or, for a body that is not a JSON object or is too large, says
so); never a 5xx, a traceback or a hang. The server runs a context of 32 tokens, so a valid request
finishes fast. Derandomized: CI runs the same examples every time (DAYZERO_FULL_TESTS=1: 10x more)."""

from __future__ import annotations

import json
import os
import types
import typing
from inspect import isclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from dayzero.engine.sampling import SamplingParams
from dayzero.server import protocol
from tests.server.conftest import start_server, stop_server, wait_pool_free

EXAMPLES = 300 if os.environ.get("DAYZERO_FULL_TESTS") == "1" else 30
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_REQUEST_BYTES = 1 << 16
ROUTES = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest,
          "/generate": protocol.GenerateRequest}


@pytest.fixture(scope="module")
def fuzz_url():
    running = start_server(max_running_requests=4, max_queued_requests=4, max_request_bytes=MAX_REQUEST_BYTES,
                           llm_kwargs={"max_model_len": 32})
    yield running.url
    wait_pool_free(running.url)
    stop_server(running)


# -- values -------------------------------------------------------------------------------------------
SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\ud83d", "\x00", "\u202e", "\ufeff"])
TEXT = st.one_of(st.text(max_size=12), st.text(st.characters(min_codepoint=0x80), max_size=6), SURROGATES,
                 st.just("word " * 20), st.just("x" * (MAX_REQUEST_BYTES + 10)))
INTS = st.one_of(st.integers(-2, 40), st.sampled_from([0, 2**31, 2**53 + 1, 2**63, 2**64, -2**63 - 1, 10**40]))
FLOATS = st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, -0.0]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)


def _nested(depth: int):
    value = 1
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


WILD = st.one_of(JSON, st.sampled_from([_nested(60), _nested(3000)]))


def for_annotation(ann) -> st.SearchStrategy:
    """Values of the type a request field declares (nested models as bodies of their own)."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is typing.Any:
        return JSON
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[for_annotation(a) for a in args])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(for_annotation(args[0]), max_size=4)
    if origin is dict:
        return st.dictionaries(TEXT, for_annotation(args[1]), max_size=3)
    if ann is type(None):
        return st.none()
    if isclass(ann) and issubclass(ann, BaseModel):
        return bodies(ann)
    return {bool: st.booleans(), int: INTS, float: FLOATS, str: TEXT, dict: st.dictionaries(TEXT, JSON, max_size=3),
            list: st.lists(JSON, max_size=3)}[ann]


def bodies(model: type[BaseModel]) -> st.SearchStrategy[dict]:
    """A body of `model`: its required fields and any of the others, each a value of its type or (one
    time in four) anything at all; sometimes a field the API does not have."""
    def value(f):
        return st.one_of(for_annotation(f.annotation), for_annotation(f.annotation), for_annotation(f.annotation), WILD)
    required = {n: value(f) for n, f in model.model_fields.items() if f.is_required()}
    optional = {n: value(f) for n, f in model.model_fields.items() if not f.is_required()}
    body = st.fixed_dictionaries(required, optional=optional)
    extra = st.dictionaries(st.sampled_from(["bogus", "tool_choice_x", ""]), JSON, max_size=1)
    return st.builds(lambda b, e: {**b, **e}, body, st.one_of(st.just({}), st.just({}), extra))


def _field_names(model: type[BaseModel], out: set[str]) -> set[str]:
    for name, f in model.model_fields.items():
        out.add(name)
        for ann in [f.annotation, *typing.get_args(f.annotation)]:
            for inner in [ann, *typing.get_args(ann)]:
                if isclass(inner) and issubclass(inner, BaseModel):
                    _field_names(inner, out)
    return out


# the fields an error may name: the routes' own and the sampling parameters they turn into
FIELDS = set(SamplingParams.__dataclass_fields__)
for _model in ROUTES.values():
    _field_names(_model, FIELDS)


# -- the property ---------------------------------------------------------------------------------------
def check(url: str, route: str, content: bytes) -> None:
    try:
        with httpx.stream("POST", url + route, content=content, headers={"content-type": "application/json"},
                          timeout=60) as r:
            text = "".join(r.iter_text())
    except httpx.TimeoutException:
        raise AssertionError(f"{route}: no answer within 60 s to {content[:300]!r}") from None
    where = f"{route} {r.status_code} for {content[:300]!r}: {text[:500]}"
    assert r.status_code == 200 or 400 <= r.status_code < 500, where
    assert "Traceback" not in text and 'File "' not in text, where
    if r.status_code != 200:
        err = json.loads(text)["error"]
        assert err["message"] and err["type"], where
        if r.status_code == 400 and err["param"] is None:  # only a body that is not a JSON object at all
            assert "not valid JSON" in err["message"] or "must be a JSON object" in err["message"], where
        elif r.status_code == 400:
            param, sent = err["param"], _keys(content)  # a field of the API, or one sent ("bogus.0"), or its repr
            assert param in sent or any(param == k or param.startswith((k + ".", k + " ")) for k in FIELDS | sent) or (
                "surrogate" in err["message"] and param), where
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e[:10] for e in events), where
    else:
        json.loads(text)


def _keys(content: bytes) -> set[str]:
    """Every key of every object in the body (an unknown field is named as sent)."""
    keys, todo = set(), []
    try:
        todo.append(json.loads(content))
    except (ValueError, RecursionError):
        return keys
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            keys.update(value)
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)
    return keys


def _encode(body) -> bytes:
    try:
        return json.dumps(body).encode("utf-8", "surrogatepass")  # (NaN and Infinity as Python writes them)
    except RecursionError:
        return b"[" * 100000


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_random_bodies_are_answered_200_or_a_4xx_naming_the_field(fuzz_url, route):
    @FUZZ
    @given(body=bodies(ROUTES[route]))
    def run(body):
        check(fuzz_url, route, _encode(body))

    run()


@FUZZ
@given(route=st.sampled_from(sorted(ROUTES)), raw=st.one_of(
    st.binary(max_size=64), WILD.map(_encode), st.sampled_from([b"", b"{", b"[" * 100000, b"1" * 5000, b'{"a": 1e999}',
                                                               b"\xff\xfe{}", b'{"prompt": "\\ud800"}', b"{}" * 3])))
def test_raw_bodies_that_are_not_request_objects_are_400s(fuzz_url, route, raw):
    check(fuzz_url, route, raw)
