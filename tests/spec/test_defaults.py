"""A field missing from config.json means what transformers' config class makes of it.

For every family transformers has, a tiny config's `to_dict()` loses one field at a time; load_spec
of what is left must equal load_spec of what transformers' config class rebuilds from it (the same
spec, or the same refused field), and the diff-only config save_pretrained writes reads as the full
one. So a checkpoint whose config.json omits fields (as transformers' own save does for every field
at its default) is read with the defaults the reference applies.
"""

from __future__ import annotations

import pytest

from dayzero.spec import UnsupportedModelError, load_spec

from .tiny_configs import make_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

FAMILIES = ("deepseek_v3", "deepseek_v32", "deepseek_v4", "gpt_oss", "kimi_linear", "kimi_k25", "glm4_moe", "qwen3_5_moe")


def _outcome(cfg: dict):
    """The spec load_spec builds, or the field it refuses."""
    try:
        return load_spec(cfg)
    except UnsupportedModelError as e:
        return ("refused", e.field)


def _rebuilt(model_type: str, cfg: dict) -> dict | None:
    """transformers' config class applied to cfg (None when the class itself rejects it)."""
    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version")}
    try:
        return transformers.AutoConfig.for_model(model_type, **kwargs).to_dict()
    except Exception:  # noqa: BLE001  (ValueError, TypeError, huggingface_hub's validation errors)
        return None


def _removals(model_type: str):
    full = make_config(model_type).to_dict()
    for key in sorted(set(full) - {"model_type"}):
        yield full, None, key
    if model_type in ("kimi_k25", "qwen3_5_moe"):  # the text tower's fields too
        for key in sorted(full["text_config"]):
            if key != "model_type":
                yield full, "text_config", key


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_missing_field_takes_transformers_default(model_type):
    checked = 0
    for full, within, key in _removals(model_type):
        cfg = {**full, within: {k: v for k, v in full[within].items() if k != key}} if within else \
            {k: v for k, v in full.items() if k != key}
        rebuilt = _rebuilt(model_type, cfg)
        if rebuilt is None:
            continue
        assert _outcome(cfg) == _outcome(rebuilt), f"{model_type}: config without {within + '.' if within else ''}{key}"
        checked += 1
    assert checked > 20


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_config_save_pretrained_writes_reads_as_the_full_one(model_type):
    cfg = make_config(model_type)
    diff = {**cfg.to_diff_dict(), "model_type": cfg.model_type}
    assert _outcome(diff) == _outcome(cfg.to_dict())


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v4", "gpt_oss", "kimi_linear", "glm4_moe"])
def test_an_almost_empty_config_is_the_reference_default_model(model_type):
    """Only model_type and a few layers: every other field is transformers' default (full-size dims)."""
    ours = _outcome({"model_type": model_type, "num_hidden_layers": 2})
    assert ours == _outcome(_rebuilt(model_type, {"num_hidden_layers": 2}))
    assert not isinstance(ours, tuple), ours  # the reference's own defaults are runnable
