"""Kimi K2.5 (kimi_k25) against transformers' Kimi_K25ForConditionalGeneration, float32: the encoder's
features per image, the logits of prompts with one and several images of several sizes and aspect
ratios (below and above the 8 x 8 position grid, padded and not), greedy decoding after an image, a
prefill chunked through an image, and a clip of frames through the encoder (its temporal terms), in
both checkpoint layouts (the release names and what transformers' save_pretrained writes)."""

from __future__ import annotations

import pytest
import torch

from dayzero.models import load_model
from dayzero.multimodal.placeholders import place_images
from dayzero.multimodal.processor import ImageProcessor
from tests.models.helpers import positions, rel_err
from tests.models.kimi_k25_checkpoints import build_kimi_k25_checkpoint, load_reference, random_image

SIZES = [(28, 56), (56, 42), (150, 100), (70, 28)]  # (width, height): 2 x 4 patches ... 12 x 8 (past the grid)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = build_kimi_k25_checkpoint(tmp_path_factory.mktemp("k25"), layout="release", seed=3)
    ours = load_model(path, dtype=torch.float32, progress=False)
    return ours, load_reference(path), ImageProcessor.from_checkpoint(path, ours.spec.vision)


def test_transformers_layout_loads_the_same_weights(models, tmp_path):
    """What transformers' save_pretrained writes (text layers as `blocks`, the patch embedding under
    `vision_tower.encoder.`, `model.mm_projector.pre_norm`) loads into the same tensors as the release."""
    path = build_kimi_k25_checkpoint(tmp_path, layout="transformers", seed=3)
    other = load_model(path, dtype=torch.float32, progress=False)
    mine = models[0].state_dict()
    theirs = other.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def _prompt(model, images, seed=0, between=5):
    """Random text with one placeholder per image between runs of `between` tokens, expanded."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for _ in images:
        ids += torch.randint(0, model.image_token_id, (between,), generator=g).tolist() + [model.image_token_id]
    ids += torch.randint(0, model.image_token_id, (between,), generator=g).tolist()
    ids, _ = place_images(ids, images, model.image_token_id)
    return torch.tensor([ids])


def _reference_inputs(images):
    return {"pixel_values": torch.cat([im.pixels for im in images]),
            "image_grid_thw": torch.tensor([list(im.grid) for im in images])}


def _features(model, images):
    return torch.cat(model.encode_images(torch.cat([im.pixels for im in images]), tuple(im.grid for im in images)))


@pytest.mark.parametrize("which", [[0], [2], [1, 3], [0, 1, 2, 3]], ids=["one", "wide-grid", "two", "four"])
def test_logits_equal_transformers(models, which):
    ours, ref, processor = models
    images = [processor.preprocess(random_image(*SIZES[i], seed=i)) for i in which]
    ids = _prompt(ours, images)
    with torch.no_grad():
        per_image = ours.encode_images(torch.cat([im.pixels for im in images]), tuple(im.grid for im in images))
        theirs = ref.model.get_image_features(**_reference_inputs(images)).pooler_output
        got = ours(ids, positions(ids), image_features=torch.cat(per_image))
        want = ref(input_ids=ids, **_reference_inputs(images)).logits
    assert [f.shape[0] for f in per_image] == [im.num_tokens for im in images]
    for a, b in zip(per_image, theirs):
        assert rel_err(a, b) <= 1e-5
    err = rel_err(got, want)
    print(f"{len(images)} image(s), {ids.shape[1]} tokens: max relative logits error {err:.2e}")
    assert err <= 1e-4


def test_greedy_decode_after_images_equals_transformers(models):
    ours, ref, processor = models
    images = [processor.preprocess(random_image(*SIZES[i], seed=10 + i)) for i in (1, 2)]
    ids, steps = _prompt(ours, images, seed=1), 5
    with torch.no_grad():
        cache = ours.new_cache(1)
        logits = [ours(ids, positions(ids), cache, image_features=_features(ours, images))[0, -1]]
        tokens = [int(logits[-1].argmax())]
        for _ in range(steps - 1):
            nxt = torch.tensor([[tokens[-1]]])
            logits.append(ours(nxt, positions(nxt, cache.length), cache)[0, -1])
            tokens.append(int(logits[-1].argmax()))
        want = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **_reference_inputs(images),
                            max_new_tokens=steps, min_new_tokens=steps,
                            do_sample=False, pad_token_id=0)
        full = ref(input_ids=want[:, :-1], **_reference_inputs(images)).logits[0, ids.shape[1] - 1:]
    assert tokens == want[0, ids.shape[1]:].tolist()
    assert rel_err(torch.stack(logits), full) <= 1e-4


def test_prefill_chunked_through_an_image(models):
    """Two prefill chunks that cut the image's placeholders: each chunk gets its rows of the features."""
    ours, _, processor = models
    image = processor.preprocess(random_image(*SIZES[2], seed=4))
    ids = _prompt(ours, [image], seed=2)
    features = _features(ours, [image])
    placeholder = (ids[0] == ours.image_token_id).nonzero().squeeze(1)
    cut = int(placeholder[image.num_tokens // 2])
    with torch.no_grad():
        full = ours(ids, positions(ids), image_features=features)
        cache = ours.new_cache(1)
        first = ours(ids[:, :cut], positions(ids[:, :cut]), cache, image_features=features[:image.num_tokens // 2])
        second = ours(ids[:, cut:], positions(ids[:, cut:], cut), cache, image_features=features[image.num_tokens // 2:])
    assert rel_err(torch.cat([first, second], dim=1), full) <= 1e-5


def test_clip_of_frames_through_the_encoder(models):
    """t > 1 frames: the time sin/cos on every patch, attention over the whole clip, the merge averaged over
    frames (the path of Kimi K2.5's video chunks), against transformers' vision tower and projector."""
    ours, ref, _ = models
    p = ours.spec.vision.patch_size
    grids = ((3, 4, 6), (1, 2, 2))
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, 3, p, p, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = torch.cat(ours.encode_images(pixels, grids))
        tower = ref.model.vision_tower(pixels, grid_thw=torch.tensor(grids))
        want = ref.model.mm_projector(tower.pooler_output)
    assert got.shape == (6 + 1, ours.spec.hidden_size)
    assert rel_err(got, want.reshape(got.shape)) <= 1e-5


def test_placeholders_and_features_must_agree(models):
    ours, _, processor = models
    image = processor.preprocess(random_image(28, 56))
    ids = _prompt(ours, [image])
    with pytest.raises(ValueError, match="placeholder tokens"):
        ours(ids, positions(ids), image_features=_features(ours, [image])[:1])
