import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dayzero import settings
from dayzero.demo import DEMO_VERSION, build_demo_checkpoint, demo_checkpoint
from dayzero.formats import fp8, mxfp4

# deepseek-ai/DeepSeek-V4-Flash config.json
REAL_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}


def expected_layout(c: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor DeepSeek-V4 ships for config `c` (no MTP layer)."""
    h, hc, v = c["hidden_size"], c["hc_mult"], c["vocab_size"]
    out = {}

    def fp8_linear(name, n, k):
        out[f"{name}.weight"] = ("F8_E4M3", (n, k))
        out[f"{name}.scale"] = ("F8_E8M0", (math.ceil(n / 128), math.ceil(k / 128)))

    def fp4_linear(name, n, k):
        out[f"{name}.weight"] = ("I8", (n, k // 2))
        out[f"{name}.scale"] = ("F8_E8M0", (n, k // 32))

    def compressor(name, dim, ratio):
        width = 2 * dim if ratio == 4 else dim
        out[f"{name}.wkv.weight"] = ("BF16", (width, h))
        out[f"{name}.wgate.weight"] = ("BF16", (width, h))
        out[f"{name}.norm.weight"] = ("BF16", (dim,))
        out[f"{name}.ape"] = ("F32", (ratio, width))

    out["embed.weight"] = ("BF16", (v, h))
    out["head.weight"] = ("BF16", (v, h))
    out["norm.weight"] = ("BF16", (h,))
    out["hc_head_fn"] = ("F32", (hc, hc * h))
    out["hc_head_base"] = ("F32", (hc,))
    out["hc_head_scale"] = ("F32", (1,))
    heads, hd, q, inter = c["num_attention_heads"], c["head_dim"], c["q_lora_rank"], c["moe_intermediate_size"]
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}"
        out[f"{p}.attn_norm.weight"] = ("BF16", (h,))
        out[f"{p}.ffn_norm.weight"] = ("BF16", (h,))
        for site in ("attn", "ffn"):
            out[f"{p}.hc_{site}_fn"] = ("F32", ((2 + hc) * hc, hc * h))
            out[f"{p}.hc_{site}_base"] = ("F32", ((2 + hc) * hc,))
            out[f"{p}.hc_{site}_scale"] = ("F32", (3,))
        fp8_linear(f"{p}.attn.wq_a", q, h)
        fp8_linear(f"{p}.attn.wq_b", heads * hd, q)
        fp8_linear(f"{p}.attn.wkv", hd, h)
        fp8_linear(f"{p}.attn.wo_a", c["o_groups"] * c["o_lora_rank"], heads * hd // c["o_groups"])
        fp8_linear(f"{p}.attn.wo_b", h, c["o_groups"] * c["o_lora_rank"])
        out[f"{p}.attn.q_norm.weight"] = ("BF16", (q,))
        out[f"{p}.attn.kv_norm.weight"] = ("BF16", (hd,))
        out[f"{p}.attn.attn_sink"] = ("F32", (heads,))
        ratio = c["compress_ratios"][i]
        if ratio:
            compressor(f"{p}.attn.compressor", hd, ratio)
        if ratio == 4:
            fp8_linear(f"{p}.attn.indexer.wq_b", c["index_n_heads"] * c["index_head_dim"], q)
            out[f"{p}.attn.indexer.weights_proj.weight"] = ("BF16", (c["index_n_heads"], h))
            compressor(f"{p}.attn.indexer.compressor", c["index_head_dim"], ratio)
        out[f"{p}.ffn.gate.weight"] = ("BF16", (c["n_routed_experts"], h))
        if i < c["num_hash_layers"]:
            out[f"{p}.ffn.gate.tid2eid"] = ("I64", (v, c["num_experts_per_tok"]))
        else:
            out[f"{p}.ffn.gate.bias"] = ("F32", (c["n_routed_experts"],))
        for e in range(c["n_routed_experts"]):
            fp4_linear(f"{p}.ffn.experts.{e}.w1", inter, h)
            fp4_linear(f"{p}.ffn.experts.{e}.w2", h, inter)
            fp4_linear(f"{p}.ffn.experts.{e}.w3", inter, h)
        fp8_linear(f"{p}.ffn.shared_experts.w1", inter, h)
        fp8_linear(f"{p}.ffn.shared_experts.w2", h, inter)
        fp8_linear(f"{p}.ffn.shared_experts.w3", inter, h)
    return out


@pytest.fixture(scope="module")
def config(demo_dir):
    return json.loads((demo_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def tensors(demo_dir):
    state = {}
    for shard in sorted(demo_dir.glob("*.safetensors")):
        state.update(load_file(shard))
    return state


def test_config_exercises_every_v4_feature(config):
    assert config["model_type"] == "deepseek_v4"
    assert config["architectures"] == ["DeepseekV4ForCausalLM"]
    assert config["quantization_config"] == REAL_QUANTIZATION_CONFIG
    assert config["expert_dtype"] == "fp4"
    assert len(config["compress_ratios"]) == config["num_hidden_layers"]
    assert set(config["compress_ratios"]) == {0, 4, 128}  # sliding, CSA, HCA
    assert 0 < config["num_hash_layers"] < config["num_hidden_layers"]  # hash-routed and score-routed MoE
    assert config["hc_mult"] > 1
    assert config["index_topk"] < 64 // 4  # a 64-token prompt already makes the indexer choose
    # FP4 packs 32 values along K per scale; FP8 dims are <= 128 or whole 128-blocks (see checkpoint.py)
    for dim in ("hidden_size", "moe_intermediate_size"):
        assert config[dim] % 32 == 0
        assert config[dim] <= 128 or config[dim] % 128 == 0


def test_tensors_have_the_real_names_dtypes_and_shapes(demo_dir, config):
    layout = expected_layout(config)
    found = {}
    for shard in sorted(demo_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                found[name] = (tensor.get_dtype(), tuple(tensor.get_shape()))
    assert found == layout


def test_index_maps_every_tensor_to_its_shard(demo_dir, tensors):
    index = json.loads((demo_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    for shard in set(index["weight_map"].values()):
        names = [n for n, s in index["weight_map"].items() if s == shard]
        assert set(load_file(demo_dir / shard)) == set(names)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())


def test_fp8_weights_use_ue8m0_block_scales(tensors):
    names = [n[: -len(".scale")] for n, t in tensors.items() if n.endswith(".scale") and t.ndim == 2]
    fp8_names = [n for n in names if tensors[f"{n}.weight"].dtype == torch.float8_e4m3fn]
    assert len(fp8_names) > 20
    for name in fp8_names:
        w, scale = tensors[f"{name}.weight"], tensors[f"{name}.scale"]
        assert scale.dtype == torch.float8_e8m0fnu
        dense = fp8.dequantize_weight_blocks(w, scale, dtype=torch.float32)
        assert torch.isfinite(dense).all() and dense.std() > 0
        # a UE8M0 scale rounds amax/448 up to a power of two: each block's largest code lies in (224, 448]
        amax = w.float().abs().unflatten(0, (scale.shape[0], -1)).amax(1).unflatten(-1, (scale.shape[1], -1)).amax(-1)
        assert ((amax > 224) & (amax <= 448)).all(), name


def test_fp4_experts_are_packed_int8_with_ue8m0_scales_per_32(tensors, config):
    experts = [n[: -len(".weight")] for n in tensors if ".experts." in n and n.endswith(".weight")]
    assert len(experts) == config["num_hidden_layers"] * config["n_routed_experts"] * 3
    for name in experts:
        w, scale = tensors[f"{name}.weight"], tensors[f"{name}.scale"]
        assert w.dtype == torch.int8 and scale.dtype == torch.float8_e8m0fnu
        assert scale.shape == (w.shape[0], w.shape[1] * 2 // 32)
        dense = mxfp4.dequantize_deepseek_v4(w, scale, dtype=torch.float32)
        assert torch.isfinite(dense).all() and dense.std() > 0


def test_hash_routing_table_names_distinct_experts(tensors, config):
    for i in range(config["num_hash_layers"]):
        table = tensors[f"layers.{i}.ffn.gate.tid2eid"]
        assert table.min() >= 0 and table.max() < config["n_routed_experts"]
        assert (table.sort(-1).values.diff(dim=-1) > 0).all()


def test_build_is_byte_identical(tmp_path, demo_dir):
    build_demo_checkpoint(tmp_path)
    files = sorted(p.name for p in demo_dir.iterdir())
    assert files == sorted(p.name for p in tmp_path.iterdir())
    for name in files:
        assert (tmp_path / name).read_bytes() == (demo_dir / name).read_bytes(), name


def test_demo_checkpoint_builds_once_under_the_cache(tmp_path):
    with settings.override(cache_dir=tmp_path):
        first = demo_checkpoint()
        assert first == tmp_path / f"demo-v{DEMO_VERSION}"
        stamp = (first / "config.json").stat().st_mtime_ns
        assert demo_checkpoint() == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging directory left behind


def test_demo_checkpoint_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "other.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match="holds no demo checkpoint"):
        demo_checkpoint(tmp_path)


def test_transformers_loads_and_runs_the_checkpoint(demo_dir, tensors, config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # On CPU transformers dequantizes FP8 and FP4 to BF16 while loading.
    model, info = AutoModelForCausalLM.from_pretrained(demo_dir, output_loading_info=True)
    assert not any(info.values()), info
    state = model.state_dict()
    q_b = fp8.dequantize_weight_blocks(tensors["layers.0.attn.wq_b.weight"], tensors["layers.0.attn.wq_b.scale"])
    assert torch.equal(state["model.layers.0.self_attn.q_b_proj.weight"], q_b)
    last = config["num_hidden_layers"] - 1
    w1 = mxfp4.dequantize_deepseek_v4(tensors[f"layers.{last}.ffn.experts.3.w1.weight"],
                                      tensors[f"layers.{last}.ffn.experts.3.w1.scale"])
    assert torch.equal(state[f"model.layers.{last}.mlp.experts.gate_up_proj"][3, : w1.shape[0]], w1)

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    ids = tokenizer("The lighthouse keeper climbed the stairs to light the lamp. " * 12, return_tensors="pt").input_ids
    assert ids.shape[1] > 128  # one HCA entry, many CSA entries for the indexer to choose among
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all() and logits.float().std() > 0


def test_concurrent_builders_agree_with_this_process(tmp_path, demo_dir):
    script = "from dayzero.demo import demo_checkpoint; print(demo_checkpoint())"
    env = {**os.environ, "DAYZERO_CACHE": str(tmp_path)}
    repo = Path(__file__).parents[2]
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, cwd=repo, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    built = tmp_path / f"demo-v{DEMO_VERSION}"
    assert outputs == {str(built)}
    assert [p.name for p in tmp_path.iterdir()] == [built.name]
    for path in demo_dir.iterdir():  # other processes (other hash seeds) write the same bytes
        assert (built / path.name).read_bytes() == path.read_bytes(), path.name
