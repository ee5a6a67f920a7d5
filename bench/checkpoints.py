"""Real-size random benchmark checkpoints, written where they run (never downloaded).

    python bench/checkpoints.py gpt-oss-20b /tmp/gpt-oss-20b      # ~13 GB, a minute on the H200 machine

gpt-oss-20b: the published config (24 layers, hidden 2880, 64 query / 8 kv heads of 64, 32 experts
top-4, sliding window 128 on even layers, vocab 201088) and the published on-disk layout: experts as
MXFP4 `*_blocks` uint8 [E, out, K/32, 16] / `*_scales` uint8 [E, out, K/32] (E8M0), gate/up rows
interleaved, every other tensor bf16, in 5 GB shards with a model.safetensors.index.json. Values are
random with realistic scales (projections ~ N(0, 1/K); expert weights uniform over the E2M1 codes
with scales near 2^-7, so expert outputs stay O(1)); no tokenizer (benchmarks feed token ids).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHARD_BYTES = 5 * 2**30

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "attention_bias": True, "swiglu_limit": 7.0,
    "max_position_embeddings": 131072, "rope_theta": 150000, "rms_norm_eps": 1e-5,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "tie_word_embeddings": False, "eos_token_id": 200002, "pad_token_id": 199999, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}


def _gpt_oss_tensors(config: dict, device: str):
    """(name, tensor) pairs of one gpt-oss checkpoint, generated layer by layer on `device`."""
    g = torch.Generator(device=device).manual_seed(0)
    h, heads, kv, d = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    e, inter, vocab = config["num_local_experts"], config["intermediate_size"], config["vocab_size"]

    def normal(*shape, std):
        return (torch.randn(shape, generator=g, device=device) * std).to(torch.bfloat16)

    def mxfp4(out_dim, k):
        blocks = torch.randint(0, 256, (e, out_dim, k // 32, 16), generator=g, device=device, dtype=torch.uint8)
        scales = torch.randint(118, 122, (e, out_dim, k // 32), generator=g, device=device, dtype=torch.uint8)
        return blocks, scales

    yield "model.embed_tokens.weight", normal(vocab, h, std=1.0)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (1 + normal(h, std=0.1).float()).bfloat16()
        yield p + "post_attention_layernorm.weight", (1 + normal(h, std=0.1).float()).bfloat16()
        for name, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
            yield p + f"self_attn.{name}.weight", normal(rows, h, std=h ** -0.5)
            yield p + f"self_attn.{name}.bias", normal(rows, std=0.1)
        yield p + "self_attn.o_proj.weight", normal(h, heads * d, std=(heads * d) ** -0.5)
        yield p + "self_attn.o_proj.bias", normal(h, std=0.1)
        yield p + "self_attn.sinks", normal(heads, std=1.0).float()
        yield p + "mlp.router.weight", normal(e, h, std=h ** -0.5)
        yield p + "mlp.router.bias", normal(e, std=0.1)
        blocks, scales = mxfp4(2 * inter, h)
        yield p + "mlp.experts.gate_up_proj_blocks", blocks
        yield p + "mlp.experts.gate_up_proj_scales", scales
        yield p + "mlp.experts.gate_up_proj_bias", normal(e, 2 * inter, std=0.1)
        blocks, scales = mxfp4(h, inter)
        yield p + "mlp.experts.down_proj_blocks", blocks
        yield p + "mlp.experts.down_proj_scales", scales
        yield p + "mlp.experts.down_proj_bias", normal(e, h, std=0.1)
    yield "model.norm.weight", (1 + normal(h, std=0.1).float()).bfloat16()
    yield "lm_head.weight", normal(vocab, h, std=h ** -0.5)


def write_checkpoint(kind: str, path: Path, device: str) -> Path:
    from safetensors.torch import save_file

    configs = {"gpt-oss-20b": GPT_OSS_20B}
    if kind not in configs:
        raise SystemExit(f"unknown checkpoint {kind!r}; known: {', '.join(configs)}")
    config = configs[kind]
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in _gpt_oss_tensors(config, device):
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.cpu().contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / fname, metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["gpt-oss-20b"])
    ap.add_argument("path", type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    print(write_checkpoint(args.kind, args.path, args.device))


if __name__ == "__main__":
    main()
