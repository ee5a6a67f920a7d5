"""Tool calls, reasoning and structured outputs through the openai client, on the demo checkpoint
(random weights; its template writes DeepSeek-V4's DSML tool calls).

Every constrained request's output parses and validates against its schema: varied seeded schemas
(strings, arrays and numbers bounded, so that random weights end within max_tokens: the grammar
allows EOS only once the value is complete, and every request must end with "stop"), streaming and
not; 16 requests here, 100 with DAYZERO_FULL_TESTS=1. tool_choice "required" and a named function
always give a well-formed call to a given tool; bad input is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil

import httpx
import jsonschema
import openai
import pytest

from tests.budget import ci_cases
from tests.server.conftest import start_server, stop_server, wait_pool_free
from tests.structured.walk import random_schema

NUM_REQUESTS = 100 if os.environ.get("DAYZERO_FULL_TESTS") == "1" else 16
MAX_TOKENS = 400

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
        "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)


def _schema(i: int) -> dict:
    rng = random.Random(1000 + i)
    return {"type": "object", "properties": {f"f{j}": random_schema(rng) for j in range(rng.randint(1, 3))},
            "required": ["f0"], "additionalProperties": False}


def test_constrained_requests_validate(url):
    """NUM_REQUESTS at once through the async openai client, half streaming, each with its own schema."""
    aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)

    async def one(i: int):
        schema = _schema(i)
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        args = dict(model="demo", messages=[{"role": "user", "content": f"Give me record {i}"}],
                    max_tokens=MAX_TOKENS, temperature=1.0, seed=i, response_format=fmt)
        if i % 2:
            stream = await aclient.chat.completions.create(stream=True, **args)
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = await aclient.chat.completions.create(**args)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        return schema, text, finish

    async def run():
        results = await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
        await aclient.close()
        return results

    for schema, text, finish in asyncio.run(run()):
        assert finish == "stop", f"cut by max_tokens: {text!r}"
        jsonschema.validate(json.loads(text), schema)
    wait_pool_free(url)


def test_json_object_regex_ebnf_on_every_api(client, url):
    r = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=40, seed=1,
                                       response_format={"type": "json_object"}, temperature=0.3)
    if r.choices[0].finish_reason == "stop":  # any object: not bounded, it may run to max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model="demo", prompt="Pets:", max_tokens=20, logprobs=5,
                                  extra_body={"regex": "(cat|dog)s?"})
    assert r.choices[0].text in ("cat", "cats", "dog", "dogs") and r.choices[0].finish_reason == "stop"
    for top in r.choices[0].logprobs.top_logprobs:  # masked tokens are left out, never -Infinity
        assert top and all(v > float("-inf") for v in top.values())
    r = client.completions.create(model="demo", prompt="Pick:", max_tokens=20,
                                  extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].text in ("left", "right")
    body = {"text": "Sum:", "sampling_params": {"max_new_tokens": 30, "ebnf": 'root ::= [1-9] "+" [1-9]'}}
    out = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    assert len(out["text"]) == 3 and out["text"][1] == "+"
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    body = {"text": "Obj:", "sampling_params": {"max_new_tokens": 30, "json_schema": json.dumps(schema)}}
    jsonschema.validate(json.loads(httpx.post(f"{url}/generate", json=body, timeout=60).json()["text"]), schema)


def test_forced_tool_calls(url):
    """tool_choice "required" (parallel calls allowed or not) and a named function, streaming and not, all
    at once: every answer is a well-formed call to a given tool. CI sends 4 of the 8 combinations, each
    choice streaming and not, with parallel calls allowed and not (a call is 140-200 tokens of DSML, the
    test's time); DAYZERO_FULL_TESTS=1 sends all 8."""
    aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
    named = {"type": "function", "function": {"name": "now"}}

    async def one(tool_choice, seed: int, stream: bool):
        args = dict(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=MAX_TOKENS,
                    seed=seed, temperature=1.0, parallel_tool_calls=seed % 2 == 1)
        if not stream:
            r = await aclient.chat.completions.create(**args)
            msg = r.choices[0].message
            assert msg.content is None
            return r.choices[0].finish_reason, [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        calls: dict[int, list] = {}
        finish = None
        async for c in await aclient.chat.completions.create(stream=True, **args):
            for d in c.choices[0].delta.tool_calls or []:
                if d.id:  # the first piece of a call: id, type, name
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
                else:
                    calls[d.index][2] += d.function.arguments
            finish = c.choices[0].finish_reason or finish
        return finish, list(calls.values())

    async def run():
        jobs = ci_cases([("required", 0, False), ("required", 1, True), (named, 0, True), (named, 1, False),
                         ("required", 0, True), ("required", 1, False), (named, 0, False), (named, 1, True)], keep=4)
        results = await asyncio.gather(*(one(*job) for job in jobs))
        await aclient.close()
        return zip(jobs, results)

    for (choice, seed, _), (finish, calls) in asyncio.run(run()):
        assert finish == "tool_calls" and calls
        if choice is named or seed % 2 == 0:
            assert len(calls) == 1
        for call_id, name, arguments in calls:
            assert call_id and (name == "now" if choice is named else name in SCHEMAS)
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_tool_history_and_auto(client):
    """A conversation with an earlier call and its result renders through the template (arguments sent
    as JSON text), and tool_choice auto / none answer (random weights: plain content or a call)."""
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    for tool_choice in ("auto", "none"):
        r = client.chat.completions.create(model="demo", messages=history, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=12, temperature=0)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        if tool_choice == "none":
            assert not msg.tool_calls
        for call in msg.tool_calls or []:
            assert call.function.name in SCHEMAS
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_reasoning_content_with_thinking(client, offline):
    """chat_template_kwargs thinking=True: the prompt opens <think>, so the output is reasoning until </think>."""
    r = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8, temperature=0,
                                       extra_body={"chat_template_kwargs": {"thinking": True}})
    msg = r.choices[0].message
    prompt = offline.apply_chat_template(MESSAGES, thinking=True)
    from dayzero.engine import SamplingParams
    want = offline.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0].text
    reasoning = msg.model_extra.get("reasoning_content")
    think, _, answer = want.partition("</think>")
    assert (reasoning, msg.content) == (think or None, answer.lstrip("\n") or None)
    r = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8, temperature=0,
                                       extra_body={"chat_template_kwargs": {"thinking": True}}, stream=True)
    chunks = list(r)
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == (reasoning or "")


