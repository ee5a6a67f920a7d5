"""Real-size random benchmark checkpoints, written where they run (never downloaded).

    python bench/checkpoints.py gpt-oss-20b /tmp/gpt-oss-20b            # 12.8 GiB, 24 layers
    python bench/checkpoints.py deepseek-v4-flash /tmp/dsv4-flash        # 26 layers, 88.6 GiB: 65% of an H200
    python bench/checkpoints.py deepseek-v4-flash /tmp/dsv4 --layers 12  # or a given number of layers
    python bench/checkpoints.py deepseek-v4-flash --plan                 # bytes per layer, layers, shards; no files
    python bench/checkpoints.py deepseek-v3.2 /tmp/dsv32                 # 4 layers (3 dense + 1 MoE), 15.9 GiB
    python bench/checkpoints.py kimi-k2.5 /tmp/kimi-k25                  # MoonViT + 2 text layers (1 dense + 1 MoE)

gpt-oss-20b: the published config (24 layers, hidden 2880, 64 query / 8 kv heads of 64, 32 experts
top-4, sliding window 128 on even layers, vocab 201088) and the published on-disk layout: experts as
MXFP4 `*_blocks` uint8 [E, out, K/32, 16] / `*_scales` uint8 [E, out, K/32] (E8M0), gate/up rows
interleaved, every other tensor bf16.

deepseek-v4-flash: DeepSeek-V4-Flash's layer dimensions (its config.json, as tests/spec/fullsize_configs.py
and transformers' DeepseekV4Config defaults give them: hidden 4096, 64 heads of 512 sharing one KV head,
q_lora_rank 1024, 8 output groups of rank 1024, indexer 64 heads of 128 with top-512, 256 routed experts
of 2048 top-6 plus one shared, hc_mult 4, sliding window 128, vocab 129280) and its release layout
(dayzero/demo/checkpoint.py: FP8 e4m3 dense weights with 128x128 UE8M0 scales, FP4 experts as int8
pairs with a UE8M0 scale per 32, bf16 norms / compressors / router, float32 hyper-connections), with
the first `layers` entries of the published attention schedule (2 sliding-window layers, then CSA and
HCA alternating; the first 3 MoE layers hash-routed) and no MTP layer. A layer is 3.32-3.35 GiB (3.19
GiB of it the routed experts), embeddings, head and the rest 1.97 GiB (all 43 layers: 145.3 GiB;
`dayzero inspect` plans 145 GiB for the real checkpoint). The default layer count is the most that keeps the
weights within FIT_FRACTION of the H200's memory, leaving the rest to the KV pool and the workspaces:
26 layers, 88.6 GiB. A disk of 64 GiB (the single-GPU machine's) holds about 16 layers (55 GiB).

deepseek-v3.2: DeepSeek-V3.2's published config (tests/spec/fullsize_configs.py: hidden 7168, 128 heads,
MLA with latent 512 + 64, q_lora_rank 1536, the DSA indexer 64 heads of 128 with top-2048, 256 routed
experts of 2048 top-8 plus one shared, the first 3 layers dense MLPs of 18432, vocab 129280) and its
release layout (tests/models/deepseek_checkpoints.py: every Linear of the layers FP8 e4m3 with a float32
power-of-two `weight_scale_inv` per 128x128 block, embeddings, norms, lm_head, the router and the
indexer's weights_proj bf16, the router's correction bias float32), without the MTP layer. A dense layer
is 0.56 GiB, a MoE layer 10.7 GiB, embeddings and head 3.45 GiB: the default 4 layers (3 dense, 1 MoE)
are 15.9 GiB, enough to time attention, the indexer and one MoE layer at long context; `--layers 5`
adds a second MoE layer (26.6 GiB).

kimi-k2.5: Kimi K2.5's MoonViT and projector (0.47 B parameters) in the release names, bf16, over Kimi-K2's
text model with the first `layers` layers (kimi_k25_config), FP8 as deepseek-v3.2's (without the indexer).

Values are random with realistic scales (matrices ~ N(0, 1/K): FP8 values N(0, 1) under a block scale
of 2^round(log2(K^-1/2)); FP4 codes uniform over all 16 with scales near 2^-7.5, so expert outputs stay
O(1)); no tokenizer (benchmarks feed token ids). Tensors are drawn on `--device` (the GPU by default)
one at a time and written as drawn, shard by shard (5 GiB each, a model.safetensors.index.json): the
host holds one tensor at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SHARD_BYTES = 5 * 2**30
H200_BYTES = 139 * 2**30  # what torch reports as the H200's total memory
FIT_FRACTION = 0.65  # of H200_BYTES, for the weights of the default DeepSeek-V4-Flash checkpoint

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

FLASH_LAYERS = 43
DEEPSEEK_V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": FLASH_LAYERS, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(FLASH_LAYERS - 2)],
    "compress_rope_theta": 160000, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048, "num_experts_per_tok": 6,
    "num_hash_layers": 3, "norm_topk_prob": True, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "swiglu_limit": 10.0, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1048576, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "num_nextn_predict_layers": 0, "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 1, "initializer_range": 0.02, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "expert_dtype": "fp4",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}

V32_LAYERS = 4  # the default: DeepSeek-V3.2's 3 dense layers and one MoE layer
K25_LAYERS = 2  # the default text layers of the Kimi K2.5 checkpoint: the dense one and one MoE layer


def deepseek_v32_config() -> dict:
    """DeepSeek-V3.2's published config without its MTP layer (the benchmark checkpoint ships none)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.spec.fullsize_configs import config

    return dict(config("deepseek-v3.2"), num_nextn_predict_layers=0, torch_dtype="bfloat16", eos_token_id=1,
                bos_token_id=0)


