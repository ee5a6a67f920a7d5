"""Quantized checkpoints under transformers' names load as their release layout does, and a
checkpoint that fits no layout is refused naming the layouts tried and the tensors at fault.

transformers (on CPU) dequantizes FP8 / FP4 / MXFP4 on load, so its own saves of these are float
(tests/models/test_fidelity.py loads those). On a GPU it keeps them quantized under the names its
conversion mapping gives: the release checkpoints built by the tests' builders are renamed here with
transformers' own renaming rules (`conversion_mapping`, applied by `core_model_loading`), its FP8
quantizer's `.scale` -> `.weight_scale_inv`, and its expert stacking (MergeModulelist + Concatenate:
gate_up_proj [E, 2I, ...], down_proj [E, H, ...]). Every variant must load bitwise the tensors the
release layout loads, and be detected as the layout it is.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero.models import load_model
from dayzero.weights import MissingTensorError, WeightsError
from tests.models.deepseek_checkpoints import build_deepseek_v3_checkpoint
from tests.models.deepseek_v4_checkpoints import build_deepseek_v4_checkpoint
from tests.models.fidelity import detected_layout
from tests.models.kimi_k3_checkpoints import build_kimi_k3_checkpoint

transformers = pytest.importorskip("transformers")


def _renamings(model_type: str, quantizer_scale: bool = False) -> list:
    """transformers' WeightRenaming rules of a family, in the order its loader applies them."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    rules = [] if not quantizer_scale else [WeightRenaming(r"^(.+)\.scale", r"\1.weight_scale_inv")]
    return rules + [t for t in get_checkpoint_conversion_mapping(model_type) or [] if isinstance(t, WeightRenaming)]


def _renamed(state: dict[str, torch.Tensor], rules: list, prefix: str = "") -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import apply_renamings

    return {prefix + apply_renamings(name, rules): t for name, t in state.items()}


def _stack_experts(state: dict[str, torch.Tensor], gate: str, up: str, down: str) -> dict[str, torch.Tensor]:
    """Per-expert `...experts.{j}.{gate|up|down}.weight[suffix]` -> `...experts.gate_up_proj[suffix]`
    (gate rows, then up rows, per expert) and `...experts.down_proj[suffix]`, as transformers holds them."""
    pattern = re.compile(rf"^(.*\.experts)\.(\d+)\.({gate}|{up}|{down})\.weight(\w*)$")
    groups: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    out = {}
    for name, t in state.items():
        m = pattern.match(name)
        if m is None:
            out[name] = t
            continue
        stem, j, proj, suffix = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        groups.setdefault((stem, proj, suffix), {})[j] = t
    for (stem, proj, suffix), by_expert in groups.items():
        if proj == up:
            continue
        experts = range(len(by_expert))
        if proj == gate:
            ups = groups[(stem, up, suffix)]
            out[f"{stem}.gate_up_proj{suffix}"] = torch.stack([torch.cat([by_expert[j], ups[j]]) for j in experts])
        else:
            out[f"{stem}.down_proj{suffix}"] = torch.stack([by_expert[j] for j in experts])
    return out


