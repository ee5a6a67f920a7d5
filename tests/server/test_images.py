"""Images over HTTP: the openai client's image_url parts (data: and file:// URLs) in /v1/chat/completions,
SGLang's image_data in /generate, on a tiny kimi_k25 server; greedy outputs equal transformers' generate,
a repeated image's prefix is reported cached, and bad images (undecodable, fetched over the network,
more than the placeholders, sent to a text-only model) are 400s that leave the server serving."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch

from tests.models.kimi_k25_checkpoints import IMAGE_PLACEHOLDER, build_kimi_k25_checkpoint, load_reference, random_image
from tests.server.conftest import start_server, stop_server

MAX_TOKENS = 4


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    path = build_kimi_k25_checkpoint(tmp_path_factory.mktemp("k25"), seed=11)
    running = start_server({"model": path, "block_size": 4})
    yield running, load_reference(path)
    stop_server(running)


def expected(running, ref, prompt, images: list) -> tuple[list[int], list[int]]:
    """(the expanded prompt ids, transformers' greedy tokens after them)."""
    engine = running.llm.engine  # prepare_images reads only the tokenizer and the image processor
    ids, placed = engine.prepare_images(prompt, images)
    inputs = {"pixel_values": torch.cat([p.image.pixels for p in placed]),
              "image_grid_thw": torch.tensor([list(p.image.grid) for p in placed])}
    x = torch.tensor([ids])
    with torch.no_grad():
        out = ref.generate(input_ids=x, attention_mask=torch.ones_like(x), **inputs, max_new_tokens=MAX_TOKENS,
                           min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return ids, out[0, len(ids):].tolist()


def test_openai_chat_with_images(vision_server, tmp_path):
    running, ref = vision_server
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", timeout=60, max_retries=0)
    a, b = random_image(56, 42, seed=1), random_image(28, 56, seed=2)
    b.save(tmp_path / "b.png")
    messages = [{"role": "user", "content": [{"type": "text", "text": "What differs between "},
                                             {"type": "image_url", "image_url": {"url": data_url(a)}},
                                             {"type": "text", "text": " and "},
                                             {"type": "image_url", "image_url": {"url": f"file://{tmp_path / 'b.png'}"}}]}]
    prompt = running.llm.apply_chat_template([{"role": "user", "content": f"What differs between {IMAGE_PLACEHOLDER} and "
                                                                           f"{IMAGE_PLACEHOLDER}"}])
    ids, tokens = expected(running, ref, prompt, [a, b])
    text = running.llm.tokenizer.decode(tokens, skip_special_tokens=True)
    r = client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), MAX_TOKENS)
    stream = client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= len(ids) // 4 * 4 - 4  # the same images again


def test_generate_with_image_data(vision_server):
    running, ref = vision_server
    image = random_image(150, 100, seed=3)
    prompt = f"Describe {IMAGE_PLACEHOLDER} briefly"
    ids, tokens = expected(running, ref, prompt, [image])
    body = {"text": prompt, "image_data": data_url(image),
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    first = httpx.post(f"{running.url}/generate", json=body, timeout=60).json()
    assert first["output_ids"] == tokens and first["meta_info"]["prompt_tokens"] == len(ids)
    again = httpx.post(f"{running.url}/generate", json={**body, "text": None, "input_ids": ids,
                                                        "image_data": [data_url(image)]}, timeout=60).json()
    assert again["output_ids"] == tokens and again["meta_info"]["cached_tokens"] >= len(ids) // 4 * 4 - 4
    batch = httpx.post(f"{running.url}/generate", json={"text": [prompt, "no image here"], "image_data": [data_url(image), None],
                                                        "sampling_params": body["sampling_params"]}, timeout=60).json()
    assert batch[0]["output_ids"] == tokens and len(batch[1]["output_ids"]) == MAX_TOKENS


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}, "cannot be decoded"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "not fetched over the network"),
    ({"type": "input_audio", "input_audio": {}}, "unsupported content part"),
])
def test_bad_images_are_400_and_the_server_keeps_serving(vision_server, part, message):
    running, _ = vision_server
    body = {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    r = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages"
    ok = httpx.post(f"{running.url}/v1/chat/completions", timeout=60,
                    json={"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200


def test_more_images_than_placeholders(vision_server):
    running, _ = vision_server
    img = data_url(random_image(28, 28))
    r = httpx.post(f"{running.url}/generate", timeout=60,
                   json={"text": f"one {IMAGE_PLACEHOLDER}", "image_data": [img, img]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_data"
    assert "2 image(s) given but the prompt has 1" in r.json()["error"]["message"]


def test_a_text_only_model_refuses_images(url, offline):
    img = data_url(random_image(28, 28))
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "demo", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": img}}]}]})
    assert r.status_code == 400 and "reads no images" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/generate", timeout=60, json={"text": "hi", "image_data": img})
    assert r.status_code == 400 and "reads no images" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="reads no images"):
        offline.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(28, 28)}})
    assert httpx.get(f"{url}/get_model_info", timeout=10).json()["has_image_understanding"] is False
