"""Images through the engine (dayzero/engine/encoder.py, the LLM API) on a tiny kimi_k25 checkpoint:
greedy tokens equal transformers' generate for prompts with one and several images (batched with a
text-only prompt and another image in one step, and chunked through an image), chat messages with
image parts, the feature cache (a repeated image is not encoded again) and the prefix cache (a repeated
image's blocks are reused, a different image's are not), and refusals that leave the engine serving."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from dayzero import LLM, SamplingParams, settings
from dayzero.multimodal.processor import ImageProcessor
from tests.models.kimi_k25_checkpoints import IMAGE_PLACEHOLDER, build_kimi_k25_checkpoint, load_reference, random_image

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_kimi_k25_checkpoint(tmp_path_factory.mktemp("k25"), seed=7)
    llm = LLM(path, block_size=4)
    return path, llm, load_reference(path), ImageProcessor.from_checkpoint(path, llm.model.spec.vision)


def reference_tokens(ref, processor, prompt_ids: list[int], images: list, steps: int = 4) -> list[int]:
    ids = torch.tensor([prompt_ids])
    inputs = {}
    if images:
        processed = [processor(im) for im in images]
        inputs = {"pixel_values": torch.cat([p.pixels for p in processed]),
                  "image_grid_thw": torch.tensor([list(p.grid) for p in processed])}
    with torch.no_grad():
        out = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                           pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_generate_equals_transformers_batched_with_text_and_another_image(setup):
    _, llm, ref, processor = setup
    a, b, c = random_image(28, 56, seed=1), random_image(150, 100, seed=2), random_image(56, 42, seed=3)
    prompts = [{"prompt": f"Look {IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}, then", "multi_modal_data": {"image": [a, b]}},
               "A prompt without images",
               {"prompt_token_ids": llm.tokenizer.encode(f"x{IMAGE_PLACEHOLDER}y"), "multi_modal_data": {"image": c}}]
    before = llm.engine.runner.encoder.num_calls
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.runner.encoder.num_calls == before + 1  # the three images of the step: one encoder call
    assert len(outs[0].prompt_token_ids) == len(llm.tokenizer.encode(prompts[0]["prompt"])) - 2 + 2 + 24
    for out, images in zip(outs, ([a, b], [], [c])):
        assert out.token_ids == reference_tokens(ref, processor, out.prompt_token_ids, images)


def test_chunked_prefill_through_images(setup):
    path, _, ref, processor = setup
    llm = LLM(path, max_num_batched_tokens=7, block_size=4)  # chunks cut the 24 placeholders of the big image
    image = random_image(150, 100, seed=5)
    out = llm.generate({"prompt": f"a b c {IMAGE_PLACEHOLDER} d e", "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert out.token_ids == reference_tokens(ref, processor, out.prompt_token_ids, [image])


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_image_parts(setup, tmp_path):
    _, llm, ref, processor = setup
    a, b = random_image(42, 28, seed=8), random_image(28, 28, seed=9)
    b.save(tmp_path / "b.png")
    messages = [{"role": "user", "content": [{"type": "text", "text": "compare "},
                                             {"type": "image_url", "image_url": {"url": _data_url(a)}},
                                             {"type": "text", "text": " with "},
                                             {"type": "image", "image": f"file://{tmp_path / 'b.png'}"}]}]
    out = llm.chat(messages, GREEDY)[0]
    ids = llm.apply_chat_template([{"role": "user", "content": f"compare {IMAGE_PLACEHOLDER} with {IMAGE_PLACEHOLDER}"}])
    same = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [a, b]}}, GREEDY)[0]
    assert (same.prompt_token_ids, same.token_ids) == (out.prompt_token_ids, out.token_ids)
    assert out.token_ids == reference_tokens(ref, processor, out.prompt_token_ids, [a, b])


def test_a_repeated_image_is_not_encoded_again_and_its_prefix_is_reused(setup):
    _, llm, ref, processor = setup
    cache, image, other = llm.engine.feature_cache, random_image(56, 56, seed=11), random_image(56, 56, seed=12)
    turn1 = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                          {"type": "text", "text": " what is this?"}]}]
    encoded = cache.num_encoded
    first = llm.chat(turn1, GREEDY)[0]
    assert cache.num_encoded == encoded + 1
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and then?"}]
    second = llm.chat(turn2, GREEDY)[0]
    assert cache.num_encoded == encoded + 1  # the same image: its features come from the cache
    end = max(i for i, t in enumerate(second.prompt_token_ids) if t == llm.model.image_token_id) + 1
    assert second.num_cached_tokens >= end // 4 * 4  # every full block through the image is reused
    swapped = [{**turn2[0], "content": [{"type": "image_pil", "image_pil": other}, turn2[0]["content"][1]]}] + turn2[1:]
    out = llm.chat(swapped, GREEDY)[0]
    assert cache.num_encoded == encoded + 2  # a different image is encoded
    start = min(i for i, t in enumerate(second.prompt_token_ids) if t == llm.model.image_token_id)
    assert out.num_cached_tokens <= start  # and no block holding its placeholders is taken from the first image's
    assert out.token_ids == reference_tokens(ref, processor, out.prompt_token_ids, [other])


@pytest.mark.parametrize("images, message", [
    ([b"\x89PNG broken"], "cannot be decoded"),
    (["http://example.com/x.png"], "not fetched over the network"),
    ([random_image(28, 28), random_image(28, 28, seed=1)], "2 image\\(s\\) given but the prompt has 1"),
    ([random_image(300, 300)], "over the size limit"),
])
def test_bad_images_are_refused_and_nothing_else_is_affected(setup, images, message):
    _, llm, _, _ = setup
    good = {"prompt": f"ok {IMAGE_PLACEHOLDER}", "multi_modal_data": {"image": random_image(28, 28, seed=4)}}
    bad = {"prompt": f"bad {IMAGE_PLACEHOLDER}", "multi_modal_data": {"image": images}}
    with settings.override(max_image_pixels=50_000), pytest.raises(ValueError, match=message):
        llm.generate([good, bad], GREEDY)
    assert not llm.engine.has_unfinished()  # nothing of the call was queued
    assert len(llm.generate(good, GREEDY)[0].token_ids) == 4