def _variant(release: Path, out: Path, convert) -> Path:
    out.mkdir(parents=True)
    shutil.copy(release / "config.json", out / "config.json")
    state = convert(load_file(release / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _assert_loads_as_release(release: Path, variants: dict[str, Path]) -> None:
    ref = load_model(release, dtype=torch.float32, progress=False)
    assert detected_layout(ref, release) == "release"
    want = ref.state_dict()
    for layout, path in variants.items():
        ours = load_model(path, dtype=torch.float32, progress=False)
        assert detected_layout(ours, path) == layout
        got = ours.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), layout


def test_deepseek_v3_fp8_experts_stacked(tmp_path):
    """FP8 experts as transformers holds them: gate_up_proj float8 [E, 2I, H] and gate_up_proj_scale_inv."""
    release = build_deepseek_v3_checkpoint(tmp_path, mtp=False)
    stacked = _variant(release, tmp_path / "in_memory",
                       lambda s: _stack_experts(s, "gate_proj", "up_proj", "down_proj"))
    assert load_file(stacked / "model.safetensors")["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    _assert_loads_as_release(release, {"transformers in-memory": stacked})


def test_deepseek_v4_fp8_and_fp4_under_transformers_names(tmp_path):
    """Both of transformers' V4 layouts with FP8 dense weights and FP4 experts: save_pretrained's
    (`model.` + DeepSeek's names) and the in-memory one (its module names, stacked experts), with
    scales named `.weight_scale_inv` as its FP8 quantizer names them, or `.scale` as released."""
    release = build_deepseek_v4_checkpoint(tmp_path / "release", mtp=True)
    mtp = lambda s: {k: v for k, v in s.items() if not k.startswith("mtp.")}  # noqa: E731  transformers drops MTP

    def saved(state):  # what save_pretrained writes: the release names under `model.`, but for these
        out = {}
        for name, t in mtp(state).items():
            name = {"embed.weight": "embed_tokens.weight", "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base",
                    "hc_head_scale": "hc_head.hc_scale"}.get(name, name)
            out[name if name == "head.weight" else "model." + re.sub(r"\.attn\.kv_norm\.", ".attn.norm.", name)] = t
        return out

    variants = {
        "transformers": _variant(release, tmp_path / "saved", saved),
        "transformers in-memory": _variant(release, tmp_path / "in_memory", lambda s: _stack_experts(
            _renamed(mtp(s), _renamings("deepseek_v4", quantizer_scale=True), "model."), "w1", "w3", "w2")),
    }
    names = load_file(variants["transformers in-memory"] / "model.safetensors")
    assert "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight_scale_inv" in names
    assert names["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.int8  # FP4 pairs, stacked
    _assert_loads_as_release(release, variants)


def test_kimi_k3_text_tower_under_transformers_names(tmp_path):
    """K3's text tower as transformers' kimi_linear writes it (dense MLP under `block_sparse_moe.`),
    and as a transformers wrapper holds it in memory (`model.language_model.`, `lm_head.`, every MLP
    `mlp.`, the KDA gate under `forget_gate.`, the three short convolutions in one `conv1d`)."""
    release = build_kimi_k3_checkpoint(tmp_path / "release")

    def in_memory(state):
        out = {}
        for name, t in _renamed(state, _renamings("kimi_linear")).items():
            name = re.sub(r"^language_model\.model\.", "model.language_model.", name)
            out[re.sub(r"^language_model\.lm_head\.", "lm_head.", name)] = t
        for name in [n for n in out if n.endswith("self_attn.q_conv1d.weight")]:
            stem = name[: -len("q_conv1d.weight")]
            out[stem + "conv1d.weight"] = torch.cat([out.pop(f"{stem}{x}_conv1d.weight") for x in "qkv"])
        return out

    variants = {
        "transformers": _variant(release, tmp_path / "saved", lambda s: {
            re.sub(r"\.mlp\.(gate|up|down)_proj\.", r".block_sparse_moe.\1_proj.", k): v for k, v in s.items()}),
        "transformers in-memory": _variant(release, tmp_path / "in_memory", in_memory),
    }
    assert "model.language_model.layers.0.self_attn.forget_gate.A_log" in load_file(
        variants["transformers in-memory"] / "model.safetensors")
    _assert_loads_as_release(release, variants)


def test_a_checkpoint_in_no_layout_names_the_layouts_and_the_tensors(tmp_path):
    release = build_deepseek_v4_checkpoint(tmp_path / "release")

    def broken(state):  # transformers' names, one tensor misnamed
        out = {"model." + k: v for k, v in state.items() if k not in ("embed.weight", "head.weight")}
        out["model.embed_tokens.weight"], out["lm_head.weight"] = state["embed.weight"], state["head.weight"]
        out["model.layers.0.attn.wq_a.weights"] = out.pop("model.layers.0.attn.wq_a.weight")
        return out

    path = _variant(release, tmp_path / "broken", broken)
    with pytest.raises(MissingTensorError) as info:
        load_model(path, dtype=torch.float32, progress=False)
    message = str(info.value)
    assert "matches none of the tensor layouts deepseek_v4 loads" in message
    for layout in ("release", "transformers", "transformers in-memory"):
        assert f"\n  {layout} (" in message
    assert "Closest is transformers: 1 missing, 1 unexpected" in message
    assert "layers.0.attn.wq_a.weight: expected by the model" in message
    assert "model.layers.0.attn.wq_a.weights" in message
    assert [type(p).__name__ for p in info.value.problems] == ["MissingTensorError", "UnexpectedTensorError"]


def test_a_wrong_shape_under_transformers_names_names_the_stored_tensor(tmp_path):
    """A stacked tensor of the wrong size: the error names the model's tensor and the stored one."""
    release = build_deepseek_v3_checkpoint(tmp_path, mtp=False, fp8=False)

    def stacked(state):
        out = _stack_experts(state, "gate_proj", "up_proj", "down_proj")
        out["model.layers.1.mlp.experts.down_proj"] = out["model.layers.1.mlp.experts.down_proj"][:, :, :-1].contiguous()
        return out

    path = _variant(release, tmp_path / "in_memory", stacked)
    with pytest.raises(WeightsError) as info:
        load_model(path, dtype=torch.float32, progress=False)
    assert "model.layers.1.mlp.experts.0.down_proj.weight (stored as model.layers.1.mlp.experts.down_proj)" in str(info.value)
    assert json.loads((path / "config.json").read_text())["model_type"] == "deepseek_v3"
