"""Randomized fidelity per family: tiny configs drawn from a seeded generator, each model written by
transformers' save_pretrained (and with its in-memory names) and in the release layout, loaded by
dayzero and compared with transformers' full forward at the prefill and at every decode step
(tests/models/fidelity.py). Prompts are longer than every top-k, window, compression ratio and KDA
chunk of their config, and the decode steps cross window and compression boundaries.

Release layouts are written as the releases ship: DeepSeek-V3 / V3.2 FP8 with 128x128 block scales
(float32 / ue8m0) and bf16 elsewhere, gpt-oss MXFP4 experts, Kimi Linear bf16 with the dense MLP
under `mlp.`, DeepSeek-V4 under DeepSeek's names (bf16: its FP8 / FP4 formats are tested in
test_deepseek_v4.py). The reference model holds exactly the values those formats store (rounded to
bf16, FP8 or MXFP4 first), so all layouts carry the same weights.

DAYZERO_TEST_SWEEP=1 runs 12 configs per family instead of 3.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero.formats import mxfp4
from dayzero.formats.fp8 import dequantize_weight_blocks, quantize_weight_blocks
from tests.models.fidelity import check_fidelity, choice, reference_model, save_transformers_layouts, seeds

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

FP8_BLOCK = (128, 128)


@pytest.fixture(autouse=True)
def _private_rng():
    with torch.random.fork_rng():
        yield


def _write(folder: Path, state: dict[str, torch.Tensor], config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return folder


def _saved(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())


def _round_to_bf16(model, keep: tuple[str, ...] = ()) -> None:
    """Every float tensor of the reference rounded to bf16 (the release dtype), except names ending in `keep`."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point() and not name.endswith(keep):
                t.copy_(t.bfloat16().float())


def _as_shipped(t: torch.Tensor) -> torch.Tensor:
    """bf16 where the value is a bf16 value (what _round_to_bf16 rounded), float32 where it is kept."""
    return t.bfloat16() if t.is_floating_point() and torch.equal(t.bfloat16().float(), t.float()) else t


def _legacy_rope(config: dict) -> dict:
    """transformers 5's `rope_parameters` as the Hub's configs write rope: `rope_theta` + `rope_scaling`."""
    rope = dict(config.pop("rope_parameters", None) or {})
    config["rope_theta"] = rope.pop("rope_theta", 10000.0)
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    return config


def _yarn(rng: random.Random, original: int) -> dict:
    return {"rope_type": "yarn", "factor": choice(rng, [2.0, 4.0, 8.0]), "original_max_position_embeddings": original,
            "beta_fast": choice(rng, [32.0, 1.0]), "beta_slow": 1.0}


