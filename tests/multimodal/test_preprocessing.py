"""Images in (dayzero/multimodal): loading from every accepted source and the refusals, the MoonViT
preprocessing (the fit arithmetic on hand-worked sizes, pixels against a direct numpy computation, and
transformers' own processor where torchvision is installed), placeholder expansion, the feature cache."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from dayzero import settings
from dayzero.multimodal.chat import split_images
from dayzero.multimodal.feature_cache import FeatureCache
from dayzero.multimodal.images import ImageError, image_hash, load_image
from dayzero.multimodal.placeholders import place_images
from dayzero.multimodal.processor import ImageInput, ImageProcessor, ProcessorConfig, fit_size
from dayzero.spec import VisionSpec
from tests.models.kimi_k25_checkpoints import random_image

VISION = VisionSpec(kind="moonvit", num_layers=1, hidden_size=8, intermediate_size=8, num_heads=2, patch_size=14,
                    merge_kernel=(2, 2), text_hidden_size=8, pos_emb=(8, 8), projector_hidden_size=8)


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_every_source_gives_the_same_pixels(tmp_path):
    image = random_image(30, 20, seed=1)
    data = _png(image)
    (tmp_path / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    sources = [image, data, f"data:image/png;base64,{b64}", f"file://{tmp_path / 'a.png'}", str(tmp_path / "a.png"), b64]
    hashes = {image_hash(load_image(s)) for s in sources}
    assert hashes == {image_hash(image)}
    assert image_hash(random_image(30, 20, seed=2)) not in hashes


@pytest.mark.parametrize("source, message", [
    ("http://example.com/cat.png", "not fetched over the network"),
    ("https://example.com/cat.png", "not fetched over the network"),
    ("data:image/png;base64,!!!", "not valid base64"),
    ("data:image/png,abc", "data URL must be"),
    (b"not an image at all", "cannot be decoded"),
    ("file:///no/such/image.png", "cannot read"),
    (3.5, "expected a PIL image"),
])
def test_refusals_name_the_problem(source, message):
    with pytest.raises(ImageError, match=message):
        load_image(source, "messages.0.content.1")


def test_size_limit_is_read_from_the_header():
    data = _png(random_image(40, 30))
    with settings.override(max_image_pixels=1000):
        with pytest.raises(ImageError, match="over the size limit: 40 x 30 = 1200 pixels"):
            load_image(data)
        with pytest.raises(ImageError, match="over the size limit"):
            load_image(random_image(40, 30))
    assert load_image(data).size == (40, 30)


def test_transparency_is_composited_onto_white():
    rgba = Image.new("RGBA", (2, 1), (10, 20, 30, 0))
    rgba.putpixel((1, 0), (10, 20, 30, 255))
    assert [load_image(rgba).getpixel((x, 0)) for x in range(2)] == [(255, 255, 255), (10, 20, 30)]
    assert load_image(random_image(3, 3, mode="L")).mode == "RGB"


@pytest.mark.parametrize("size, side, fit", [
    ((56, 28), 100, ((56, 28), (56, 28))),  # (height, width): multiples of 28 stay
    ((42, 56), 100, ((42, 56), (56, 56))),  # padded up to 28
    ((100, 150), 100, ((100, 150), (112, 168))),
    ((10, 5), 100, ((10, 5), (28, 28))),  # tiny: one merged block
    ((560, 700), 100, ((280, 350), (280, 364))),  # max_patches 500: 40 x 50 patches scaled by sqrt(500 / 2000)
    ((560, 700), 20, ((224, 280), (224, 280))),  # the side limit first: 20 patches of 14 over 700 pixels
    ((2000, 100), 20, ((280, 14), (280, 28))),
])
def test_fit_size(size, side, fit):
    cfg = ProcessorConfig(max_patches=500, max_patches_per_side=side)
    assert fit_size(*size, cfg) == fit


def test_pixels_are_the_normalised_padded_patches():
    image = random_image(30, 20, seed=3)  # 20 x 30 pixels: padded to 28 x 56, 2 x 4 patches, 2 tokens
    processed = ImageProcessor(ProcessorConfig(image_mean=(0.4, 0.5, 0.6), image_std=(0.2, 0.3, 0.4))).preprocess(image)
    assert processed.grid == (1, 2, 4) and processed.num_tokens == 2 and processed.pixels.shape == (8, 3, 14, 14)
    canvas = np.zeros((28, 56, 3), dtype=np.float32)
    canvas[:20, :30] = np.asarray(image, dtype=np.float32) / 255
    canvas = (canvas - np.array([0.4, 0.5, 0.6])) / np.array([0.2, 0.3, 0.4])
    for n in range(8):
        r, c = divmod(n, 4)
        want = canvas[14 * r:14 * r + 14, 14 * c:14 * c + 14].transpose(2, 0, 1)
        assert np.allclose(processed.pixels[n].numpy(), want, atol=1e-6)


def test_resized_images_use_pillow_bicubic():
    image = random_image(700, 560, seed=4)
    processed = ImageProcessor(ProcessorConfig(max_patches=500, max_patches_per_side=100)).preprocess(image)
    resized = np.asarray(image.resize((350, 280), Image.Resampling.BICUBIC), dtype=np.float32) / 255
    assert processed.grid == (1, 20, 26)
    assert np.allclose(processed.pixels[0].numpy(), ((resized[:14, :14] - 0.5) / 0.5).transpose(2, 0, 1), atol=1e-6)


def test_config_from_either_naming(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        '{"media_proc_cfg": {"in_patch_limit": 1024, "patch_limit_on_one_side": 64, "image_mean": [0.1, 0.2, 0.3]}}')
    cfg = ProcessorConfig.from_checkpoint(tmp_path, VISION)
    assert (cfg.max_patches, cfg.max_patches_per_side, cfg.image_mean) == (1024, 64, (0.1, 0.2, 0.3))
    (tmp_path / "preprocessor_config.json").write_text('{"max_patches": 99, "size": {"max_height": 7}, "patch_size": 16}')
    with pytest.raises(ValueError, match="patch_size 16 differs"):
        ProcessorConfig.from_checkpoint(tmp_path, VISION)


def test_against_transformers_processor():
    """transformers' Kimi_K25ImageProcessor (torchvision backend): equal pixels where no resize happens;
    a resized image differs by the two bicubic filters only (Pillow's vs torchvision's)."""
    pytest.importorskip("torchvision", reason="transformers' image processor needs torchvision, which PyPI's "
                        "wheels cannot import beside the CPU build of torch 2.13 (CI); the GPU image has it")
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    theirs = Kimi_K25ImageProcessor(max_patches=500, size={"max_height": 100, "max_width": 100})
    ours = ImageProcessor(ProcessorConfig(max_patches=500, max_patches_per_side=100))
    for (w, h), resized in (((30, 20), False), ((150, 100), False), ((700, 560), True)):
        image = random_image(w, h, seed=w)
        want = theirs(image, return_tensors="pt")
        got = ours.preprocess(image)
        assert list(want["image_grid_thw"][0]) == list(got.grid)
        err = (want["pixel_values"] - got.pixels).abs().max()
        assert err <= (0.1 if resized else 1e-5), err


def _input(n: int, tag: str = "a") -> ImageInput:
    return ImageInput(tag, torch.zeros(4 * n, 3, 14, 14), (1, 2, 2 * n), n)


def test_placeholders_expand_per_image():
    ids, placed = place_images([1, 9, 2, 9, 3], [_input(2), _input(3, "b")], 9)
    assert ids == [1, 9, 9, 2, 9, 9, 9, 3]
    assert [(p.offset, p.end) for p in placed] == [(1, 3), (4, 7)]
    again, _ = place_images(ids, [_input(2), _input(3, "b")], 9)  # already expanded: kept
    assert again == ids
    with pytest.raises(ImageError, match="2 image\\(s\\) given but the prompt has 1"):
        place_images([1, 9, 2], [_input(2), _input(3)], 9)
    with pytest.raises(ImageError, match="0 image placeholder"):
        place_images([1, 2], [_input(2)], 9)
    with pytest.raises(ImageError, match="3 tokens long"):
        place_images([9, 9, 9], [_input(2)], 9)


def test_chat_image_parts_become_placeholders_in_order():
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a "},
                                             {"type": "image_url", "image_url": {"url": "data:x"}},
                                             {"type": "text", "text": " b "}, {"type": "image_pil", "image_pil": "P"}]}]
    out, images = split_images(messages, "<img>")
    assert out[1]["content"] == "a <img> b <img>" and out[0] == messages[0] and images == ["data:x", "P"]
    with pytest.raises(ImageError, match="reads no images"):
        split_images(messages, None, "deepseek_v4")
    with pytest.raises(ImageError, match="unsupported content part 'audio'"):
        split_images([{"role": "user", "content": [{"type": "audio"}]}], "<img>")


def test_feature_cache_is_lru_by_rows():
    cache = FeatureCache(capacity_tokens=5)
    cache.put("a", torch.zeros(2, 4))
    cache.put("b", torch.zeros(2, 4))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", torch.zeros(2, 4))  # 6 rows > 5: b goes
    assert "b" not in cache and "a" in cache and "c" in cache and cache.num_tokens == 4
    cache.put("big", torch.zeros(9, 4))  # larger than the capacity: kept alone
    assert len(cache) == 1 and "big" in cache