CODES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8", torch.int8: "I8", torch.int64: "I64",
         torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0"}


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor and how its values are drawn:
    normal (std)        N(0, std^2)
    norm ()             1 + N(0, 0.01): a norm weight
    uniform (lo, hi)    U(lo, hi)
    bytes ()            uniform random bytes: packed E2M1 pairs, every code equally likely
    exponent (lo, hi)   E8M0 scale bytes uniform in [lo, hi] (value 2^(byte - 127))
    fp8 ()              e4m3 values of N(0, 1), to be read under an `exponent` scale
    experts (n)         per row, distinct expert ids in [0, n): a hash router's table"""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    draw: str
    args: tuple = ()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _scale_byte(std: float) -> int:
    return 127 + round(math.log2(std))


def gpt_oss_plan(c: dict) -> list[Tensor]:
    h, heads, kv, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    e, inter, vocab = c["num_local_experts"], c["intermediate_size"], c["vocab_size"]
    bf16 = torch.bfloat16

    def mxfp4(name, out_dim, k):
        return [Tensor(name + "_blocks", torch.uint8, (e, out_dim, k // 32, 16), "bytes"),
                Tensor(name + "_scales", torch.uint8, (e, out_dim, k // 32), "exponent", (118, 121))]

    out = [Tensor("model.embed_tokens.weight", bf16, (vocab, h), "normal", (1.0,))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [Tensor(p + "input_layernorm.weight", bf16, (h,), "norm"),
                Tensor(p + "post_attention_layernorm.weight", bf16, (h,), "norm")]
        for name, rows in (("q_proj", heads * d), ("k_proj", kv * d), ("v_proj", kv * d)):
            out += [Tensor(p + f"self_attn.{name}.weight", bf16, (rows, h), "normal", (h ** -0.5,)),
                    Tensor(p + f"self_attn.{name}.bias", bf16, (rows,), "normal", (0.1,))]
        out += [Tensor(p + "self_attn.o_proj.weight", bf16, (h, heads * d), "normal", ((heads * d) ** -0.5,)),
                Tensor(p + "self_attn.o_proj.bias", bf16, (h,), "normal", (0.1,)),
                Tensor(p + "self_attn.sinks", torch.float32, (heads,), "normal", (1.0,)),
                Tensor(p + "mlp.router.weight", bf16, (e, h), "normal", (h ** -0.5,)),
                Tensor(p + "mlp.router.bias", bf16, (e,), "normal", (0.1,))]
        out += mxfp4(p + "mlp.experts.gate_up_proj", 2 * inter, h)
        out.append(Tensor(p + "mlp.experts.gate_up_proj_bias", bf16, (e, 2 * inter), "normal", (0.1,)))
        out += mxfp4(p + "mlp.experts.down_proj", h, inter)
        out.append(Tensor(p + "mlp.experts.down_proj_bias", bf16, (e, h), "normal", (0.1,)))
    out += [Tensor("model.norm.weight", bf16, (h,), "norm"),
            Tensor("lm_head.weight", bf16, (vocab, h), "normal", (h ** -0.5,))]
    return out


def deepseek_v4_plan(c: dict) -> list[Tensor]:
    """The release layout (dayzero/demo/checkpoint.py's table), tensor by tensor, in the demo's order."""
    h, vocab, hc = c["hidden_size"], c["vocab_size"], c["hc_mult"]
    heads, hd, q, groups = c["num_attention_heads"], c["head_dim"], c["q_lora_rank"], c["o_groups"]
    experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    bf16, f32 = torch.bfloat16, torch.float32

    def fp8(name, n, k):
        grid = (math.ceil(n / 128), math.ceil(k / 128))
        byte = _scale_byte(k ** -0.5)
        return [Tensor(name + ".weight", torch.float8_e4m3fn, (n, k), "fp8"),
                Tensor(name + ".scale", torch.float8_e8m0fnu, grid, "exponent", (byte, byte))]

    def fp4(name, n, k):
        return [Tensor(name + ".weight", torch.int8, (n, k // 2), "bytes"),
                Tensor(name + ".scale", torch.float8_e8m0fnu, (n, k // 32), "exponent", (119, 120))]

    def compressor(name, dim, ratio):
        width = 2 * dim if ratio == 4 else dim  # CSA keeps two overlapping series, HCA one
        return [Tensor(name + ".wkv.weight", bf16, (width, h), "normal", (h ** -0.5,)),
                Tensor(name + ".wgate.weight", bf16, (width, h), "normal", (h ** -0.5,)),
                Tensor(name + ".norm.weight", bf16, (dim,), "norm"),
                Tensor(name + ".ape", f32, (ratio, width), "normal", (0.5,))]

    out = [Tensor("embed.weight", bf16, (vocab, h), "normal", (1.0,)),
           Tensor("hc_head_fn", f32, (hc, hc * h), "normal", ((hc * h) ** -0.5,)),
           Tensor("hc_head_base", f32, (hc,), "normal", (0.1,)),
           Tensor("hc_head_scale", f32, (1,), "uniform", (0.5, 1.5))]
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}"
        out += [Tensor(f"{p}.attn_norm.weight", bf16, (h,), "norm"), Tensor(f"{p}.ffn_norm.weight", bf16, (h,), "norm")]
        for site in ("attn", "ffn"):
            mix = (2 + hc) * hc  # pre [hc], post [hc], comb [hc, hc]
            out += [Tensor(f"{p}.hc_{site}_fn", f32, (mix, hc * h), "normal", ((hc * h) ** -0.5,)),
                    Tensor(f"{p}.hc_{site}_base", f32, (mix,), "normal", (0.1,)),
                    Tensor(f"{p}.hc_{site}_scale", f32, (3,), "uniform", (0.5, 1.5))]
        a = f"{p}.attn"
        out += fp8(f"{a}.wq_a", q, h) + [Tensor(f"{a}.q_norm.weight", bf16, (q,), "norm")]
        out += fp8(f"{a}.wq_b", heads * hd, q)
        out += fp8(f"{a}.wkv", hd, h) + [Tensor(f"{a}.kv_norm.weight", bf16, (hd,), "norm")]
        out += fp8(f"{a}.wo_a", groups * c["o_lora_rank"], heads * hd // groups)
        out += fp8(f"{a}.wo_b", h, groups * c["o_lora_rank"])
        out.append(Tensor(f"{a}.attn_sink", f32, (heads,), "normal", (0.5,)))
        ratio = c["compress_ratios"][i]
        if ratio:
            out += compressor(f"{a}.compressor", hd, ratio)
        if ratio == 4:
            index_heads, index_dim = c["index_n_heads"], c["index_head_dim"]
            out += fp8(f"{a}.indexer.wq_b", index_heads * index_dim, q)
            out.append(Tensor(f"{a}.indexer.weights_proj.weight", bf16, (index_heads, h), "normal", (h ** -0.5,)))
            out += compressor(f"{a}.indexer.compressor", index_dim, ratio)
        f = f"{p}.ffn"
        out.append(Tensor(f"{f}.gate.weight", bf16, (experts, h), "normal", (h ** -0.5,)))
        if i < c["num_hash_layers"]:
            out.append(Tensor(f"{f}.gate.tid2eid", torch.int64, (vocab, c["num_experts_per_tok"]), "experts", (experts,)))
        else:
            out.append(Tensor(f"{f}.gate.bias", f32, (experts,), "normal", (0.1,)))
        for e in range(experts):
            out += fp4(f"{f}.experts.{e}.w1", inter, h) + fp4(f"{f}.experts.{e}.w2", h, inter)
            out += fp4(f"{f}.experts.{e}.w3", inter, h)
        shared = inter * c["n_shared_experts"]
        out += fp8(f"{f}.shared_experts.w1", shared, h) + fp8(f"{f}.shared_experts.w2", h, shared)
        out += fp8(f"{f}.shared_experts.w3", shared, h)
    out += [Tensor("norm.weight", bf16, (h,), "norm"), Tensor("head.weight", bf16, (vocab, h), "normal", (h ** -0.5,))]
    return out


def deepseek_v32_plan(c: dict, prefix: str = "") -> list[Tensor]:
    """The release layout (tests/models/deepseek_checkpoints.py writes it at test size), tensor by tensor;
    without `index_n_heads` in the config (DeepSeek-V3, Kimi-K2) no indexer. prefix: before every name (a
    wrapper's `language_model.`)."""
    h, vocab, heads = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    q, kv, nope, rope, v = c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    experts, moe, dense = c["n_routed_experts"], c["moe_intermediate_size"], c["intermediate_size"]
    index_heads, index_dim = c.get("index_n_heads"), c.get("index_head_dim")
    bf16, f32 = torch.bfloat16, torch.float32

    def fp8(name, n, k):
        grid = (math.ceil(n / 128), math.ceil(k / 128))
        scale = 2.0 ** round(math.log2(k ** -0.5))  # ue8m0: a power of two, stored float32
        return [Tensor(name + ".weight", torch.float8_e4m3fn, (n, k), "fp8"),
                Tensor(name + ".weight_scale_inv", f32, grid, "uniform", (scale, scale))]

    def mlp(name, inter):
        return fp8(f"{name}.gate_proj", inter, h) + fp8(f"{name}.up_proj", inter, h) + fp8(f"{name}.down_proj", h, inter)

    out = [Tensor("model.embed_tokens.weight", bf16, (vocab, h), "normal", (1.0,))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        out += [Tensor(f"{p}.input_layernorm.weight", bf16, (h,), "norm"),
                Tensor(f"{p}.post_attention_layernorm.weight", bf16, (h,), "norm")]
        out += fp8(f"{a}.q_a_proj", q, h) + [Tensor(f"{a}.q_a_layernorm.weight", bf16, (q,), "norm")]
        out += fp8(f"{a}.q_b_proj", heads * (nope + rope), q)
        out += fp8(f"{a}.kv_a_proj_with_mqa", kv + rope, h) + [Tensor(f"{a}.kv_a_layernorm.weight", bf16, (kv,), "norm")]
        out += fp8(f"{a}.kv_b_proj", heads * (nope + v), kv) + fp8(f"{a}.o_proj", h, heads * v)
        if index_heads:
            out += fp8(f"{a}.indexer.wq_b", index_heads * index_dim, q) + fp8(f"{a}.indexer.wk", index_dim, h)
            out += [Tensor(f"{a}.indexer.k_norm.weight", bf16, (index_dim,), "norm"),
                    Tensor(f"{a}.indexer.k_norm.bias", bf16, (index_dim,), "normal", (0.1,)),
                    Tensor(f"{a}.indexer.weights_proj.weight", bf16, (index_heads, h), "normal", (h ** -0.5,))]
        if i < c["first_k_dense_replace"]:
            out += mlp(f"{p}.mlp", dense)
            continue
        out += [Tensor(f"{p}.mlp.gate.weight", bf16, (experts, h), "normal", (h ** -0.5,)),
                Tensor(f"{p}.mlp.gate.e_score_correction_bias", f32, (experts,), "uniform", (0.0, 0.2))]
        for e in range(experts):
            out += mlp(f"{p}.mlp.experts.{e}", moe)
        out += mlp(f"{p}.mlp.shared_experts", moe * c["n_shared_experts"])
    out += [Tensor("model.norm.weight", bf16, (h,), "norm"),
            Tensor("lm_head.weight", bf16, (vocab, h), "normal", (h ** -0.5,))]
    return [Tensor(prefix + t.name, t.dtype, t.shape, t.draw, t.args) for t in out]


def kimi_k25_config(layers: int | None = None) -> dict:
    """Kimi K2.5's shape: the MoonViT of its config (27 layers, hidden 1152, 16 heads of 72, MLP 4304,
    patch 14, a 64 x 64 position grid, 2 x 2 merge, projector 4608 -> 7168), transformers' kimi_k25 names,
    over Kimi-K2's text model (tests/spec/fullsize_configs.py) cut to `layers` layers (default
    K25_LAYERS: the dense layer and one of 384 experts) with FP8 block-scaled weights (K2-Instruct's
    release; K2.5 ships int4 experts, which dayzero does not load yet)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.spec.fullsize_configs import config

    text = dict(config("kimi-k2"), num_hidden_layers=layers or K25_LAYERS, eos_token_id=163586, bos_token_id=163584)
    vision = {"patch_size": 14, "pos_emb_height": 64, "pos_emb_width": 64, "pos_emb_time": 4, "num_attention_heads": 16,
              "num_hidden_layers": 27, "hidden_size": 1152, "intermediate_size": 4304, "merge_kernel_size": [2, 2],
              "hidden_act": "gelu_pytorch_tanh", "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}
    return {"architectures": ["Kimi_K25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
            "vision_config": vision, "projection_hidden_size": 1152, "projection_layer_norm_eps": 1e-5,
            "image_token_id": 163605, "video_token_id": 163840, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def kimi_k25_plan(c: dict) -> list[Tensor]:
    """MoonViT and its projector in the release names (bf16, every Linear with a bias), then the text model
    under `language_model.`."""
    v, bf16 = c["vision_config"], torch.bfloat16
    d, inter, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    merged, text = d * 4, c["text_config"]["hidden_size"]

    def linear(name, n, k):
        return [Tensor(name + ".weight", bf16, (n, k), "normal", (k ** -0.5,)), Tensor(name + ".bias", bf16, (n,), "normal", (0.02,))]

    def norm(name, n):
        return [Tensor(name + ".weight", bf16, (n,), "norm"), Tensor(name + ".bias", bf16, (n,), "normal", (0.02,))]

    out = [Tensor("vision_tower.patch_embed.proj.weight", bf16, (d, 3, p, p), "normal", ((3 * p * p) ** -0.5,)),
           Tensor("vision_tower.patch_embed.proj.bias", bf16, (d,), "normal", (0.02,)),
           Tensor("vision_tower.patch_embed.pos_emb.weight", bf16, (v["pos_emb_height"], v["pos_emb_width"], d), "normal",
                  (0.5,))]
    for i in range(v["num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}"
        out += norm(f"{b}.norm0", d) + norm(f"{b}.norm1", d) + linear(f"{b}.wqkv", 3 * d, d) + linear(f"{b}.wo", d, d)
        out += linear(f"{b}.mlp.fc0", inter, d) + linear(f"{b}.mlp.fc1", d, inter)
    out += norm("vision_tower.encoder.final_layernorm", d)
    out += norm("mm_projector.pre_norm", d) + linear("mm_projector.proj.0", merged, merged)
    out += linear("mm_projector.proj.2", text, merged)
    return out + deepseek_v32_plan(c["text_config"], prefix="language_model.")


def layer_bytes(plan: list[Tensor], prefix: str) -> list[int]:
    """Bytes of each layer (tensors named `{prefix}{i}.`), by layer index."""
    sizes: dict[int, int] = {}
    for t in plan:
        if t.name.startswith(prefix):
            i = int(t.name[len(prefix):].split(".", 1)[0])
            sizes[i] = sizes.get(i, 0) + t.nbytes
    return [sizes[i] for i in sorted(sizes)]


def fit_layers(budget: int = int(FIT_FRACTION * H200_BYTES)) -> int:
    """The most DeepSeek-V4-Flash layers (a prefix of its schedule) whose checkpoint is within `budget` bytes."""
    plan = deepseek_v4_plan(DEEPSEEK_V4_FLASH)
    per_layer = layer_bytes(plan, "layers.")
    total = sum(t.nbytes for t in plan) - sum(per_layer)  # embeddings, head, final norm and mixing
    layers = 0
    for size in per_layer:
        if total + size > budget:
            break
        total += size
        layers += 1
    return layers


def config_for(kind: str, layers: int | None = None, **overrides) -> dict:
    """The checkpoint's config.json: the published shape with `layers` layers (default: gpt-oss all 24,
    DeepSeek-V4-Flash fit_layers()); overrides replace fields (tests shrink the dimensions)."""
    if kind == "gpt-oss-20b":
        config = dict(GPT_OSS_20B, **overrides)
        n = layers or config["num_hidden_layers"]
        config.update(num_hidden_layers=n, layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(n)])
    elif kind == "deepseek-v4-flash":
        config = dict(DEEPSEEK_V4_FLASH, **overrides)
        n = layers or fit_layers()
        if not 1 <= n <= FLASH_LAYERS:
            raise SystemExit(f"--layers must be in [1, {FLASH_LAYERS}] for deepseek-v4-flash, got {n}")
        config.update(num_hidden_layers=n, compress_ratios=config["compress_ratios"][:n],
                      num_hash_layers=min(config["num_hash_layers"], n))
    elif kind == "deepseek-v3.2":
        config = dict(deepseek_v32_config(), **overrides)
        n = layers or V32_LAYERS
        if not 1 <= n <= 61:
            raise SystemExit(f"--layers must be in [1, 61] for deepseek-v3.2, got {n}")
        config.update(num_hidden_layers=n)
    elif kind == "kimi-k2.5":
        config = dict(kimi_k25_config(layers), **overrides)
    else:
        raise SystemExit(f"unknown checkpoint {kind!r}; known: {', '.join(KINDS)}")
    return config


KINDS = {"gpt-oss-20b": gpt_oss_plan, "deepseek-v4-flash": deepseek_v4_plan, "deepseek-v3.2": deepseek_v32_plan,
         "kimi-k2.5": kimi_k25_plan}


def shards_of(plan: list[Tensor], shard_bytes: int | None = None) -> list[list[Tensor]]:
    """The plan cut, in order, into files of at most shard_bytes (default SHARD_BYTES; one larger tensor
    gets a file of its own)."""
    shard_bytes = shard_bytes or SHARD_BYTES
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in plan:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def draw(t: Tensor, g: torch.Generator, device: str) -> torch.Tensor:
    if t.draw == "normal":
        return (torch.randn(t.shape, generator=g, device=device) * t.args[0]).to(t.dtype)
    if t.draw == "norm":
        return (1 + 0.1 * torch.randn(t.shape, generator=g, device=device)).to(t.dtype)
    if t.draw == "uniform":
        lo, hi = t.args
        return (torch.rand(t.shape, generator=g, device=device) * (hi - lo) + lo).to(t.dtype)
    if t.draw == "bytes":
        return torch.randint(0, 256, t.shape, generator=g, device=device, dtype=torch.uint8).view(t.dtype)
    if t.draw == "exponent":
        lo, hi = t.args
        return torch.randint(lo, hi + 1, t.shape, generator=g, device=device, dtype=torch.uint8).view(t.dtype)
    if t.draw == "fp8":
        return torch.randn(t.shape, generator=g, device=device).to(t.dtype)
    if t.draw == "experts":
        rows, k = t.shape
        return torch.rand(rows, t.args[0], generator=g, device=device).argsort(-1)[:, :k].to(t.dtype)
    raise ValueError(f"{t.name}: unknown draw {t.draw!r}")


def write_safetensors(path: Path, tensors: list[Tensor], g: torch.Generator, device: str) -> None:
    """One .safetensors file (dayzero/weights/header.py has the format): the header from the plan, then
    each tensor drawn on `device`, copied to the host and written, one at a time."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        header[t.name] = {"dtype": CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors:
            host = draw(t, g, device).cpu().contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(host.numpy()))


def write_checkpoint(kind: str, path: Path, device: str, layers: int | None = None, **overrides) -> Path:
    """config.json, the shards and model.safetensors.index.json of checkpoint `kind` in `path`."""
    config = config_for(kind, layers, **overrides)
    plan = KINDS[kind](config)
    shards = shards_of(plan)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path / name, shard, g, device)
        weight_map.update(dict.fromkeys((t.name for t in shard), name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in plan)}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def describe(kind: str, layers: int | None = None) -> str:
    config = config_for(kind, layers)
    plan = KINDS[kind](config)
    per_layer = layer_bytes(plan, {"deepseek-v4-flash": "layers.", "kimi-k2.5": "language_model.model.layers."}.get(
        kind, "model.layers."))
    total = sum(t.nbytes for t in plan)
    gib = 2**30
    layers = config.get("num_hidden_layers", config.get("text_config", {}).get("num_hidden_layers"))
    lines = [f"{kind}: {layers} layers, {len(plan)} tensors, {total / gib:.2f} GiB in "
             f"{len(shards_of(plan))} shard(s) ({total / H200_BYTES:.0%} of an H200's {H200_BYTES / gib:.0f} GiB)",
             f"  per layer {min(per_layer) / gib:.3f} - {max(per_layer) / gib:.3f} GiB; outside the layers "
             f"{(total - sum(per_layer)) / gib:.2f} GiB"]
    if kind == "deepseek-v4-flash":
        lines.append(f"  attention schedule (compress_ratios) {config['compress_ratios']}; "
                     f"default layers {fit_layers()} (within {FIT_FRACTION:.0%} of an H200)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("path", type=Path, nargs="?")
    ap.add_argument("--layers", type=int, help="layers to write (default: gpt-oss-20b 24; deepseek-v4-flash: "
                                               f"as many as fit FIT_FRACTION of an H200; deepseek-v3.2 {V32_LAYERS}; "
                                               f"kimi-k2.5: text layers, {K25_LAYERS})")
    ap.add_argument("--plan", action="store_true", help="print the plan and write nothing")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    print(describe(args.kind, args.layers), flush=True)
    if args.plan:
        return
    if args.path is None:
        ap.error("PATH is required unless --plan is given")
    t0 = time.perf_counter()
    write_checkpoint(args.kind, args.path, args.device, args.layers)
    print(f"wrote {args.path} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
