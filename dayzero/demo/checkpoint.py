"""The demo checkpoint: a tiny DeepSeek-V4 with random weights in the layout DeepSeek ships on Hugging Face.

Everything that makes V4 V4 is kept, only smaller: shared-KV MQA with attention sinks, sliding-window,
CSA (compressor + lightning indexer + top-k) and HCA layers, hc_mult = 4 hyper-connection streams,
hash-routed and score-routed MoE layers, FP8 dense weights and FP4 routed experts.

On-disk layout, as deepseek-ai/DeepSeek-V4-Flash ships it (names have no `model.` prefix):

    embed.weight, head.weight                  BF16 [vocab, hidden]
    norm.weight                                BF16 [hidden]
    hc_head_fn / hc_head_base / hc_head_scale  F32  [hc, hc*hidden] / [hc] / [1]
    layers.{i}.attn_norm.weight, .ffn_norm.weight                  BF16 [hidden]
    layers.{i}.hc_{attn,ffn}_fn / _base / _scale                   F32  [(2+hc)*hc, hc*hidden] / [(2+hc)*hc] / [3]
    layers.{i}.attn.{wq_a,wq_b,wkv,wo_a,wo_b}.weight               F8_E4M3 [N, K]
    layers.{i}.attn.{wq_a,wq_b,wkv,wo_a,wo_b}.scale                F8_E8M0 [ceil(N/128), ceil(K/128)]
    layers.{i}.attn.q_norm.weight, .kv_norm.weight                 BF16 [q_lora_rank], [head_dim]
    layers.{i}.attn.attn_sink                                      F32  [heads]
    layers.{i}.attn.compressor.{wkv,wgate}.weight                  BF16 [c*head_dim, hidden], c = 2 for CSA, 1 for HCA
    layers.{i}.attn.compressor.norm.weight, .ape                   BF16 [head_dim], F32 [ratio, c*head_dim]
    layers.{i}.attn.indexer.wq_b.weight / .scale                   F8_E4M3 [index_heads*index_head_dim, q_lora_rank]
    layers.{i}.attn.indexer.weights_proj.weight                    BF16 [index_heads, hidden]
    layers.{i}.attn.indexer.compressor.{wkv,wgate}.weight          BF16 [2*index_head_dim, hidden]
    layers.{i}.attn.indexer.compressor.norm.weight, .ape           BF16 [index_head_dim], F32 [ratio, 2*index_head_dim]
    layers.{i}.ffn.gate.weight                                     BF16 [experts, hidden]
    layers.{i}.ffn.gate.tid2eid (hash layers)                      I64  [vocab, top_k]
    layers.{i}.ffn.gate.bias (other layers)                        F32  [experts]
    layers.{i}.ffn.experts.{e}.{w1,w3}.weight / .scale             I8 [inter, hidden/2] / F8_E8M0 [inter, hidden/32]
    layers.{i}.ffn.experts.{e}.w2.weight / .scale                  I8 [hidden, inter/2] / F8_E8M0 [hidden, inter/32]
    layers.{i}.ffn.shared_experts.{w1,w2,w3}.weight / .scale       F8_E4M3 with 128x128 F8_E8M0 scales

Compressor and indexer entries exist only where `compress_ratios[i]` is 4 (CSA, with indexer) or 128
(HCA); 0 is a sliding-window-only layer. FP8: e4m3 values, one power-of-two (UE8M0) scale per 128x128
block, value = fp8 * scale. FP4: E2M1 pairs packed into int8 (even element in the low nibble), one
UE8M0 scale per 32 values along K. Sources: transformers `conversion_mapping.py` ("deepseek_v4") and
`integrations/finegrained_fp8.py`; DeepSeek's `inference/model.py`; published tensor indexes of the
Flash checkpoint. The real checkpoint also carries one MTP layer (`mtp.0.*`, plus a trailing entry in
`compress_ratios`); the demo has none (`num_nextn_predict_layers: 0`).

Every matrix dimension is either at most 128 or a multiple of 128: transformers' FP8 dequantizer
derives the block size as dim / scale-grid size, which is wrong for a partial block after full ones.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from dayzero import settings
from dayzero.demo.tokenizer import save_tokenizer
from dayzero.formats import fp8, mxfp4

DEMO_VERSION = 2  # bump whenever the files written here change, so caches rebuild (2: tools in the chat template)
SEED = 0
FP8_BLOCK = (128, 128)
SHARD_COUNT = 2

QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": list(FP8_BLOCK),
}

# config.json fields as DeepSeek-V4-Flash names them; sizes shrunk, `vocab_size` set from the tokenizer.
DEMO_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "compress_ratios": [0, 4, 128, 4],  # sliding, CSA, HCA, CSA
    "compress_rope_theta": 160000,
    "expert_dtype": "fp4",
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 128,
    "index_head_dim": 32,
    "index_n_heads": 4,
    "index_topk": 4,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hash_layers": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 0,
    "o_groups": 2,
    "o_lora_rank": 128,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 16,
    "quantization_config": QUANTIZATION_CONFIG,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 32,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
}  # plus "vocab_size": the tokenizer's size rounded up to a multiple of 128


def cache_root() -> Path:
    return settings.get().cache_dir


def demo_checkpoint(path: str | os.PathLike | None = None) -> Path:
    """Directory holding the demo checkpoint, built on first use.

    Default location: `$DAYZERO_CACHE/demo-v{DEMO_VERSION}` (`~/.cache/dayzero` without the variable).
    The build goes to a temporary sibling directory that is renamed into place when complete, so
    concurrent callers see either nothing or the whole checkpoint; a loser of the race discards its copy.
    """
    target = Path(path) if path is not None else cache_root() / f"demo-v{DEMO_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build_demo_checkpoint(staging)
        staging.chmod(0o755)  # mkdtemp makes it private
        try:
            staging.rename(target)  # atomic; also replaces an empty directory at target
        except OSError as e:
            if not (target / "config.json").is_file():
                raise FileExistsError(
                    f"{target} exists and holds no demo checkpoint (no config.json); remove it or pass another path"
                ) from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_demo_checkpoint(out_dir: str | os.PathLike) -> Path:
    """Write the demo checkpoint into `out_dir`: config.json, tokenizer files, two safetensors shards
    and their index. Deterministic: the same files, byte for byte, on every call."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = save_tokenizer(out_dir)
    config = dict(DEMO_CONFIG, vocab_size=-(-vocab_size // 128) * 128)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _write_shards(out_dir, demo_state_dict(config))
    return out_dir


def demo_state_dict(config: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, in on-disk names and dtypes, drawn from a fixed seed."""
    gen = torch.Generator().manual_seed(SEED)
    hidden, vocab, hc = config["hidden_size"], config["vocab_size"], config["hc_mult"]
    state = {
        "embed.weight": _normal(gen, (vocab, hidden), 1.0).bfloat16(),
        "hc_head_fn": _normal(gen, (hc, hc * hidden), (hc * hidden) ** -0.5),
        "hc_head_base": _normal(gen, (hc,), 0.1),
        "hc_head_scale": _uniform(gen, (1,), 0.5, 1.5),
    }
    for layer in range(config["num_hidden_layers"]):
        state.update(_layer(gen, config, layer))
    state["norm.weight"] = _norm_weight(gen, hidden)
    state["head.weight"] = _normal(gen, (vocab, hidden), hidden**-0.5).bfloat16()
    return state


def _layer(gen: torch.Generator, config: dict, layer: int) -> dict[str, torch.Tensor]:
    hidden, hc = config["hidden_size"], config["hc_mult"]
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    q_lora, groups = config["q_lora_rank"], config["o_groups"]
    p = f"layers.{layer}"
    out = {
        f"{p}.attn_norm.weight": _norm_weight(gen, hidden),
        f"{p}.ffn_norm.weight": _norm_weight(gen, hidden),
    }
    for site in ("attn", "ffn"):
        mix = (2 + hc) * hc  # pre [hc], post [hc], comb [hc, hc]
        out[f"{p}.hc_{site}_fn"] = _normal(gen, (mix, hc * hidden), (hc * hidden) ** -0.5)
        out[f"{p}.hc_{site}_base"] = _normal(gen, (mix,), 0.1)
        out[f"{p}.hc_{site}_scale"] = _uniform(gen, (3,), 0.5, 1.5)

    a = f"{p}.attn"
    out.update(_fp8_linear(gen, f"{a}.wq_a", q_lora, hidden))
    out[f"{a}.q_norm.weight"] = _norm_weight(gen, q_lora)
    out.update(_fp8_linear(gen, f"{a}.wq_b", heads * head_dim, q_lora))
    out.update(_fp8_linear(gen, f"{a}.wkv", head_dim, hidden))
    out[f"{a}.kv_norm.weight"] = _norm_weight(gen, head_dim)
    out.update(_fp8_linear(gen, f"{a}.wo_a", groups * config["o_lora_rank"], heads * head_dim // groups))
    out.update(_fp8_linear(gen, f"{a}.wo_b", hidden, groups * config["o_lora_rank"]))
    out[f"{a}.attn_sink"] = _normal(gen, (heads,), 0.5)

    ratio = config["compress_ratios"][layer]
    if ratio:
        out.update(_compressor(gen, f"{a}.compressor", hidden, head_dim, ratio))
    if ratio == 4:
        index_heads, index_dim = config["index_n_heads"], config["index_head_dim"]
        out.update(_fp8_linear(gen, f"{a}.indexer.wq_b", index_heads * index_dim, q_lora))
        out[f"{a}.indexer.weights_proj.weight"] = _normal(gen, (index_heads, hidden), hidden**-0.5).bfloat16()
        out.update(_compressor(gen, f"{a}.indexer.compressor", hidden, index_dim, ratio))

    f = f"{p}.ffn"
    experts, top_k, inter = config["n_routed_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]
    out[f"{f}.gate.weight"] = _normal(gen, (experts, hidden), hidden**-0.5).bfloat16()
    if layer < config["num_hash_layers"]:
        # top_k distinct experts per token id
        out[f"{f}.gate.tid2eid"] = torch.rand(config["vocab_size"], experts, generator=gen).argsort(-1)[:, :top_k]
    else:
        out[f"{f}.gate.bias"] = _normal(gen, (experts,), 0.1)
    for e in range(experts):
        out.update(_fp4_linear(gen, f"{f}.experts.{e}.w1", inter, hidden))
        out.update(_fp4_linear(gen, f"{f}.experts.{e}.w2", hidden, inter))
        out.update(_fp4_linear(gen, f"{f}.experts.{e}.w3", inter, hidden))
    shared = inter * config["n_shared_experts"]
    out.update(_fp8_linear(gen, f"{f}.shared_experts.w1", shared, hidden))
    out.update(_fp8_linear(gen, f"{f}.shared_experts.w2", hidden, shared))
    out.update(_fp8_linear(gen, f"{f}.shared_experts.w3", shared, hidden))
    return out


def _compressor(gen: torch.Generator, prefix: str, hidden: int, dim: int, ratio: int) -> dict[str, torch.Tensor]:
    width = 2 * dim if ratio == 4 else dim  # CSA keeps two overlapping series, HCA one
    return {
        f"{prefix}.wkv.weight": _normal(gen, (width, hidden), hidden**-0.5).bfloat16(),
        f"{prefix}.wgate.weight": _normal(gen, (width, hidden), hidden**-0.5).bfloat16(),
        f"{prefix}.norm.weight": _norm_weight(gen, dim),
        f"{prefix}.ape": _normal(gen, (ratio, width), 0.5),
    }


def _fp8_linear(gen: torch.Generator, prefix: str, n: int, k: int) -> dict[str, torch.Tensor]:
    """FP8 e4m3 weight [n, k] with a UE8M0 scale per 128x128 block."""
    w = _normal(gen, (n, k), k**-0.5)
    values, scale = fp8.quantize_weight_blocks(
        w, block=FP8_BLOCK, scale_format="ue8m0", scale_dtype=torch.float8_e8m0fnu
    )
    return {f"{prefix}.weight": values, f"{prefix}.scale": scale}


def _fp4_linear(gen: torch.Generator, prefix: str, n: int, k: int) -> dict[str, torch.Tensor]:
    """MXFP4 weight [n, k] in DeepSeek-V4's layout: int8 [n, k/2] and F8_E8M0 [n, k/32]."""
    w = _normal(gen, (n, k), k**-0.5)
    weight, scale = mxfp4.to_deepseek_v4(*mxfp4.quantize(w))
    return {f"{prefix}.weight": weight, f"{prefix}.scale": scale}


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def _uniform(gen: torch.Generator, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    return torch.rand(shape, generator=gen) * (high - low) + low


def _norm_weight(gen: torch.Generator, dim: int) -> torch.Tensor:
    return (1.0 + _normal(gen, (dim,), 0.1)).bfloat16()


def _write_shards(out_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """Split `state` (in insertion order) into SHARD_COUNT files plus model.safetensors.index.json."""
    names = list(state)
    per_shard = -(-len(names) // SHARD_COUNT)
    weight_map = {}
    for i in range(SHARD_COUNT):
        shard = f"model-{i + 1:05d}-of-{SHARD_COUNT:05d}.safetensors"
        chunk = {name: state[name].contiguous() for name in names[i * per_shard : (i + 1) * per_shard]}
        save_file(chunk, out_dir / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, shard))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
