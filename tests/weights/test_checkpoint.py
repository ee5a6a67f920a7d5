import json

import pytest
import torch
from safetensors.torch import save_file

from dayzero.weights import (Checkpoint, CorruptCheckpointError, NoWeightsError, TensorSpec,
                             load_state_dict)


def write_sharded(path, shards: dict[str, dict[str, torch.Tensor]], weight_map=None):
    """Shards {file name: tensors} plus an index mapping each tensor to its shard."""
    for file, tensors in shards.items():
        save_file(tensors, path / file)
    if weight_map is None:
        weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def two_shards():
    return {
        "model-00001-of-00002.safetensors": {"embed.weight": torch.randn(8, 4),
                                             "layers.0.weight": torch.randn(4, 4)},
        "model-00002-of-00002.safetensors": {"layers.1.weight": torch.randn(4, 4).bfloat16(),
                                             "head.weight": torch.randn(8, 4)},
    }


def test_transformers_sharded_checkpoint(tiny_llama):
    path, state_dict = tiny_llama
    checkpoint = Checkpoint.open(path)
    assert checkpoint.layout == "sharded"
    assert len(checkpoint.files) == 3
    assert set(checkpoint.tensors) == set(state_dict)
    assert checkpoint.total_bytes == sum(t.numel() * t.element_size() for t in state_dict.values())
    assert checkpoint.bytes_by_dtype() == {"BF16": checkpoint.total_bytes}

    expected = {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in state_dict.items()}
    loaded = load_state_dict(path, expected=expected)
    assert loaded.keys() == state_dict.keys()
    for name, tensor in state_dict.items():
        assert torch.equal(loaded[name], tensor), name


def test_single_file_and_file_path(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for path in (tmp_path, tmp_path / "model.safetensors"):
        checkpoint = Checkpoint.open(path)
        assert checkpoint.layout == "single"
        assert checkpoint.metadata == {"format": "pt"}
        assert checkpoint.total_bytes == 4 * 17
    loaded = load_state_dict(tmp_path / "model.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_sharded_index(tmp_path):
    shards = two_shards()
    write_sharded(tmp_path, shards)
    checkpoint = Checkpoint.open(tmp_path)
    assert [f.name for f in checkpoint.files] == sorted(shards)
    assert list(checkpoint.tensors)[:2] == ["embed.weight", "layers.0.weight"]  # file order
    assert checkpoint.bytes_by_dtype() == {"F32": 4 * (32 + 16 + 32), "BF16": 2 * 16}
    assert "2 file(s), 4 tensors" in checkpoint.summary()
    # The index file itself is also a valid path.
    assert Checkpoint.open(tmp_path / "model.safetensors.index.json").tensors.keys() == \
        checkpoint.tensors.keys()
    loaded = load_state_dict(tmp_path)
    for tensors in shards.values():
        assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_directory_of_files_without_index(tmp_path):
    save_file({"a": torch.randn(2)}, tmp_path / "consolidated-00001.safetensors")
    save_file({"b": torch.randn(3)}, tmp_path / "consolidated-00002.safetensors")
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.layout == "directory"
    assert list(checkpoint.tensors) == ["a", "b"]


def test_index_points_at_missing_shard(tmp_path):
    write_sharded(tmp_path, two_shards())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CorruptCheckpointError, match="model-00002-of-00002.safetensors") as info:
        Checkpoint.open(tmp_path)
    assert "does not exist" in str(info.value)
    assert info.value.file == tmp_path / "model-00002-of-00002.safetensors"
    assert info.value.tensor in ("layers.1.weight", "head.weight")


def test_tensor_in_index_missing_from_its_shard(tmp_path):
    shards = two_shards()
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    weight_map["layers.2.weight"] = "model-00002-of-00002.safetensors"
    write_sharded(tmp_path, shards, weight_map)
    with pytest.raises(CorruptCheckpointError, match="layers.2.weight") as info:
        Checkpoint.open(tmp_path)
    assert "model-00002-of-00002.safetensors" in str(info.value)
    assert info.value.tensor == "layers.2.weight"


def test_index_names_the_wrong_shard(tmp_path):
    shards = two_shards()
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    weight_map["head.weight"] = "model-00001-of-00002.safetensors"
    write_sharded(tmp_path, shards, weight_map)
    with pytest.raises(CorruptCheckpointError, match="it is in .*model-00002-of-00002"):
        Checkpoint.open(tmp_path)


def test_tensor_in_two_shards(tmp_path):
    shards = two_shards()
    shards["model-00002-of-00002.safetensors"]["embed.weight"] = torch.randn(8, 4)
    write_sharded(tmp_path, shards)
    with pytest.raises(CorruptCheckpointError, match="embed.weight is present in two files") as info:
        Checkpoint.open(tmp_path)
    assert "model-00001-of-00002.safetensors" in str(info.value)
    assert "model-00002-of-00002.safetensors" in str(info.value)
    assert info.value.tensor == "embed.weight"


def test_tensor_in_two_files_without_index(tmp_path):
    save_file({"a": torch.randn(2)}, tmp_path / "part1.safetensors")
    save_file({"a": torch.randn(2)}, tmp_path / "part2.safetensors")
    with pytest.raises(CorruptCheckpointError, match="a is present in two files"):
        Checkpoint.open(tmp_path)


def test_malformed_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CorruptCheckpointError, match="model.safetensors.index.json.*weight_map"):
        Checkpoint.open(tmp_path)


def test_config_only_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NoWeightsError) as info:
        Checkpoint.open(tmp_path)
    message = str(info.value)
    assert "No weights found" in message
    assert "model.safetensors.index.json" in message and "*.safetensors" in message
    assert "config.json" in message
    assert info.value.file == tmp_path


def test_other_weight_format_is_named(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(NoWeightsError, match="pytorch_model.bin.*convert"):
        Checkpoint.open(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(NoWeightsError, match="does not exist"):
        Checkpoint.open(tmp_path / "nope")
