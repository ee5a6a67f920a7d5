"""Tensor layouts: rules over the catalogue, pieces read straight from disk, choosing a layout."""

import pytest
import torch
from safetensors.torch import save_file

from dayzero.weights import (Checkpoint, Chunk, Layout, MissingTensorError, Rename, TensorShapeError, TensorSpec,
                             Unstack, iter_tensors, match_layout)


@pytest.fixture
def stored():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.experts.gate_up_proj": torch.randn(3, 10, 8, generator=g),  # [E, 2I, H]
        "model.layers.0.experts.down_proj": torch.randn(3, 8, 5, generator=g).to(torch.float8_e4m3fn),
        "model.layers.0.conv.weight": torch.randn(6, 1, 4, generator=g).bfloat16(),
    }


@pytest.fixture
def checkpoint(tmp_path, stored):
    save_file(stored, tmp_path / "model.safetensors")
    return Checkpoint.open(tmp_path)


LAYOUT = Layout("stacked", "experts.gate_up_proj", (
    Rename(r"^model\.", ""),
    Unstack(r"\.experts\.(gate_up_proj|down_proj)$", r".experts.{i}.\1"),
    Chunk(r"\.experts\.(\d+)\.gate_up_proj$", (r".experts.\1.w1", r".experts.\1.w3")),
    Chunk(r"\.conv\.weight$", (".q_conv.weight", ".k_conv.weight", ".v_conv.weight")),
    Rename(r"\.embed_tokens\.", ".embed."),  # matches nothing: the earlier rule removed the dot before it
))


def test_rules_map_names_and_cut_pieces_along_dim0(checkpoint, stored):
    mapped = LAYOUT.apply(checkpoint)
    assert set(mapped.tensors) == {
        "embed_tokens.weight", *(f"layers.0.experts.{i}.{w}" for i in range(3) for w in ("w1", "w3", "down_proj")),
        *(f"layers.0.{x}_conv.weight" for x in "qkv")}
    w1 = mapped.tensors["layers.0.experts.2.w1"]
    assert (w1.shape, w1.stored_as) == ((5, 8), "model.layers.0.experts.gate_up_proj")
    assert "(stored as model.layers.0.experts.gate_up_proj)" in w1.where
    assert mapped.tensors["embed_tokens.weight"].stored_as == "model.embed_tokens.weight"
    read = dict(iter_tensors(mapped, progress=False))
    gate_up = stored["model.layers.0.experts.gate_up_proj"]
    for i in range(3):
        assert torch.equal(read[f"layers.0.experts.{i}.w1"], gate_up[i, :5])
        assert torch.equal(read[f"layers.0.experts.{i}.w3"], gate_up[i, 5:])
        assert torch.equal(read[f"layers.0.experts.{i}.down_proj"].view(torch.uint8),
                           stored["model.layers.0.experts.down_proj"][i].view(torch.uint8))
    assert torch.equal(read["layers.0.k_conv.weight"], stored["model.layers.0.conv.weight"][2:4])
    assert checkpoint.tensors["model.embed_tokens.weight"].stored_as is None  # the checkpoint itself is unchanged


def test_a_chunk_that_does_not_divide_leaves_the_tensor(checkpoint):
    odd = Layout("odd", "", (Chunk(r"\.conv\.weight$", ("a", "b", "c", "d")),))
    assert "model.layers.0.conv.weight" in odd.apply(checkpoint).tensors


def test_the_first_layout_that_fits_is_chosen(checkpoint):
    expected = {name: TensorSpec() for name in LAYOUT.apply(checkpoint).tensors}
    release = Layout("release", "as stored")
    layout, mapped = match_layout(checkpoint, (release, LAYOUT), expected, family="toy")
    assert layout is LAYOUT and set(mapped.tensors) == set(expected)
    layout, _ = match_layout(checkpoint, (release, LAYOUT), {n: TensorSpec() for n in checkpoint.tensors}, family="toy")
    assert layout is release


def test_no_fitting_layout_lists_each_and_raises_the_closest(checkpoint):
    expected = {name: TensorSpec() for name in LAYOUT.apply(checkpoint).tensors}
    expected["layers.0.experts.0.w1"] = TensorSpec((4, 8))
    expected["layers.0.extra"] = TensorSpec()
    with pytest.raises(MissingTensorError) as info:
        match_layout(checkpoint, (Layout("release", "as stored"), LAYOUT), expected, family="toy")
    message = str(info.value)
    assert message.startswith(f"Checkpoint {checkpoint.path} matches none of the tensor layouts toy loads:")
    assert "\n  release (as stored): 14 missing, 4 unexpected; e.g. missing embed_tokens.weight, unexpected" in message
    assert "\n  stacked (experts.gate_up_proj): 1 missing, 1 wrong shape" in message
    assert "Closest is stacked: 1 missing, 1 wrong shape" in message
    assert {type(p) for p in info.value.problems} == {MissingTensorError, TensorShapeError}


def test_one_layout_keeps_the_plain_schema_error(checkpoint):
    with pytest.raises(MissingTensorError, match="does not match the model: 1 missing, 4 unexpected"):
        match_layout(checkpoint, (Layout("release", ""),), {"absent": TensorSpec()}, family="toy")