def _routing(rng: random.Random, experts: int) -> dict:
    """Group-limited top-k that can always pick top_k experts from the chosen groups."""
    n_group = choice(rng, [g for g in (1, 2, 4) if experts % g == 0 and experts // g >= 2])
    topk_group = rng.randint(1, n_group)
    top_k = rng.randint(1, min(4, topk_group * experts // n_group))
    return dict(n_group=n_group, topk_group=topk_group, num_experts_per_tok=top_k)


# -- DeepSeek-V3 / Kimi-K2 / DeepSeek-V3.2 ---------------------------------------------------------

_NOT_FP8 = re.compile(r"(embed_tokens|lm_head|mlp\.gate\.weight|indexer\.weights_proj|norm)")


def _deepseek_config(rng: random.Random, v32: bool, prompt_len: int, decode_steps: int) -> dict:
    heads = choice(rng, [2, 4, 8])
    experts = choice(rng, [4, 8, 16])
    config = dict(
        vocab_size=choice(rng, [128, 256]), hidden_size=choice(rng, [64, 128]), intermediate_size=choice(rng, [64, 96]),
        moe_intermediate_size=128,  # FP8 experts: gate and up rows in whole 128-row blocks
        num_hidden_layers=rng.randint(2, 3), first_k_dense_replace=rng.randint(0, 1), num_attention_heads=heads,
        num_key_value_heads=heads, q_lora_rank=choice(rng, [24, 48] if v32 else [None, 24, 48]),
        kv_lora_rank=choice(rng, [16, 32, 64]), qk_nope_head_dim=choice(rng, [8, 16, 32]),
        qk_rope_head_dim=choice(rng, [8, 16]), v_head_dim=choice(rng, [8, 16, 32]), n_routed_experts=experts,
        n_shared_experts=rng.randint(0, 2), routed_scaling_factor=round(rng.uniform(1.0, 2.5), 3),
        norm_topk_prob=rng.random() < 0.7, attention_bias=rng.random() < 0.3, max_position_embeddings=512,
        rms_norm_eps=1e-6, **_routing(rng, experts),
    )
    theta = choice(rng, [10000.0, 50000.0])
    config["rope_parameters"] = ({"rope_type": "default", "rope_theta": theta} if rng.random() < 0.4 else
                                 {**_yarn(rng, 32), "rope_theta": theta, "mscale": 1.0, "mscale_all_dim": choice(rng, [0.0, 1.0])})
    if v32:  # top-k below the prompt, inside the decode steps, or above the whole sequence
        config.update(index_n_heads=choice(rng, [2, 4, 8]), index_head_dim=choice(rng, [16, 32, 64]),
                      index_topk=choice(rng, [prompt_len // 3, prompt_len + decode_steps // 2, prompt_len + decode_steps + 4]))
        config["index_head_dim"] = max(config["index_head_dim"], config["qk_rope_head_dim"])
    return config


def _fp8_round_trip(model, scale_format: str) -> None:
    """The reference's FP8-shipped matrices replaced by their FP8 values (128x128 blocks)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            stacked = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            if stacked or (name.endswith(".weight") and p.dim() == 2 and not _NOT_FP8.search(name)):
                q, s = quantize_weight_blocks(p, FP8_BLOCK, scale_format)
                p.copy_(dequantize_weight_blocks(q, s, FP8_BLOCK, torch.float32))


def _deepseek_release(saved: Path, out: Path, scale_format: str, model_type: str) -> Path:
    """The release layout: transformers' save_pretrained names, FP8 + `weight_scale_inv`, bf16, the Hub's config fields."""
    state, config = _saved(saved)
    release = {}
    for name, t in state.items():
        if name.endswith(".weight") and t.dim() == 2 and not _NOT_FP8.search(name):
            release[name], release[name + "_scale_inv"] = quantize_weight_blocks(t, FP8_BLOCK, scale_format)
        else:
            release[name] = t if name.endswith("e_score_correction_bias") else t.bfloat16()
    config = _legacy_rope(config)
    config.update(model_type=model_type, scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
                  quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                       "weight_block_size": list(FP8_BLOCK),
                                       **({"scale_fmt": "ue8m0"} if scale_format == "ue8m0" else {})})
    return _write(out, release, config)


@pytest.mark.parametrize("seed", seeds())
@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v32"])
def test_deepseek_v3_family(tmp_path, model_type, seed):
    rng = random.Random(f"{model_type}-{seed}")
    v32 = model_type == "deepseek_v32"
    prompt_len, decode_steps = rng.randint(12, 40), 6
    config = _deepseek_config(rng, v32, prompt_len, decode_steps)
    print(f"\n{model_type} seed {seed}: {config}")
    model = reference_model(model_type, config, seed)
    _round_to_bf16(model, keep=("e_score_correction_bias",))
    scale_format = "ue8m0" if v32 else "float32"
    _fp8_round_trip(model, scale_format)
    dirs = save_transformers_layouts(model, tmp_path)
    release_type = "kimi_k2" if not v32 and seed % 2 else model_type  # Kimi-K2 ships DeepSeek-V3's layout
    dirs["release"] = _deepseek_release(dirs["transformers"], tmp_path / "release", scale_format, release_type)
    check_fidelity(model, dirs, prompt_len, decode_steps, seed, detected_as={"transformers": "release"})


# -- DeepSeek-V4 -----------------------------------------------------------------------------------

def _deepseek_v4_config(rng: random.Random) -> tuple[dict, int, int]:
    heads = choice(rng, [2, 4])
    head_dim = choice(rng, [32, 64])
    o_groups = choice(rng, [g for g in (1, 2) if heads % g == 0])
    csa, hca = choice(rng, [2, 4]), choice(rng, [8, 16])
    window = choice(rng, [4, 8, 16])
    layers = rng.randint(3, 5)
    kinds = ["compressed_sparse_attention", "heavily_compressed_attention"]
    layer_types = kinds + [choice(rng, kinds + ["sliding_attention"]) for _ in range(layers - 2)]
    rng.shuffle(layer_types)
    experts = choice(rng, [4, 8])
    index_topk = choice(rng, [2, 4, 8])
    # the prompt holds more compressed entries than top-k and more tokens than the window and one HCA
    # entry; it ends 3 tokens before a multiple of the HCA ratio, so decoding completes an HCA entry
    shortest = max(window, hca, csa * index_topk) + 4
    prompt_len = (shortest // hca + 1 + rng.randint(0, 2)) * hca - 3
    config = dict(
        vocab_size=choice(rng, [128, 256]), hidden_size=choice(rng, [64, 128]), num_hidden_layers=layers,
        num_attention_heads=heads, head_dim=head_dim, qk_rope_head_dim=choice(rng, [8, 16]),
        q_lora_rank=choice(rng, [16, 32]), o_groups=o_groups, o_lora_rank=choice(rng, [16, 32]),
        layer_types=layer_types, compress_rates={"compressed_sparse_attention": csa, "heavily_compressed_attention": hca},
        # few indexer heads make exact score ties common (every head's ReLU 0): both sides rank them by
        # entry index (check_fidelity patches transformers' indexer as `dayzero verify` does)
        index_n_heads=choice(rng, [2, 4, 8, 16]), index_head_dim=choice(rng, [16, 32]), index_topk=index_topk,
        sliding_window=window, hc_mult=choice(rng, [2, 3, 4]), hc_sinkhorn_iters=choice(rng, [3, 20]),
        n_routed_experts=experts, num_experts_per_tok=rng.randint(1, min(3, experts)), n_shared_experts=1,
        moe_intermediate_size=choice(rng, [16, 32]), mlp_layer_types=None, swiglu_limit=choice(rng, [5.0, 10.0]),
        routed_scaling_factor=round(rng.uniform(1.0, 2.5), 3), max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=10000.0, compress_rope_theta=choice(rng, [40000.0, 160000.0]),
    )
    n_hash = rng.randint(0, 2)
    config["mlp_layer_types"] = ["hash_moe"] * n_hash + ["moe"] * (layers - n_hash)
    if rng.random() < 0.5:
        config["rope_parameters"] = _yarn(rng, 64)
    return config, prompt_len, 8


def _v4_release_name(name: str) -> str:
    """transformers' save_pretrained name -> DeepSeek's (the inverse of what transformers' own
    conversion mapping renames; checked by transformers loading the result)."""
    name = re.sub(r"^model\.embed_tokens\.", "embed.", name)
    name = re.sub(r"^model\.hc_head\.hc_", "hc_head_", name)
    name = re.sub(r"^model\.", "", name)
    return re.sub(r"\.attn\.norm\.weight$", ".attn.kv_norm.weight", name)


@pytest.mark.parametrize("seed", seeds())
def test_deepseek_v4(tmp_path, seed):
    rng = random.Random(f"deepseek_v4-{seed}")
    config, prompt_len, decode_steps = _deepseek_v4_config(rng)
    print(f"\ndeepseek_v4 seed {seed}, prompt {prompt_len}: {config}")
    model = reference_model("deepseek_v4", config, seed)
    float32 = ("hc_fn", "hc_base", "hc_scale", "hc.fn", "hc.base", "hc.scale", "sinks", "position_bias",
               "e_score_correction_bias")
    _round_to_bf16(model, keep=float32)
    dirs = save_transformers_layouts(model, tmp_path)
    state, saved_config = _saved(dirs["transformers"])
    release = {_v4_release_name(n): _as_shipped(t) for n, t in state.items()}
    dirs["release"] = _write(tmp_path / "release", release, saved_config)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(dirs["release"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info  # the names transformers reads
    check_fidelity(model, dirs, prompt_len, decode_steps, seed)


# -- gpt-oss ---------------------------------------------------------------------------------------

def _gpt_oss_config(rng: random.Random) -> tuple[dict, int]:
    heads = choice(rng, [2, 4, 8])
    window = choice(rng, [4, 8, 16])
    layers = rng.randint(2, 4)
    experts = choice(rng, [4, 8])
    config = dict(
        vocab_size=choice(rng, [128, 256]), hidden_size=choice(rng, [64, 96, 128]), intermediate_size=choice(rng, [32, 64]),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=choice(rng, [k for k in (1, 2, heads) if heads % k == 0]),
        head_dim=choice(rng, [8, 16, 32]), num_local_experts=experts, num_experts_per_tok=rng.randint(1, min(4, experts)),
        sliding_window=window, swiglu_limit=choice(rng, [3.0, 7.0]), max_position_embeddings=4096,
        layer_types=[choice(rng, ["sliding_attention", "full_attention"]) for _ in range(layers)],
        rope_parameters={**_yarn(rng, 32), "rope_theta": choice(rng, [10000.0, 150000.0]), "truncate": rng.random() < 0.5},
    )
    return config, window + rng.randint(4, 30)


@pytest.mark.parametrize("seed", seeds())
def test_gpt_oss(tmp_path, seed):
    rng = random.Random(f"gpt_oss-{seed}")
    config, prompt_len = _gpt_oss_config(rng)
    print(f"\ngpt_oss seed {seed}, prompt {prompt_len}: {config}")
    model = reference_model("gpt_oss", config, seed)
    _round_to_bf16(model)
    with torch.no_grad():  # experts: pre-activations past the SwiGLU clamp, then MXFP4 values as shipped
        for layer in model.model.layers:
            e = layer.mlp.experts
            e.gate_up_proj.mul_(5)
            for w in (e.gate_up_proj, e.down_proj):  # [E, K, N], x @ W; MXFP4 blocks run along K
                w.copy_(mxfp4.dequantize(*mxfp4.quantize(w.transpose(1, 2).contiguous()), dtype=torch.float32).transpose(1, 2))
    dirs = save_transformers_layouts(model, tmp_path)
    state, saved_config = _saved(dirs["transformers"])
    release = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            release[name + "_blocks"], release[name + "_scales"] = mxfp4.quantize(t.transpose(1, 2).contiguous())
        else:
            release[name] = t.bfloat16()
    saved_config = _legacy_rope(saved_config)
    saved_config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    dirs["release"] = _write(tmp_path / "release", release, saved_config)
    check_fidelity(model, dirs, prompt_len, 8, seed, detected_as={"transformers": "release", "transformers in-memory": "release"})


# -- Kimi Linear -----------------------------------------------------------------------------------

def _kimi_config(rng: random.Random) -> tuple[dict, int]:
    heads = choice(rng, [2, 4])
    layers = rng.randint(2, 4)
    kinds = ["linear_attention", "full_attention"]
    layer_types = kinds + [choice(rng, kinds) for _ in range(layers - 2)]
    rng.shuffle(layer_types)
    experts = choice(rng, [4, 8, 16])
    routing = _routing(rng, experts)
    kda_heads, kda_dim = choice(rng, [1, 2, 4]), choice(rng, [8, 16, 32])
    config = dict(
        vocab_size=choice(rng, [128, 256]), hidden_size=choice(rng, [64, 96]), intermediate_size=choice(rng, [64, 128]),
        moe_intermediate_size=choice(rng, [16, 32]), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, kv_lora_rank=choice(rng, [16, 32]), q_lora_rank=choice(rng, [None, 24]),
        qk_nope_head_dim=choice(rng, [8, 16]), qk_rope_head_dim=choice(rng, [4, 8]), v_head_dim=choice(rng, [8, 16]),
        num_experts=experts, num_experts_per_token=routing["num_experts_per_tok"], num_shared_experts=rng.randint(1, 2),
        num_expert_group=routing["n_group"], topk_group=routing["topk_group"], moe_renormalize=rng.random() < 0.7,
        routed_scaling_factor=round(rng.uniform(1.0, 2.5), 3), first_k_dense_replace=rng.randint(0, 1),
        rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"full_attn_layers": [i + 1 for i, t in enumerate(layer_types) if t == "full_attention"],
                            "kda_layers": [i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"],
                            "num_heads": kda_heads, "head_dim": kda_dim, "short_conv_kernel_size": choice(rng, [2, 3, 4])},
    )
    return config, rng.randint(70, 140)  # past one KDA chunk (64)


_KIMI_FLOAT32 = ("gate.weight", "e_score_correction_bias", "dt_bias", "A_log")


@pytest.mark.parametrize("seed", seeds())
def test_kimi_linear(tmp_path, seed):
    rng = random.Random(f"kimi_linear-{seed}")
    config, prompt_len = _kimi_config(rng)
    print(f"\nkimi_linear seed {seed}, prompt {prompt_len}: {config}")
    model = reference_model("kimi_linear", config, seed)
    _round_to_bf16(model, keep=_KIMI_FLOAT32)
    dirs = save_transformers_layouts(model, tmp_path)
    state, saved_config = _saved(dirs["transformers"])
    release = {}
    for name, t in state.items():  # the released names: the dense layers' MLP under `mlp.`
        name = re.sub(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r".mlp.\1.", name)
        release[name] = _as_shipped(t)
    saved_config.update(mla_use_nope=True, moe_router_activation_func="sigmoid", use_grouped_topk=True, moe_layer_freq=1)
    dirs["release"] = _write(tmp_path / "release", release, saved_config)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(dirs["release"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    same = {"transformers": "release"} if not config["first_k_dense_replace"] else None  # no dense MLP to rename
    check_fidelity(model, dirs, prompt_len, 6, seed, detected_as=same)
