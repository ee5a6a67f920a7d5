"""The official openai client (sync and async, streaming and not) against the server; greedy
outputs equal the offline LLM.generate outputs."""

from __future__ import annotations

import asyncio

import openai
import pytest

from dayzero.engine import SamplingParams
from tests.server.conftest import wait_pool_free

PROMPTS = ["The lighthouse keeper", "Hello world, this is", "1 2 3 4 5"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30, max_retries=0)


@pytest.fixture(scope="module")
def expected(offline):
    outs = offline.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [o.text for o in outs], [len(offline.tokenizer.encode(p)) for p in PROMPTS]


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["demo"]


def test_completions_match_offline(client, expected):
    texts, prompt_lens = expected
    for prompt, text, n_prompt in zip(PROMPTS, texts, prompt_lens):
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == text
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, MAX_TOKENS)
    r = client.completions.create(model="demo", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == texts


def test_completions_stream_matches_offline(client, expected):
    texts, prompt_lens = expected
    stream = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS and chunks[-1].usage.prompt_tokens == prompt_lens[0]


def test_chat_matches_offline(client, offline):
    messages = [{"role": "user", "content": "Tell me about lighthouses"}]
    want = offline.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].text
    r = client.chat.completions.create(model="demo", messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == MAX_TOKENS
    stream = client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_n_seed_stop_logprobs(client, offline):
    r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=6, n=3, seed=7, temperature=1.0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 18
    again = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=6, n=3, seed=7, temperature=1.0)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # seeded: reproducible
    full = offline.generate(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].text
    stop = full[3:5]
    r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]
    r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(t) <= 2 for t in lp.top_logprobs)
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_async_client(url, expected):
    texts, _ = expected

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30, max_retries=0)
        async with client:
            async def one(prompt):
                r = await client.completions.create(model="demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
                return r.choices[0].text

            async def streamed(prompt):
                s = await client.completions.create(model="demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                    stream=True)
                return "".join([c.choices[0].text async for c in s if c.choices])

            return await asyncio.gather(*[one(p) for p in PROMPTS], *[streamed(p) for p in PROMPTS])

    assert asyncio.run(main()) == texts + texts
    wait_pool_free(url)


def test_second_chat_turn_reports_its_cached_prompt_tokens(client, offline):
    first = [{"role": "user", "content": "Tell me about the lighthouse keeper and the long winter on the island " * 3}]
    a = client.chat.completions.create(model="demo", messages=first, max_tokens=6, temperature=0)
    second = first + [{"role": "assistant", "content": a.choices[0].message.content},
                      {"role": "user", "content": "And then?"}]
    b = client.chat.completions.create(model="demo", messages=second, max_tokens=6, temperature=0)
    cached = b.usage.prompt_tokens_details.cached_tokens
    # the first turn's prompt is cached (whole 16-token blocks); the answer is re-tokenized by the template
    assert cached >= a.usage.prompt_tokens // 16 * 16 - 16 and cached % 16 == 0 and cached < b.usage.prompt_tokens
    want = offline.chat(second, SamplingParams(max_tokens=6, temperature=0.0))[0].text
    assert b.choices[0].message.content == want
