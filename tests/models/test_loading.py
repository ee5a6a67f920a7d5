"""load_model's errors: unknown families, families recognised but without a model file, and a
checkpoint whose tensors do not match the model (all named before any data is read)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero.models import load_model
from dayzero.spec import UnsupportedModelError
from dayzero.weights import MissingTensorError, TensorShapeError
from tests.models.gpt_oss_checkpoints import build_gpt_oss_checkpoint
from tests.spec.tiny_configs import make_config, save_config


def test_unknown_model_type_names_the_field(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(UnsupportedModelError, match="'llama' for config field 'model_type'"):
        load_model(tmp_path)


def test_recognised_family_without_a_model_file_is_named(tmp_path, monkeypatch):
    import dayzero.models as models

    models._import_families()
    monkeypatch.delitem(models.MODELS, "kimi_k25")  # every recognised family has a model file now: drop one
    save_config(make_config("kimi_k25"), tmp_path)
    with pytest.raises(UnsupportedModelError, match="'kimi_k25' for config field 'model_type'") as info:
        load_model(tmp_path)
    assert "gpt_oss" in str(info.value)  # lists what can be loaded


def _rewrite(path, edit):
    shard = next(path.glob("*.safetensors"))
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def test_a_missing_tensor_is_named_with_its_file(tmp_path):
    path = build_gpt_oss_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.sinks"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.sinks"):
        load_model(path, dtype=torch.float32, progress=False)


def test_a_wrong_shape_is_named(tmp_path):
    path = build_gpt_oss_checkpoint(tmp_path)
    name = "model.layers.0.mlp.experts.down_proj_scales"
    _rewrite(path, lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()))
    with pytest.raises(TensorShapeError, match=name):
        load_model(path, dtype=torch.float32, progress=False)
