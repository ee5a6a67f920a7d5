import pytest
import torch
from safetensors.torch import save_file

import dayzero.weights.loader as loader
from dayzero.weights import (Checkpoint, MissingTensorError, TensorDtypeError, TensorShapeError,
                             TensorSpec, UnexpectedTensorError, WeightsError, check_schema,
                             find_problems, iter_tensors, load_state_dict)

TENSORS = {
    "embed.weight": (torch.randn(16, 8).bfloat16()),
    "layers.0.attn.q.weight": torch.randn(8, 8).bfloat16(),
    "layers.0.mlp.experts.w1": torch.randint(0, 256, (4, 8, 4), dtype=torch.uint8),
    "layers.0.mlp.experts.w1_scale": torch.randint(0, 256, (4, 8, 1), dtype=torch.uint8).view(
        torch.float8_e8m0fnu),
}


@pytest.fixture
def checkpoint(tmp_path):
    save_file(TENSORS, tmp_path / "model.safetensors")
    return Checkpoint.open(tmp_path)


def schema() -> dict[str, TensorSpec]:
    return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in TENSORS.items()}


@pytest.fixture
def no_reads(monkeypatch):
    """Fail the test if any tensor data is read."""
    def read_tensor(f, info):
        raise AssertionError(f"read {info.name} before the schema was checked")
    monkeypatch.setattr(loader, "read_tensor", read_tensor)


def test_matching_schema(checkpoint):
    assert find_problems(checkpoint, schema()) == []
    loaded = load_state_dict(checkpoint, expected=schema())
    assert loaded.keys() == TENSORS.keys()


def test_wildcards(checkpoint):
    expected = schema()
    expected["embed.weight"] = TensorSpec((None, 8), torch.bfloat16)
    expected["layers.0.attn.q.weight"] = TensorSpec()
    check_schema(checkpoint, expected)


def test_missing_tensor(checkpoint, no_reads):
    expected = schema() | {"layers.1.attn.q.weight": TensorSpec((8, 8), torch.bfloat16)}
    with pytest.raises(MissingTensorError, match="layers.1.attn.q.weight") as info:
        iter_tensors(checkpoint, expected=expected)
    assert "shape (8, 8), bfloat16" in str(info.value)
    assert str(checkpoint.path) in str(info.value)
    assert info.value.tensor == "layers.1.attn.q.weight"


def test_unexpected_tensor(checkpoint, no_reads):
    expected = schema()
    del expected["embed.weight"]
    with pytest.raises(UnexpectedTensorError, match="embed.weight in .*model.safetensors") as info:
        iter_tensors(checkpoint, expected=expected)
    assert "allow_unexpected" in str(info.value)
    assert info.value.tensor == "embed.weight"
    assert info.value.file == checkpoint.files[0]


def test_unexpected_tensor_allowed_or_ignored_is_not_read(tmp_path, monkeypatch):
    tensors = TENSORS | {"layers.0.attn.rotary_emb.inv_freq": torch.randn(4)}
    save_file(tensors, tmp_path / "model.safetensors")
    read = []
    original = loader.read_tensor
    monkeypatch.setattr(loader, "read_tensor", lambda f, info: read.append(info.name) or original(f, info))

    loaded = load_state_dict(tmp_path, expected=schema(), ignore_unexpected=[r"rotary_emb\.inv_freq$"])
    assert loaded.keys() == TENSORS.keys()
    assert load_state_dict(tmp_path, expected=schema(), allow_unexpected=True).keys() == TENSORS.keys()
    assert "layers.0.attn.rotary_emb.inv_freq" not in read
    with pytest.raises(UnexpectedTensorError, match="inv_freq"):
        load_state_dict(tmp_path, expected=schema(), ignore_unexpected=[r"^bias$"])


def test_wrong_shape(checkpoint, no_reads):
    expected = schema()
    expected["layers.0.mlp.experts.w1"] = TensorSpec((4, 8, 8), torch.uint8)
    with pytest.raises(TensorShapeError) as info:
        iter_tensors(checkpoint, expected=expected)
    message = str(info.value)
    assert "layers.0.mlp.experts.w1 in" in message and "model.safetensors" in message
    assert "expected shape (4, 8, 8), found (4, 8, 4)" in message
    assert info.value.file == checkpoint.files[0]


def test_wrong_rank(checkpoint):
    expected = schema()
    expected["embed.weight"] = TensorSpec((16, 8, None))
    with pytest.raises(TensorShapeError, match=r"expected shape \(16, 8, \?\), found \(16, 8\)"):
        check_schema(checkpoint, expected)


def test_wrong_dtype(checkpoint, no_reads):
    expected = schema()
    expected["layers.0.mlp.experts.w1_scale"] = TensorSpec((4, 8, 1), torch.float8_e4m3fn)
    with pytest.raises(TensorDtypeError) as info:
        iter_tensors(checkpoint, expected=expected)
    message = str(info.value)
    assert "layers.0.mlp.experts.w1_scale in" in message and "model.safetensors" in message
    assert "expected dtype float8_e4m3fn, found float8_e8m0fnu (F8_E8M0)" in message
    assert info.value.tensor == "layers.0.mlp.experts.w1_scale"


def test_all_problems_reported_at_once(checkpoint, no_reads):
    expected = {
        "embed.weight": TensorSpec((16, 9), torch.bfloat16),
        "layers.0.attn.q.weight": TensorSpec((8, 8), torch.float16),
        "layers.0.mlp.experts.w1": TensorSpec((4, 8, 4), torch.uint8),
        "layers.0.mlp.experts.w2": TensorSpec((4, 4, 8), torch.uint8),
    }
    with pytest.raises(WeightsError) as info:
        iter_tensors(checkpoint, expected=expected)
    error = info.value
    assert isinstance(error, MissingTensorError)  # the most serious kind comes first
    assert [type(p) for p in error.problems] == [
        MissingTensorError, TensorShapeError, TensorDtypeError, UnexpectedTensorError]
    message = str(error)
    assert "1 missing, 1 wrong shape, 1 wrong dtype, 1 unexpected" in message
    for name in ("embed.weight", "layers.0.attn.q.weight", "layers.0.mlp.experts.w2",
                 "layers.0.mlp.experts.w1_scale"):
        assert name in message


def test_long_problem_lists_are_capped(checkpoint):
    expected = schema() | {f"layers.{i}.weight": TensorSpec() for i in range(50)}
    with pytest.raises(MissingTensorError) as info:
        check_schema(checkpoint, expected)
    assert len(info.value.problems) == 50
    assert "... and 30 more" in str(info.value)
    assert "layers.49.weight" not in str(info.value)


def test_dtype_alternatives_accept_any_listed_float(tmp_path):
    from safetensors.torch import save_file

    from dayzero.weights import FLOAT_DTYPES, Checkpoint, TensorDtypeError, TensorSpec, check_schema

    save_file({"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.int8)}, tmp_path / "model.safetensors")
    ckpt = Checkpoint.open(tmp_path)
    check_schema(ckpt, {"a": TensorSpec((2,), FLOAT_DTYPES), "b": TensorSpec((2,), torch.int8)})
    with pytest.raises(TensorDtypeError, match="b in .*expected dtype float16 or bfloat16 or float32 or float64, found int8"):
        check_schema(ckpt, {"a": TensorSpec((2,), FLOAT_DTYPES), "b": TensorSpec((2,), FLOAT_DTYPES)})