@pytest.mark.parametrize("body, status, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice",
     "'nope', which is not among"),
    ({"tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, 400, "tool_choice", "invalid"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, 400, "tools.0.function.name", "valid"),
    ({"tools": TOOLS + TOOLS[:1]}, 400, "tools.2.function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, 400, "tools.0.function.parameters", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}}, 400,
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format.json_schema.schema", "expected a JSON schema"),
    ({"response_format": {"type": "yaml"}}, 400, "response_format.type", "not supported"),
    ({"regex": "a(", "max_tokens": 4}, 400, "regex", "regular expression"),
    ({"ebnf": "root ::= (", "max_tokens": 4}, 400, "ebnf", "EBNF"),
    ({"regex": "a", "response_format": {"type": "json_object"}}, 400, "regex", "one output constraint"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, 400,
     "response_format", "cannot be combined"),
    ({"messages": MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{not json"}}]}], "tools": TOOLS},
     400, "messages.1.tool_calls.0.function.arguments", "not JSON"),
])
def test_bad_input_names_the_field(url, body, status, param, words):
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "demo", "messages": MESSAGES, **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_tools_on_a_template_without_tools(tmp_path):
    from dayzero.demo import demo_checkpoint

    path = tmp_path / "no-tools"
    shutil.copytree(demo_checkpoint(), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{{ bos_token }}{% for m in messages %}{{ '<｜User｜>' + m['content'] }}{% endfor %}"
                               "{{ '<｜Assistant｜></think>' }}")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    running = start_server({"model": path})
    try:
        r = httpx.post(f"{running.url}/v1/chat/completions",
                       json={"model": "demo", "messages": MESSAGES, "tools": TOOLS}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "has no tools" in r.json()["error"]["message"]
    finally:
        stop_server(running)
