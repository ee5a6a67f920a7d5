"""The type and range of every config.json field the spec reads, checked before it is read.

`dayzero/spec.py` turns config values into numbers (`int(cfg["hidden_size"])`); a value of the wrong type
would surface there as a TypeError, an OverflowError or a division by zero that names nothing, and a huge
one (10**9 layers) would hang. `check_config(cfg, SCHEMAS[family], where)` walks the fields a family's
parser reads and raises UnsupportedModelError naming the first bad one by its path ("rope_scaling.factor",
"quantization_config.weight_block_size.1"), its value and what it must be. A field that is absent is not
checked here (its default applies); fields the parsers do not read are not checked at all. Which values
dayzero runs (a rope type, a routing function) is dayzero/validation.py's concern, after parsing.

Kinds: COUNT a whole number in [1, 2**31) (dimensions, heads, experts), COUNT0 the same from 0, LAYERS
[1, MAX_LAYERS], NUMBER a finite number, POSITIVE a finite number > 0, FRACTION in (0, 1], FLAG true or
false; `optional(kind)` also accepts null; `list_of(kind, length)`; a dict is a nested object's schema
(`objects_of(schema)`: an object whose every value has that schema).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from dayzero.validation import UnsupportedModelError

MAX_INT = 2**31 - 1  # dimensions and counts: int32, what the kernels index with
MAX_LAYERS = 10_000  # a config that asks for more is broken, and building it would take minutes
MAX_NUMBER = 1e12  # |a float field| (rope thetas reach 1e7, scales and epsilons are small)


@dataclass(frozen=True)
class Kind:
    expected: str  # what a valid value is, for the error
    ok: Callable[[Any], bool]


def _whole(lo: int, hi: int = MAX_INT) -> Callable[[Any], bool]:
    def ok(v) -> bool:  # an integral float (4096.0) is a whole number; true and false are not
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        return (isinstance(v, int) or (math.isfinite(v) and v == int(v))) and lo <= v <= hi
    return ok


def _number(lo: float, hi: float, open_lo: bool = False) -> Callable[[Any], bool]:
    def ok(v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_NUMBER <= v <= MAX_NUMBER:
            return False
        return (lo < v if open_lo else lo <= v) and v <= hi
    return ok


COUNT = Kind(f"a whole number in [1, {MAX_INT}]", _whole(1))
COUNT0 = Kind(f"a whole number in [0, {MAX_INT}]", _whole(0))
LAYERS = Kind(f"a whole number of layers in [1, {MAX_LAYERS}]", _whole(1, MAX_LAYERS))
NUMBER = Kind(f"a finite number of magnitude at most {MAX_NUMBER:g}", _number(-MAX_NUMBER, MAX_NUMBER))
POSITIVE = Kind(f"a finite number in (0, {MAX_NUMBER:g}]", _number(0, MAX_NUMBER, open_lo=True))
FRACTION = Kind("a number in (0, 1]", _number(0, 1, open_lo=True))
FLAG = Kind("true or false", lambda v: isinstance(v, bool))
TEXT = Kind("a string", lambda v: isinstance(v, str))
OBJECT = Kind("an object", lambda v: isinstance(v, dict))


def optional(kind: Kind) -> Kind:
    return Kind(f"{kind.expected}, or null", lambda v: v is None or kind.ok(v))


@dataclass(frozen=True)
class ListOf:
    item: Kind | dict
    length: int | None = None  # exactly this many items
    max_length: int = MAX_LAYERS * 4
    nullable: bool = True


def list_of(item: Kind | dict, length: int | None = None, nullable: bool = True) -> ListOf:
    return ListOf(item, length, nullable=nullable)


@dataclass(frozen=True)
class ObjectsOf:
    schema: dict  # every value of the object has this schema (compressed-tensors' config_groups)


def objects_of(schema: dict) -> ObjectsOf:
    return ObjectsOf(schema)


Schema = Mapping[str, "Kind | ListOf | ObjectsOf | dict"]


def check_config(cfg: Mapping, schema: Schema, where: str, prefix: str = "") -> None:
    """Raise UnsupportedModelError naming the first field of `cfg` that `schema` refuses (absent fields
    pass; a nested schema's object may be null)."""
    for name, rule in schema.items():
        if name not in cfg:
            continue
        _check(cfg[name], rule, f"{prefix}{name}", where)


def _check(value: Any, rule, path: str, where: str) -> None:
    if isinstance(rule, Kind):
        if not rule.ok(value):
            raise UnsupportedModelError(path, value, (rule.expected,), where)
    elif isinstance(rule, ListOf):
        if value is None and rule.nullable:
            return
        n = f"exactly {rule.length}" if rule.length is not None else f"at most {rule.max_length}"
        if not isinstance(value, list) or (rule.length is not None and len(value) != rule.length) or len(value) > rule.max_length:
            raise UnsupportedModelError(path, value, (f"a list of {n} items",), where)
        for i, item in enumerate(value):
            _check(item, rule.item, f"{path}.{i}", where)
    elif isinstance(rule, ObjectsOf):
        if value is None:
            return
        if not isinstance(value, dict):
            raise UnsupportedModelError(path, value, ("an object",), where)
        for key, item in value.items():
            _check(item, rule.schema, f"{path}.{key}", where)
    else:  # a nested object's schema
        if value is None:
            return
        if not isinstance(value, dict):
            raise UnsupportedModelError(path, value, ("an object",), where)
        check_config(value, rule, where, f"{path}.")


# -- the schemas ------------------------------------------------------------------------------------
_ROPE_FIELDS = {
    "type": optional(TEXT), "rope_type": optional(TEXT), "factor": optional(POSITIVE), "rope_theta": optional(POSITIVE),
    "original_max_position_embeddings": optional(COUNT), "beta_fast": optional(NUMBER), "beta_slow": optional(NUMBER),
    "mscale": optional(NUMBER), "mscale_all_dim": optional(NUMBER), "truncate": optional(FLAG),
    "partial_rotary_factor": optional(FRACTION),
}
ROPE = {**_ROPE_FIELDS, "main": _ROPE_FIELDS, "compress": _ROPE_FIELDS}  # DeepSeek-V4 nests {main, compress}

QUANTIZATION = {
    "quant_method": optional(TEXT), "weight_block_size": list_of(COUNT, 2), "scale_fmt": optional(TEXT),
    "expert_dtype": optional(TEXT), "format": optional(TEXT), "ignore": list_of(TEXT),
    "modules_to_not_convert": list_of(TEXT),
    "config_groups": objects_of({"format": optional(TEXT), "targets": list_of(TEXT),
                                 "weights": {"num_bits": optional(COUNT), "group_size": optional(COUNT)}}),
}

_COMMON = {
    "num_hidden_layers": LAYERS, "hidden_size": COUNT, "vocab_size": COUNT, "num_attention_heads": COUNT,
    "num_key_value_heads": optional(COUNT), "max_position_embeddings": COUNT, "rope_theta": optional(POSITIVE),
    "rope_scaling": ROPE, "rope_parameters": ROPE, "quantization_config": QUANTIZATION,
    "tie_word_embeddings": optional(FLAG), "attention_bias": optional(FLAG), "intermediate_size": COUNT,
    "moe_intermediate_size": COUNT, "num_experts_per_tok": COUNT, "routed_scaling_factor": NUMBER,
    "norm_topk_prob": optional(FLAG), "layer_types": list_of(TEXT), "mlp_layer_types": list_of(TEXT),
    "num_nextn_predict_layers": optional(COUNT0), "num_mtp_layers": optional(COUNT0), "rms_norm_eps": POSITIVE,
    "partial_rotary_factor": optional(FRACTION),
}
_MLA = {
    "q_lora_rank": optional(COUNT), "kv_lora_rank": COUNT, "qk_nope_head_dim": COUNT, "qk_rope_head_dim": COUNT,
    "v_head_dim": COUNT, "n_group": optional(COUNT), "topk_group": optional(COUNT), "first_k_dense_replace": optional(COUNT0),
}
DEEPSEEK_V3 = {**_COMMON, **_MLA, "n_routed_experts": optional(COUNT), "n_shared_experts": optional(COUNT0),
               "index_n_heads": COUNT, "index_head_dim": COUNT, "index_topk": COUNT}
DEEPSEEK_V4 = {
    **_COMMON, "head_dim": COUNT, "q_lora_rank": COUNT, "qk_rope_head_dim": optional(COUNT), "n_routed_experts": COUNT,
    "n_shared_experts": optional(COUNT0), "num_hash_layers": optional(COUNT0), "sliding_window": COUNT,
    "o_groups": COUNT, "o_lora_rank": COUNT, "index_n_heads": COUNT, "index_head_dim": COUNT, "index_topk": COUNT,
    "hc_mult": COUNT, "hc_sinkhorn_iters": COUNT, "hc_eps": POSITIVE, "swiglu_limit": POSITIVE,
    "compress_rope_theta": optional(POSITIVE), "compress_ratios": list_of(COUNT0), "compress_rates": objects_of(COUNT),
    "compress_rate_csa": optional(COUNT), "compress_rate_hca": optional(COUNT),
}
GPT_OSS = {**_COMMON, "head_dim": optional(COUNT), "sliding_window": optional(COUNT0), "num_local_experts": COUNT,
           "num_experts": COUNT, "swiglu_limit": POSITIVE, "swiglu_alpha": POSITIVE}
KIMI_LINEAR = {
    **_COMMON, **_MLA, "model_max_length": COUNT, "num_experts": COUNT, "num_local_experts": COUNT,
    "num_experts_per_token": COUNT, "num_expert_group": optional(COUNT), "num_shared_experts": optional(COUNT0),
    "n_shared_experts": optional(COUNT0), "moe_renormalize": optional(FLAG), "mla_use_nope": optional(FLAG),
    "mla_use_output_gate": optional(FLAG), "linear_num_heads": COUNT, "linear_head_dim": COUNT,
    "linear_conv_kernel_dim": COUNT, "routed_expert_hidden_size": optional(COUNT), "latent_moe_use_norm": optional(FLAG),
    "attn_res_block_size": optional(COUNT), "activation_situ_beta": optional(NUMBER),
    "activation_situ_linear_beta": optional(NUMBER),
    "linear_attn_config": {"full_attn_layers": list_of(LAYERS), "kda_layers": list_of(LAYERS), "num_heads": COUNT,
                           "head_dim": COUNT, "short_conv_kernel_size": COUNT,
                           "use_full_rank_gate": optional(FLAG), "gate_lower_bound": optional(NUMBER)},
}
GLM4_MOE = {**_COMMON, "head_dim": optional(COUNT), "first_k_dense_replace": optional(COUNT0), "n_group": optional(COUNT),
            "topk_group": optional(COUNT), "n_routed_experts": COUNT, "n_shared_experts": optional(COUNT0),
            "use_qk_norm": optional(FLAG)}
QWEN3_5_MOE = {
    **_COMMON, "head_dim": optional(COUNT), "num_experts": COUNT, "shared_expert_intermediate_size": COUNT,
    "full_attention_interval": optional(COUNT), "linear_conv_kernel_dim": COUNT, "linear_key_head_dim": COUNT,
    "linear_value_head_dim": COUNT, "linear_num_key_heads": COUNT, "linear_num_value_heads": COUNT,
    "mtp_num_hidden_layers": optional(COUNT0),
}
SCHEMAS: dict[str, Schema] = {"deepseek_v3": DEEPSEEK_V3, "kimi_k2": DEEPSEEK_V3, "deepseek_v32": DEEPSEEK_V3,
                              "deepseek_v4": DEEPSEEK_V4, "gpt_oss": GPT_OSS, "kimi_linear": KIMI_LINEAR,
                              "glm4_moe": GLM4_MOE, "qwen3_5_moe_text": QWEN3_5_MOE, "qwen3_5_moe": QWEN3_5_MOE}

# a vision-language wrapper (kimi_k25, kimi_k3, qwen3_5_moe): its own fields and its vision tower's (MoonViT names and
# the remote code's vt_* names)
_VISION = {
    "merge_kernel_size": list_of(COUNT, 2), "patch_size": COUNT, "text_hidden_size": COUNT, "qkv_hidden_size": COUNT,
    "mm_hidden_size": COUNT, "linear_bias": optional(FLAG), "pos_emb_type": optional(TEXT), "norm_type": optional(TEXT),
    **{f"{p}{name}": kind for p in ("", "vt_") for name, kind in (
        ("num_hidden_layers", LAYERS), ("hidden_size", COUNT), ("intermediate_size", COUNT), ("num_attention_heads", COUNT))},
    **{name: COUNT for name in ("init_pos_emb_height", "init_pos_emb_width", "pos_emb_height", "pos_emb_width")},
    # Qwen3.5's vision tower (recognised for inspect)
    **{name: COUNT for name in ("depth", "num_heads", "out_hidden_size", "num_position_embeddings", "spatial_merge_size",
                                "temporal_patch_size")},
}
WRAPPER = {"text_config": optional(OBJECT), "vision_config": _VISION, "projection_hidden_size": optional(COUNT),
           "tie_word_embeddings": optional(FLAG), "quantization_config": QUANTIZATION}
