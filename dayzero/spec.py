"""ModelSpec: a checkpoint's config.json turned into the features the engine is built from.

`load_spec(path_or_config)` reads `config.json` (plus `quantization_config.json` or ModelOpt's
`hf_quant_config.json` when the config has no `quantization_config`) and returns a `ModelSpec`:
per layer the attention kind and its parameters and the MLP kind; the routed experts (count,
top-k, routing function, weight format, latent dim); the dense weight format; cross-layer
residuals; the vision tower; the context limit. No weights are read.

Attention kinds (`AttentionSpec.kind`):
  mla  multi-head latent attention (DeepSeek-V3, Kimi-K2, Kimi Linear full-attention layers)
  dsa  MLA + lightning indexer + top-k sparse attention (DeepSeek-V3.2)
  swa  sliding-window attention (gpt-oss even layers; DeepSeek-V4 window-only layers)
  csa  DeepSeek-V4 compressed sparse attention: window + indexer-selected compressed entries
  hca  DeepSeek-V4 heavily compressed attention: window + every compressed entry
  gqa  full grouped-query attention (gpt-oss odd layers)
  kda  Kimi delta attention, a linear-attention layer with a fixed-size recurrent state
  gdn  Gated DeltaNet (Qwen3.5): the delta rule with one decay per head, value heads grouped over
       query/key heads, a fixed-size recurrent state (dayzero/ops/gdn.py)
GQA options: an output gate (`output_gate` "sigmoid": Qwen3.5's q_proj also gives a gate per channel), partial rotary (`qk_rope_head_dim` < head_dim: only the first dims rotate), per-head
`qk_norm` (GLM-4.x, Qwen3.5), biases on q, k, v only (`qkv_bias`, GLM-4.x).
MLP kinds: dense | moe | hash_moe (DeepSeek-V4's first layers route by token id).

Layer-type lists follow transformers' config classes exactly (DeepSeek-V4 `layer_types` /
`compress_ratios` / default interleave, Kimi Linear's 1-based `linear_attn_config` lists), and
tests compare against them. A field missing from the config takes the default transformers' config
class gives it (DEFAULTS, `resolve_config`); the parsed spec is then checked by
dayzero.validation.check_supported, the one check inspect and the model loader share: a value the
engine cannot handle raises `UnsupportedModelError`.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from dayzero.config_schema import QUANTIZATION, SCHEMAS, WRAPPER, check_config
from dayzero.model_path import read_json
from dayzero.validation import UnsupportedModelError, check_supported

ATTENTION_KINDS = ("mla", "dsa", "swa", "csa", "hca", "gqa", "kda", "gdn")
MLP_KINDS = ("dense", "moe", "hash_moe")
QUANT_METHODS = ("fp8", "mxfp4", "compressed-tensors")
COMPRESSED_TENSORS_FORMATS = {"mxfp4-pack-quantized": "mxfp4", "pack-quantized": "int4"}
MODELOPT_ALGOS = {"FP8": "fp8", "MXFP4": "mxfp4"}
WEIGHT_FORMATS = ("bf16", "fp8", "mxfp4", "int4")

DEEPSEEK_V3_TYPES = ("deepseek_v3", "kimi_k2")
SUPPORTED_MODEL_TYPES = (
    "deepseek_v3",
    "kimi_k2",
    "deepseek_v32",
    "deepseek_v4",
    "gpt_oss",
    "kimi_linear",
    "kimi_k25",
    "kimi_k3",
    "glm4_moe",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
)

# -- defaults: what a field missing from config.json means -----------------------------------
# transformers 5.24's config classes (DeepseekV3Config, DeepseekV32Config, DeepseekV4Config,
# GptOssConfig, KimiLinearConfig), and for fields those classes do not have, what transformers'
# modeling code always does (DeepSeek-V3 routes by sigmoid + noaux_tc; Kimi Linear's MLA never
# rotates and routes by sigmoid). Only constants: defaults derived from other fields (layer type
# lists, num_key_value_heads = num_attention_heads when null, gpt-oss head_dim = hidden / heads when
# null, DeepSeek-V4 qk_rope_head_dim from partial_rotary_factor) are derived where they are parsed.
# Keys are the names transformers writes; ALIASES lists the other names its config classes accept.
_DEEPSEEK_V3_DEFAULTS = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
    norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, rope_interleave=True,
    rope_parameters={"rope_type": "default"},  # rope_theta: the top-level field, else 10000 (DEEPSEEK_ROPE_THETA)
    # the MTP layer: transformers' config says 1 and its model skips `model.layers.61.*`
    num_nextn_predict_layers=1,
    scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
)
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": _DEEPSEEK_V3_DEFAULTS,
    "deepseek_v32": {**_DEEPSEEK_V3_DEFAULTS, "max_position_embeddings": 163840, "index_n_heads": 64,
                     "index_head_dim": 128, "index_topk": 2048},
    "deepseek_v4": dict(
        vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
        num_key_value_heads=1, head_dim=512, q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256,
        n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
        max_position_embeddings=1048576, rope_theta=10000.0, compress_rope_theta=160000.0, hc_mult=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024,
        index_n_heads=64, index_head_dim=128, index_topk=512, num_nextn_predict_layers=1, hidden_act="silu",
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        # nested as transformers nests it; thetas come from rope_theta / compress_rope_theta
        rope_parameters={"main": {"rope_type": "default"}, "compress": {"rope_type": "default"}},
    ),
    "gpt_oss": dict(
        num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128, tie_word_embeddings=False,
        hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, num_experts_per_tok=4,
        swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True,
        # rope_theta: the top-level field, else GptOssConfig's 150000 (GPT_OSS_ROPE_THETA)
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
    ),
    "kimi_linear": dict(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
        num_attention_heads=32, num_key_value_heads=32, num_shared_experts=1, routed_scaling_factor=2.446,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        num_expert_group=1, topk_group=1, num_experts_per_token=8, moe_renormalize=True, hidden_act="silu",
        model_max_length=1048576, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, num_experts=256,
        linear_head_dim=128, linear_num_heads=32, linear_conv_kernel_dim=4, first_k_dense_replace=1,
        mla_use_nope=True, moe_router_activation_func="sigmoid", moe_layer_freq=1,
    ),
    "glm4_moe": dict(
        vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
        num_key_value_heads=8, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=False, moe_intermediate_size=1408, num_experts_per_tok=8,
        n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1,
        first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False, num_nextn_predict_layers=1,
        # theta and the partial rotary factor: rope_parameters' own, then the top-level rope_theta /
        # partial_rotary_factor released configs carry, else Glm4MoeConfig's 10000 and 0.5 (rope_fields)
        rope_parameters={"rope_type": "default"},
    ),
    "qwen3_5_moe_text": dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts_per_tok=8, num_experts=256, full_attention_interval=4, mtp_num_hidden_layers=0,
        # theta 10000 and partial rotary 0.25 unless rope_parameters says (rope_fields)
        rope_parameters={"rope_type": "default"},
    ),
}
DEFAULTS["kimi_k2"] = DEFAULTS["deepseek_v3"]
# `rope_scaling` is the Hub's older name of `rope_parameters`.
ALIASES: dict[str, dict[str, str]] = {  # family -> {other accepted name: name in DEFAULTS}
    "deepseek_v3": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers",
                    "rope_scaling": "rope_parameters"},
    "deepseek_v32": {"num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts",
                     "num_mtp_layers": "num_nextn_predict_layers", "rope_scaling": "rope_parameters"},
    "deepseek_v4": {"num_local_experts": "n_routed_experts", "intermediate_size": "moe_intermediate_size",
                    "rope_scaling": "rope_parameters"},
    "gpt_oss": {"num_experts": "num_local_experts", "rope_scaling": "rope_parameters"},
    "kimi_linear": {"max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
                    "n_group": "num_expert_group", "num_local_experts": "num_experts",
                    "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts"},
    "glm4_moe": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers",
                 "rope_scaling": "rope_parameters"},
}
ALIASES["kimi_k2"] = ALIASES["deepseek_v3"]
GPT_OSS_ROPE_THETA = 150000.0  # GptOssConfig.default_theta
DEEPSEEK_ROPE_THETA = 10000.0  # DeepseekV3Config / DeepseekV32Config / DeepseekV4Config default_theta
GLM4_ROPE_THETA, GLM4_PARTIAL_ROTARY = 10000.0, 0.5  # Glm4MoeConfig's defaults
QWEN3_5_ROPE_THETA, QWEN3_5_PARTIAL_ROTARY = 10000.0, 0.25  # Qwen3_5MoeTextConfig's defaults
WRAPPER_TEXT_TYPES = {"kimi_k25": DEEPSEEK_V3_TYPES, "kimi_k3": ("kimi_linear",),
                      "qwen3_5_moe": ("qwen3_5_moe_text",)}  # first: the default


# what transformers' DeepseekV32Config names a DSA layer: "indexed_attention" (5.24), "deepseek_sparse_attention" (5.17)
DSA_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")


def with_defaults(cfg: Mapping[str, Any], model_type: str) -> dict:
    """A text model's config with every missing field set as DEFAULTS says (an explicit null is
    kept: it is a value); a field given under an alias is copied to its DEFAULTS name."""
    out = dict(cfg)
    names = ALIASES.get(model_type, {})
    for alias, name in names.items():
        if out.get(alias) is not None and out.get(name) is None:
            out[name] = out[alias]
    for name, value in DEFAULTS.get(model_type, {}).items():
        if name not in out:
            out[name] = copy.deepcopy(value)
    return out


def resolve_config(cfg: Mapping[str, Any]) -> dict:
    """config.json as the model files read it: defaults filled in for the text model (a wrapper's
    `text_config`, whose model_type defaults to the wrapper's usual text type)."""
    model_type = cfg.get("model_type")
    if model_type in WRAPPER_TEXT_TYPES:
        text = dict(cfg.get("text_config") or {})
        text_type = text.get("model_type", WRAPPER_TEXT_TYPES[model_type][0])
        return {**cfg, "text_config": with_defaults(text, text_type)}
    return with_defaults(cfg, model_type)


# transformers' DeepSeek-V4 mapping from legacy per-layer `compress_ratios` to layer types.
_V4_RATIO_TO_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
_V4_LAYER_KIND = {"sliding_attention": "swa", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
_V4_DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's token mixer. Fields that do not apply to the kind stay None.

    head_dim: query/key width per head (MLA: qk_nope + qk_rope; KDA: dk = dv).
    kv_lora_rank / qk_rope_head_dim: the MLA latent cached per token is kv_lora_rank + qk_rope_head_dim.
    sliding_window: tokens kept by a window-bounded layer (swa, and the window branch of csa/hca).
    compress_ratio: source tokens per compressed KV entry (csa 4, hca 128 in DeepSeek-V4).
    index_*: lightning indexer (dsa; csa runs it over compressed entries).
    output_gate: "sigmoid" (Kimi K3 gated MLA), "low_rank" / "full_rank" (KDA output gate).
    qk_rope_head_dim on gqa: the rotated dims of each head (partial rotary), None when all rotate.
    gdn: num_heads value heads (one state each) of v_head_dim, num_kv_heads query/key heads of head_dim
    (num_heads / num_kv_heads value heads share one), conv_kernel the short convolution's taps.
    """

    kind: str
    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    v_head_dim: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    nope: bool = False
    sliding_window: int | None = None
    sinks: bool = False
    bias: bool = False
    compress_ratio: int | None = None
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    o_groups: int | None = None
    o_lora_rank: int | None = None
    output_gate: str | None = None
    conv_kernel: int | None = None
    gate_lower_bound: float | None = None
    qk_norm: bool = False  # RMSNorm over head_dim on each query and key head before RoPE
    qkv_bias: bool = False  # biases on q, k, v only (`bias`: on every projection)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}


@dataclass(frozen=True)
class RoutingSpec:
    """How a token picks its experts. function: softmax | sigmoid | sqrtsoftplus.

    softmax_after_topk: gpt-oss takes the top-k logits first and softmaxes over those k.
    correction_bias: DeepSeek's aux-loss-free bias added to scores for selection only (noaux_tc).
    n_group / topk_group: group-limited selection (keep the best topk_group of n_group groups).
    """

    function: str
    top_k: int
    correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = True
    scaling_factor: float = 1.0
    softmax_after_topk: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ExpertsSpec:
    """The routed experts (identical in every MoE layer) and the shared experts beside them.

    input_dim: the width experts read and write: hidden_size, or latent_dim for a latent MoE
    (Kimi K3: hidden -> latent down-projection shared by all routed experts, latent -> hidden up).
    format: storage of routed expert weights: bf16 | fp8 | mxfp4 | int4.
    """

    num: int
    top_k: int
    intermediate_size: int
    input_dim: int
    num_shared: int
    shared_intermediate_size: int
    routing: RoutingSpec
    format: str
    bias: bool = False
    latent_dim: int | None = None
    latent_norm: bool = False
    shared_gate: bool = False  # Qwen3.5: the shared expert's output times sigmoid(shared_expert_gate(x)), one per token

    def to_dict(self) -> dict:
        d = asdict(self)
        d["routing"] = self.routing.to_dict()
        return d


@dataclass(frozen=True)
class ActivationSpec:
    """kind: swiglu | swiglu_clamped (gpt-oss: alpha, limit) | situ (Kimi K3: beta, linear_beta).

    `limit` on plain swiglu is DeepSeek-V4's clamp (gate <= limit, |up| <= limit, then silu(gate)*up).
    """

    kind: str
    limit: float | None = None
    alpha: float | None = None
    beta: float | None = None
    linear_beta: float | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class MLPSpec:
    """kind: dense (intermediate_size wide) | moe | hash_moe (experts in `experts`)."""

    kind: str
    activation: ActivationSpec
    intermediate_size: int | None = None
    experts: ExpertsSpec | None = None


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer. linear_format is the storage of its attention/dense projections."""

    index: int
    attention: AttentionSpec
    mlp: MLPSpec
    linear_format: str = "bf16"
    cross_layer: str | None = None  # "hyper_connection" | "attention_residual" | None


@dataclass(frozen=True)
class QuantSpec:
    """Weight storage. fp8_block: FP8 scale block [out, in]; scale_fmt: float (fp32) | ue8m0.

    group_size: elements per scale for mxfp4/int4 (32). note: free text, e.g. which modules stay bf16.
    """

    method: str | None
    expert_format: str
    dense_format: str
    fp8_block: tuple[int, int] | None = None
    scale_fmt: str | None = None
    group_size: int | None = None
    source: str | None = None
    note: str | None = None

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class CrossLayerSpec:
    """Residual paths that reach across layers.

    hyper_connection: DeepSeek-V4 mHC, hc_mult parallel residual streams mixed by Sinkhorn-projected
    matrices before/after every attention and MLP block, collapsed by a hyper-head at the end.
    attention_residual: Kimi K3 Block AttnRes, each block input is a softmax mix of the embedding and
    completed block sums of attn_res_block_size layers.
    """

    kind: str = "none"
    hc_mult: int | None = None
    hc_sinkhorn_iters: int | None = None
    hc_eps: float | None = None
    attn_res_block_size: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class VisionSpec:
    """A vision tower feeding placeholder tokens. kind: moonvit (Kimi K2.5) | moonvit3d (Kimi K3) |
    qwen3_5_vit (Qwen3.5: 3-D patches of temporal_patch_size frames, a learned table of num_positions)."""

    kind: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    merge_kernel: tuple[int, int]
    text_hidden_size: int
    qkv_hidden_size: int | None = None
    pos_emb: tuple[int, int] | None = None  # learned position grid (height, width), None when fixed
    norm: str = "layer_norm"
    bias: bool = True
    projector_hidden_size: int | None = None
    temporal_patch_size: int | None = None
    num_positions: int | None = None

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ContextSpec:
    """max_position_embeddings and the RoPE scaling that reaches it (None when absent)."""

    max_position_embeddings: int
    rope_theta: float | None = None
    rope_type: str | None = None
    rope_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a model, derived from its config alone."""

    model_type: str  # the checkpoint's top-level model_type
    text_model_type: str  # the language model's type (kimi_k25 -> deepseek_v3, kimi_k3 -> kimi_linear)
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    experts: ExpertsSpec | None
    quant: QuantSpec
    cross_layer: CrossLayerSpec
    vision: VisionSpec | None
    context: ContextSpec
    tie_word_embeddings: bool = False
    mtp_layers: int = 0
    source: str | None = None
    extras: dict = field(default_factory=dict)  # family facts outside the fields above (V4 compress_rope_theta)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_kinds(self) -> list[tuple[str, str]]:
        return [(layer.attention.kind, layer.mlp.kind) for layer in self.layers]


# -- loading ---------------------------------------------------------------------------------


def load_spec(path_or_config: str | Path | Mapping[str, Any]) -> ModelSpec:
    """Read a checkpoint dir, a config.json path or a config dict into a ModelSpec."""
    if isinstance(path_or_config, Mapping):
        cfg, source, extra_quant = dict(path_or_config), "<config dict>", None
    else:
        cfg, source, extra_quant = _read_config_files(Path(path_or_config))
    if not isinstance(cfg, dict):
        raise UnsupportedModelError("config.json", type(cfg).__name__, ("a JSON object",), source)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError("model_type", model_type, SUPPORTED_MODEL_TYPES, source)
    quant_cfg = _find_quant_config(cfg) or extra_quant
    if model_type in WRAPPER_TEXT_TYPES:
        return _load_vlm(cfg, model_type, quant_cfg, source)
    return _load_text(cfg, model_type, quant_cfg, source)


def _read_config_files(path: Path) -> tuple[dict, str, dict | None]:
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json at {config_path}; pass a checkpoint directory or a config.json path")
    cfg = read_json(config_path)
    extra_quant = None
    folder = config_path.parent
    qc_path = folder / "quantization_config.json"
    modelopt_path = folder / "hf_quant_config.json"
    if qc_path.is_file():
        extra_quant = read_json(qc_path)
    elif modelopt_path.is_file():
        algo = read_json(modelopt_path).get("quantization", {}).get("quant_algo")
        if algo not in MODELOPT_ALGOS:
            raise UnsupportedModelError("quantization.quant_algo", algo, tuple(MODELOPT_ALGOS), str(modelopt_path))
        extra_quant = {"quant_method": "modelopt", "quant_algo": algo}
    return cfg, str(config_path), extra_quant


def _find_quant_config(cfg: dict) -> dict | None:
    if cfg.get("quantization_config"):
        return cfg["quantization_config"]
    text = cfg.get("text_config")
    if isinstance(text, dict) and text.get("quantization_config"):
        return text["quantization_config"]
    return None


def _get(cfg: Mapping, *names: str, default: Any = None) -> Any:
    """The value of the first of `names` present in cfg (an explicit null counts), else default."""
    for name in names:
        if name in cfg:
            return cfg[name]
    return default


def _load_vlm(cfg: dict, model_type: str, quant_cfg: dict | None, source: str) -> ModelSpec:
    check_config(cfg, WRAPPER, source)
    text_cfg = dict(cfg.get("text_config") or {})
    expected = WRAPPER_TEXT_TYPES[model_type]
    text_type = text_cfg.get("model_type", expected[0])
    if text_type not in expected:
        raise UnsupportedModelError("text_config.model_type", text_type, expected, source)
    text = _load_text(text_cfg, text_type, quant_cfg, source)
    vision_cfg = cfg.get("vision_config") or {}
    vision = (_parse_vision(vision_cfg, model_type, cfg, text.hidden_size)
              if vision_cfg or model_type in ("kimi_k25", "qwen3_5_moe") else None)
    tie = _get(cfg, "tie_word_embeddings", default=text.tie_word_embeddings)
    if model_type == "kimi_k25" and "tie_word_embeddings" not in cfg:
        tie = True  # transformers' Kimi_K25Config default
    return replace(text, model_type=model_type, vision=vision, tie_word_embeddings=bool(tie), source=source)


def _load_text(cfg: dict, model_type: str, quant_cfg: dict | None, source: str) -> ModelSpec:
    """The text model's spec, checked against what dayzero runs (dayzero.validation)."""
    cfg = with_defaults(cfg, model_type)
    check_config(cfg, SCHEMAS[model_type], source)  # types and ranges first: the parsers convert values
    quant = _parse_quant(quant_cfg, cfg, model_type, source)
    if model_type in DEEPSEEK_V3_TYPES or model_type == "deepseek_v32":
        spec = _load_deepseek_v3(cfg, model_type, quant, source)
    elif model_type == "deepseek_v4":
        spec = _load_deepseek_v4(cfg, quant, source)
    elif model_type == "gpt_oss":
        spec = _load_gpt_oss(cfg, quant, source)
    elif model_type == "glm4_moe":
        spec = _load_glm4_moe(cfg, quant, source)
    elif model_type == "qwen3_5_moe_text":
        spec = _load_qwen3_5_moe(cfg, quant, source)
    else:
        spec = _load_kimi_linear(cfg, quant, source)
    check_supported(spec, cfg)
    return spec


# -- weight formats ----------------------------------------------------------------------------


def _parse_quant(qc: dict | None, cfg: dict, model_type: str, source: str) -> QuantSpec:
    if not qc:
        return QuantSpec(method=None, expert_format="bf16", dense_format="bf16")
    if not isinstance(qc, dict):
        raise UnsupportedModelError("quantization_config", qc, ("an object",), source)
    check_config(qc, QUANTIZATION, source, "quantization_config.")  # (it may come from its own file)
    method = qc.get("quant_method")
    if method == "modelopt":
        fmt = MODELOPT_ALGOS[qc["quant_algo"]]
        return QuantSpec("modelopt", fmt, "fp8" if fmt == "fp8" else "bf16", source="hf_quant_config.json",
                         note="ModelOpt per-tensor scales")
    if method not in QUANT_METHODS:
        raise UnsupportedModelError("quantization_config.quant_method", method, QUANT_METHODS, source)
    if method == "mxfp4":
        return QuantSpec("mxfp4", "mxfp4", "bf16", group_size=32,
                         note="routed experts MXFP4 (E2M1 + E8M0 per 32); " + _not_converted_note(qc))
    if method == "fp8":
        block = qc.get("weight_block_size")
        scale_fmt = qc.get("scale_fmt") or "float"
        if scale_fmt not in ("float", "ue8m0"):
            raise UnsupportedModelError("quantization_config.scale_fmt", scale_fmt, ("float", "ue8m0"), source)
        # DeepSeek-V4 FP4 experts: `expert_dtype: fp4` at the top level (V4) or in the quantization config (V4.1).
        expert_dtype = qc.get("expert_dtype", cfg.get("expert_dtype", "fp8"))
        if expert_dtype not in ("fp8", "fp4"):
            raise UnsupportedModelError("expert_dtype", expert_dtype, ("fp8", "fp4"), source)
        expert_format = "mxfp4" if expert_dtype == "fp4" else "fp8"
        note = "experts FP4 (E2M1, E8M0 scale per 32 along K)" if expert_format == "mxfp4" else None
        return QuantSpec("fp8", expert_format, "fp8", fp8_block=tuple(block) if block else None,
                         scale_fmt=scale_fmt, group_size=32 if expert_format == "mxfp4" else None, note=note)
    # compressed-tensors: the format of its config group(s); the ignore list decides what stays bf16.
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    group_formats = {g.get("format", fmt) for g in groups.values()} or {fmt}
    if len(group_formats) != 1:
        raise UnsupportedModelError("quantization_config.config_groups[*].format", sorted(map(str, group_formats)),
                                    tuple(COMPRESSED_TENSORS_FORMATS), source)
    fmt = group_formats.pop()
    if fmt not in COMPRESSED_TENSORS_FORMATS:
        raise UnsupportedModelError("quantization_config.format", fmt, tuple(COMPRESSED_TENSORS_FORMATS), source)
    weights = next(iter(groups.values()), {}).get("weights", {}) if groups else {}
    bits = weights.get("num_bits", 4)
    if bits != 4:
        raise UnsupportedModelError("quantization_config.config_groups.*.weights.num_bits", bits, (4,), source)
    expert_format = COMPRESSED_TENSORS_FORMATS[fmt]
    ignore = " ".join(qc.get("ignore") or [])
    dense_format = "bf16" if "self_attn" in ignore else expert_format
    note = f"compressed-tensors {fmt}"
    if expert_format == "int4":
        note += " (int4 weight-only, symmetric, group %d)" % weights.get("group_size", 32)
    if dense_format == "bf16":
        note += "; attention, shared experts, dense MLP and lm_head stay bf16"
    return QuantSpec("compressed-tensors", expert_format, dense_format, group_size=weights.get("group_size", 32),
                     note=note)


def _not_converted_note(qc: dict) -> str:
    skipped = qc.get("modules_to_not_convert") or []
    return "bf16: " + ", ".join(skipped) if skipped else "everything else bf16"


# -- shared pieces -----------------------------------------------------------------------------


def _activation(cfg: dict, source: str, *, field_name: str = "hidden_act") -> ActivationSpec:
    act = cfg.get(field_name, "silu")
    if act == "silu":
        return ActivationSpec("swiglu")
    if act == "situ":
        # defaults as the published modeling code's: beta 1, no cap on the up branch (K3's config sets 4 and 25)
        linear_beta = cfg.get("activation_situ_linear_beta")
        return ActivationSpec("situ", beta=float(cfg.get("activation_situ_beta", 1.0)),
                              linear_beta=None if linear_beta is None else float(linear_beta))
    raise UnsupportedModelError(field_name, act, ("silu", "situ"), source)


def _context(cfg: dict, *, default_max: int, default_theta: float | None = None) -> ContextSpec:
    max_pos = int(_get(cfg, "max_position_embeddings", "model_max_length", default=default_max))
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if isinstance(rope.get("compress"), dict):  # DeepSeek-V4 nests {main, compress}; yarn lives in compress
        rope = rope["compress"]
    theta = _get(cfg, "rope_theta", default=rope.get("rope_theta", default_theta))
    rope_type = rope.get("rope_type", rope.get("type"))
    return ContextSpec(
        max_position_embeddings=max_pos,
        rope_theta=float(theta) if theta is not None else None,
        rope_type=rope_type,
        rope_factor=rope.get("factor"),
        original_max_position_embeddings=rope.get("original_max_position_embeddings"),
    )


def _check_moe_layer_freq(cfg: dict, source: str) -> None:
    freq = cfg.get("moe_layer_freq", 1)
    if freq != 1:
        raise UnsupportedModelError("moe_layer_freq", freq, (1,), source)


def _routing_grouped(cfg: dict, function: str, top_k: int, *, group_names: tuple[str, ...],
                     correction_bias: bool, normalize_names: tuple[str, ...], default_scale: float) -> RoutingSpec:
    n_group = _get(cfg, *group_names, default=1) or 1
    return RoutingSpec(
        function=function,
        top_k=top_k,
        correction_bias=correction_bias,
        n_group=int(n_group),
        topk_group=int(cfg.get("topk_group") or 1),
        normalize=bool(_get(cfg, *normalize_names, default=True)),
        scaling_factor=float(cfg.get("routed_scaling_factor", default_scale)),
    )


def _mla(cfg: dict, *, kind: str = "mla", nope: bool = False, output_gate: str | None = None,
         index: dict | None = None) -> AttentionSpec:
    nope_dim = int(cfg.get("qk_nope_head_dim", 128))
    rope_dim = int(cfg.get("qk_rope_head_dim", 64))
    heads = int(cfg.get("num_attention_heads", 128))
    return AttentionSpec(
        kind=kind,
        num_heads=heads,
        head_dim=nope_dim + rope_dim,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        v_head_dim=int(cfg.get("v_head_dim", 128)),
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
        qk_nope_head_dim=nope_dim,
        qk_rope_head_dim=rope_dim,
        nope=nope,
        bias=bool(cfg.get("attention_bias", False)),
        output_gate=output_gate,
        **(index or {}),
    )


# -- DeepSeek-V3 / Kimi-K2 / DeepSeek-V3.2 ---------------------------------------------------


def _load_deepseek_v3(cfg: dict, model_type: str, quant: QuantSpec, source: str) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    _check_moe_layer_freq(cfg, source)
    is_v32 = model_type == "deepseek_v32"

    if is_v32:
        layer_types = cfg.get("layer_types") or ["indexed_attention"] * n
        bad = sorted({t for t in layer_types if t not in DSA_LAYER_TYPES})
        if bad:
            raise UnsupportedModelError("layer_types", bad[0], DSA_LAYER_TYPES, source)
        index = dict(index_n_heads=int(cfg.get("index_n_heads", 64)), index_head_dim=int(cfg.get("index_head_dim", 128)),
                     index_topk=int(cfg.get("index_topk", 2048)))
        attention = _mla(cfg, kind="dsa", index=index)
        first_dense = int(cfg["first_k_dense_replace"])
        mlp_types = cfg.get("mlp_layer_types") or (["dense"] * min(first_dense, n) + ["sparse"] * max(n - first_dense, 0))
    else:
        attention = _mla(cfg)
        first_dense = int(cfg["first_k_dense_replace"] or 0)
        has_experts = cfg["n_routed_experts"] is not None
        mlp_types = ["sparse" if has_experts and i >= first_dense else "dense" for i in range(n)]
    _check_mlp_types(mlp_types, ("dense", "sparse"), n, source)

    # scoring_func / topk_method are release fields transformers does not read (it always routes
    # sigmoid + noaux_tc); dayzero.validation refuses other values
    scoring, topk_method = cfg["scoring_func"], cfg["topk_method"]
    activation = _activation(cfg, source)
    experts = None
    if "sparse" in mlp_types:
        top_k = int(cfg["num_experts_per_tok"])
        routing = _routing_grouped(cfg, scoring, top_k, group_names=("n_group",), correction_bias=topk_method == "noaux_tc",
                                   normalize_names=("norm_topk_prob",), default_scale=2.5)
        inter = int(cfg["moe_intermediate_size"])
        n_shared = int(cfg["n_shared_experts"] or 0)
        experts = ExpertsSpec(num=int(cfg["n_routed_experts"]), top_k=top_k, intermediate_size=inter, input_dim=hidden,
                              num_shared=n_shared, shared_intermediate_size=inter * n_shared, routing=routing,
                              format=quant.expert_format)
    dense_inter = int(cfg.get("intermediate_size", 18432))
    layers = tuple(
        LayerSpec(i, attention, _mlp(t, activation, dense_inter, experts), quant.dense_format)
        for i, t in enumerate(mlp_types)
    )
    return ModelSpec(
        model_type=model_type,
        text_model_type="deepseek_v32" if is_v32 else "deepseek_v3",
        vocab_size=int(cfg.get("vocab_size", 129280)),
        hidden_size=hidden,
        layers=layers,
        experts=experts,
        quant=quant,
        cross_layer=CrossLayerSpec(),
        vision=None,
        context=_context(cfg, default_max=163840 if is_v32 else 4096, default_theta=DEEPSEEK_ROPE_THETA),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mtp_layers=int(_get(cfg, "num_nextn_predict_layers", "num_mtp_layers", default=0) or 0),
        source=source,
    )


def _check_mlp_types(types: list, allowed: tuple, n: int, source: str, field_name: str = "mlp_layer_types") -> None:
    if len(types) < n:
        raise UnsupportedModelError(f"len({field_name})", len(types), (n,), source)
    bad = [t for t in types[:n] if t not in allowed]
    if bad:
        raise UnsupportedModelError(field_name, bad[0], allowed, source)


def _mlp(type_name: str, activation: ActivationSpec, dense_inter: int, experts: ExpertsSpec | None,
         *, hash_routed: bool = False) -> MLPSpec:
    if type_name == "dense":
        return MLPSpec("dense", activation, intermediate_size=dense_inter)
    kind = "hash_moe" if hash_routed else "moe"
    return MLPSpec(kind, activation, intermediate_size=experts.intermediate_size, experts=experts)


# -- DeepSeek-V4 ---------------------------------------------------------------------------------


def _v4_layer_types(cfg: dict, n: int, source: str) -> tuple[list[str], dict]:
    """transformers' DeepseekV4Config.__post_init__: explicit layer_types > legacy compress_ratios >
    default (2 HCA, then HCA/CSA alternating starting with HCA); mlp: num_hash_layers hash_moe first."""
    rates = dict(cfg.get("compress_rates") or _V4_DEFAULT_COMPRESS_RATES)
    if cfg.get("compress_rate_csa") is not None:
        rates["compressed_sparse_attention"] = cfg["compress_rate_csa"]
    if cfg.get("compress_rate_hca") is not None:
        rates["heavily_compressed_attention"] = cfg["compress_rate_hca"]
    layer_types, field_name = cfg.get("layer_types"), "layer_types"
    if layer_types is None and cfg.get("compress_ratios") is not None:
        layer_types, field_name = [], "compress_ratios"
        for r in cfg["compress_ratios"]:
            if r not in _V4_RATIO_TO_LAYER_TYPE:
                raise UnsupportedModelError("compress_ratios", r, tuple(_V4_RATIO_TO_LAYER_TYPE), source)
            layer_types.append(_V4_RATIO_TO_LAYER_TYPE[r])
    if layer_types is None:
        interleave = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
        layer_types = ["heavily_compressed_attention"] * min(n, 2) + interleave
    _check_mlp_types(list(layer_types), tuple(_V4_LAYER_KIND), n, source, field_name)
    return list(layer_types[:n]), rates


def _load_deepseek_v4(cfg: dict, quant: QuantSpec, source: str) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    hidden = int(cfg.get("hidden_size", 4096))
    layer_types, rates = _v4_layer_types(cfg, n, source)
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = cfg.get("num_hash_layers")
        n_hash = 3 if n_hash is None else int(n_hash)
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    _check_mlp_types(list(mlp_types), ("hash_moe", "moe"), n, source)

    scoring = cfg["scoring_func"]
    head_dim = int(cfg.get("head_dim", 512))
    factor = cfg.get("partial_rotary_factor")  # transformers: the factor first, legacy qk_rope_head_dim second
    if factor is None:
        legacy = cfg.get("qk_rope_head_dim")
        factor = legacy / head_dim if legacy is not None else 64 / 512
    rope_dim = int(head_dim * factor)
    heads = int(cfg.get("num_attention_heads", 64))
    top_k = int(cfg.get("num_experts_per_tok", 6))
    inter = int(cfg.get("moe_intermediate_size", 2048))
    n_shared = int(cfg.get("n_shared_experts", 1) or 0)
    routing = RoutingSpec(function=scoring, top_k=top_k, correction_bias=True,
                          normalize=bool(cfg.get("norm_topk_prob", True)),
                          scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)))
    # transformers builds one shared MLP of width moe_intermediate_size whenever V4 has shared experts.
    experts = ExpertsSpec(num=int(cfg.get("n_routed_experts", 256)), top_k=top_k, intermediate_size=inter, input_dim=hidden,
                          num_shared=n_shared, shared_intermediate_size=inter if n_shared else 0, routing=routing,
                          format=quant.expert_format)
    activation = ActivationSpec("swiglu", limit=float(cfg.get("swiglu_limit", 10.0)))
    base = dict(num_heads=heads, head_dim=head_dim, num_kv_heads=1, v_head_dim=head_dim, q_lora_rank=int(cfg.get("q_lora_rank", 1024)),
                qk_rope_head_dim=int(rope_dim), sliding_window=int(cfg.get("sliding_window", 128)), sinks=True,
                o_groups=int(cfg.get("o_groups", 8)), o_lora_rank=int(cfg.get("o_lora_rank", 1024)))
    attn_by_type = {
        "sliding_attention": AttentionSpec(kind="swa", **base),
        "compressed_sparse_attention": AttentionSpec(
            kind="csa", compress_ratio=int(rates["compressed_sparse_attention"]),
            index_n_heads=int(cfg.get("index_n_heads", 64)), index_head_dim=int(cfg.get("index_head_dim", 128)),
            index_topk=int(cfg.get("index_topk", 512)), **base),
        "heavily_compressed_attention": AttentionSpec(
            kind="hca", compress_ratio=int(rates["heavily_compressed_attention"]), **base),
    }
    hc_mult = int(cfg.get("hc_mult", 4))
    cross = CrossLayerSpec("hyper_connection", hc_mult=hc_mult, hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
                           hc_eps=float(cfg.get("hc_eps", 1e-6)))
    layers = tuple(
        LayerSpec(i, attn_by_type[layer_types[i]],
                  _mlp("moe", activation, inter, experts, hash_routed=mlp_types[i] == "hash_moe"),
                  quant.dense_format, cross_layer="hyper_connection")
        for i in range(n)
    )
    return ModelSpec(
        model_type="deepseek_v4",
        text_model_type="deepseek_v4",
        vocab_size=int(cfg.get("vocab_size", 129280)),
        hidden_size=hidden,
        layers=layers,
        experts=experts,
        quant=quant,
        cross_layer=cross,
        vision=None,
        context=_context(cfg, default_max=1048576),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mtp_layers=int(cfg.get("num_nextn_predict_layers", 1) or 0),
        source=source,
        extras={"compress_rope_theta": cfg.get("compress_rope_theta")},
    )


# -- gpt-oss -------------------------------------------------------------------------------------


def _load_gpt_oss(cfg: dict, quant: QuantSpec, source: str) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    hidden = int(cfg.get("hidden_size", 2880))
    layer_types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    _check_mlp_types(list(layer_types), ("sliding_attention", "full_attention"), n, source, "layer_types")
    heads = int(cfg.get("num_attention_heads", 64))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    window = cfg.get("sliding_window", 128)
    base = dict(num_heads=heads, head_dim=head_dim, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                v_head_dim=head_dim, sinks=True, bias=bool(cfg.get("attention_bias", True)))
    swa = AttentionSpec(kind="swa", sliding_window=int(window), **base) if window else AttentionSpec(kind="gqa", **base)
    full = AttentionSpec(kind="gqa", **base)
    top_k = int(cfg.get("num_experts_per_tok", 4))
    inter = int(cfg.get("intermediate_size", 2880))
    experts = ExpertsSpec(
        num=int(_get(cfg, "num_local_experts", "num_experts", default=128)), top_k=top_k, intermediate_size=inter,
        input_dim=hidden, num_shared=0, shared_intermediate_size=0,
        routing=RoutingSpec(function="softmax", top_k=top_k, softmax_after_topk=True), format=quant.expert_format, bias=True)
    activation = ActivationSpec("swiglu_clamped", limit=float(cfg.get("swiglu_limit", 7.0)),
                                alpha=float(cfg.get("swiglu_alpha", 1.702)))
    layers = tuple(
        LayerSpec(i, swa if layer_types[i] == "sliding_attention" else full, _mlp("moe", activation, inter, experts),
                  quant.dense_format)
        for i in range(n)
    )
    return ModelSpec(
        model_type="gpt_oss",
        text_model_type="gpt_oss",
        vocab_size=int(cfg.get("vocab_size", 201088)),
        hidden_size=hidden,
        layers=layers,
        experts=experts,
        quant=quant,
        cross_layer=CrossLayerSpec(),
        vision=None,
        context=_context(cfg, default_max=131072, default_theta=GPT_OSS_ROPE_THETA),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        source=source,
    )


# -- GLM-4.5 / 4.6 / 4.7 ---------------------------------------------------------------------------


def rope_fields(cfg: dict, default_theta: float, default_partial: float) -> tuple[dict, float, float]:
    """(rope parameters, theta, partial rotary factor) as transformers reads them: `rope_parameters`
    (or `rope_scaling`) first, then the top-level `rope_theta` / `partial_rotary_factor` that released
    config.json files carry, then the config class's defaults."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    def first(name: str, default: float) -> float:  # an explicit null is absent
        value = params.get(name)
        value = cfg.get(name) if value is None else value
        return float(default if value is None else value)
    return params, first("rope_theta", default_theta), first("partial_rotary_factor", default_partial)


def _load_glm4_moe(cfg: dict, quant: QuantSpec, source: str) -> ModelSpec:
    """GQA (partial rotary, optional QK norm, q/k/v biases) + DeepSeek-V3's MoE: dense first layers, then
    sigmoid-scored group-limited routing with a correction bias and shared experts."""
    n = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)  # a released config field Glm4MoeConfig keeps as is
    _, theta, partial = rope_fields(cfg, GLM4_ROPE_THETA, GLM4_PARTIAL_ROTARY)
    attention = AttentionSpec(kind="gqa", num_heads=heads, head_dim=head_dim,
                              num_kv_heads=int(cfg["num_key_value_heads"] or heads), v_head_dim=head_dim,
                              qk_rope_head_dim=int(head_dim * partial), qk_norm=bool(cfg["use_qk_norm"]),
                              qkv_bias=bool(cfg["attention_bias"]))
    first_dense = min(int(cfg["first_k_dense_replace"] or 0), n)
    mlp_types = ["dense"] * first_dense + ["sparse"] * (n - first_dense)
    activation = _activation(cfg, source)
    experts = None
    if first_dense < n:
        top_k = int(cfg["num_experts_per_tok"])
        routing = _routing_grouped(cfg, "sigmoid", top_k, group_names=("n_group",), correction_bias=True,
                                   normalize_names=("norm_topk_prob",), default_scale=1.0)
        inter, n_shared = int(cfg["moe_intermediate_size"]), int(cfg["n_shared_experts"] or 0)
        experts = ExpertsSpec(num=int(cfg["n_routed_experts"]), top_k=top_k, intermediate_size=inter, input_dim=hidden,
                              num_shared=n_shared, shared_intermediate_size=inter * n_shared, routing=routing,
                              format=quant.expert_format)
    layers = tuple(LayerSpec(i, attention, _mlp(t, activation, int(cfg["intermediate_size"]), experts), quant.dense_format)
                   for i, t in enumerate(mlp_types))
    return _plain_text_spec("glm4_moe", cfg, layers, experts, quant, replace(_context(cfg, default_max=131072), rope_theta=theta),
                            int(cfg["num_nextn_predict_layers"] or 0), source)


def _plain_text_spec(model_type: str, cfg: dict, layers: tuple, experts: ExpertsSpec | None, quant: QuantSpec,
                     context: ContextSpec, mtp_layers: int, source: str) -> ModelSpec:
    """A text model with plain residuals and no vision tower of its own (GLM-4.x, Qwen3.5's text tower)."""
    return ModelSpec(model_type=model_type, text_model_type=model_type, vocab_size=int(cfg["vocab_size"]),
                     hidden_size=int(cfg["hidden_size"]), layers=layers, experts=experts, quant=quant,
                     cross_layer=CrossLayerSpec(), vision=None, context=context,
                     tie_word_embeddings=bool(cfg["tie_word_embeddings"]), mtp_layers=mtp_layers, source=source)


# -- Qwen3.5-MoE -------------------------------------------------------------------------------------


def _load_qwen3_5_moe(cfg: dict, quant: QuantSpec, source: str) -> ModelSpec:
    """Gated DeltaNet layers beside gated GQA layers (one in full_attention_interval), every MLP a softmax-
    routed MoE with a sigmoid-gated shared expert. The MRoPE fields (mrope_section, mrope_interleaved) of
    rope_parameters place the text, height and width positions of image tokens; a text token has all three
    equal, and then MRoPE is 1-D RoPE over the rotated dims."""
    n = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    interval = int(cfg["full_attention_interval"] or 4)
    layer_types = cfg.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    _check_mlp_types(list(layer_types), ("linear_attention", "full_attention"), n, source, "layer_types")
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg["head_dim"] or hidden // heads)
    _, theta, partial = rope_fields(cfg, QWEN3_5_ROPE_THETA, QWEN3_5_PARTIAL_ROTARY)
    full = AttentionSpec(kind="gqa", num_heads=heads, head_dim=head_dim, num_kv_heads=int(cfg["num_key_value_heads"] or heads),
                         v_head_dim=head_dim, qk_rope_head_dim=int(head_dim * partial), qk_norm=True,
                         output_gate="sigmoid", bias=bool(cfg["attention_bias"]))
    gdn = AttentionSpec(kind="gdn", num_heads=int(cfg["linear_num_value_heads"]), num_kv_heads=int(cfg["linear_num_key_heads"]),
                        head_dim=int(cfg["linear_key_head_dim"]), v_head_dim=int(cfg["linear_value_head_dim"]),
                        conv_kernel=int(cfg["linear_conv_kernel_dim"]), output_gate="full_rank")
    top_k, shared = int(cfg["num_experts_per_tok"]), int(cfg["shared_expert_intermediate_size"] or 0)
    experts = ExpertsSpec(num=int(cfg["num_experts"]), top_k=top_k, intermediate_size=int(cfg["moe_intermediate_size"]),
                          input_dim=hidden, num_shared=1 if shared else 0, shared_intermediate_size=shared,
                          routing=RoutingSpec("softmax", top_k, normalize=True), format=quant.expert_format,
                          shared_gate=True)
    activation = _activation(cfg, source)
    layers = tuple(LayerSpec(i, full if t == "full_attention" else gdn, _mlp("moe", activation, 0, experts), quant.dense_format)
                   for i, t in enumerate(layer_types[:n]))
    return _plain_text_spec("qwen3_5_moe_text", cfg, layers, experts, quant,
                            replace(_context(cfg, default_max=32768), rope_theta=theta), int(cfg["mtp_num_hidden_layers"] or 0),
                            source)


# -- Kimi Linear (+ Kimi K3 extensions) --------------------------------------------------------


def _load_kimi_linear(cfg: dict, quant: QuantSpec, source: str) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    hidden = int(cfg.get("hidden_size", 2304))
    lac = cfg.get("linear_attn_config") or {}
    layer_types, field_name = cfg.get("layer_types"), "layer_types"
    if layer_types is None:
        if "full_attn_layers" in lac and "kda_layers" in lac:  # 1-based in the checkpoint
            layer_types, field_name = [None] * n, "linear_attn_config.kda_layers"
            for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
                for i in lac[key] or ():
                    if not 1 <= i <= n:
                        raise UnsupportedModelError(f"linear_attn_config.{key}", i, (f"a layer number in [1, {n}]",),
                                                    source)
                    layer_types[i - 1] = kind
            if None in layer_types:
                raise UnsupportedModelError("linear_attn_config.kda_layers", lac["kda_layers"],
                                            (f"with full_attn_layers, every layer number 1 to {n}: layer "
                                             f"{layer_types.index(None) + 1} is in neither",), source)
        else:
            layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    _check_mlp_types(list(layer_types), ("full_attention", "linear_attention"), n, source, field_name)
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        first_dense = int(cfg.get("first_k_dense_replace", 1))
        mlp_types = ["dense" if i < first_dense else "sparse" for i in range(n)]
    _check_mlp_types(list(mlp_types), ("dense", "sparse"), n, source)
    _check_moe_layer_freq(cfg, source)

    mla = _mla(cfg, nope=bool(cfg.get("mla_use_nope", False)),
               output_gate="sigmoid" if cfg.get("mla_use_output_gate") else None)
    kda_heads = int(_get(lac, "num_heads", default=cfg.get("linear_num_heads", 32)))
    kda = AttentionSpec(
        kind="kda",
        num_heads=kda_heads,
        head_dim=int(_get(lac, "head_dim", default=cfg.get("linear_head_dim", 128))),
        conv_kernel=int(_get(lac, "short_conv_kernel_size", default=cfg.get("linear_conv_kernel_dim", 4))),
        output_gate="full_rank" if lac.get("use_full_rank_gate") else "low_rank",
        gate_lower_bound=lac.get("gate_lower_bound"),
    )
    router_fn = cfg["moe_router_activation_func"]
    activation = _activation(cfg, source)
    experts = None
    if "sparse" in mlp_types:
        top_k = int(_get(cfg, "num_experts_per_token", "num_experts_per_tok", default=8))
        routing = _routing_grouped(cfg, router_fn, top_k, group_names=("num_expert_group", "n_group"), correction_bias=True,
                                   normalize_names=("moe_renormalize", "norm_topk_prob"), default_scale=2.446)
        inter = int(cfg.get("moe_intermediate_size", 1024))
        n_shared = int(_get(cfg, "num_shared_experts", "n_shared_experts", default=1) or 0)
        latent = cfg.get("routed_expert_hidden_size") or None
        experts = ExpertsSpec(
            num=int(_get(cfg, "num_experts", "num_local_experts", default=256)), top_k=top_k, intermediate_size=inter,
            input_dim=int(latent or hidden), num_shared=n_shared, shared_intermediate_size=inter * n_shared,
            routing=routing, format=quant.expert_format, latent_dim=int(latent) if latent else None,
            latent_norm=bool(latent and cfg.get("latent_moe_use_norm", False)))
    block = cfg.get("attn_res_block_size")
    cross = CrossLayerSpec("attention_residual", attn_res_block_size=int(block)) if block else CrossLayerSpec()
    dense_inter = int(cfg.get("intermediate_size", 9216))
    layers = tuple(
        LayerSpec(i, mla if layer_types[i] == "full_attention" else kda, _mlp(mlp_types[i], activation, dense_inter, experts),
                  quant.dense_format, cross_layer="attention_residual" if block else None)
        for i in range(n)
    )
    return ModelSpec(
        model_type="kimi_linear",
        text_model_type="kimi_linear",
        vocab_size=int(cfg.get("vocab_size", 163840)),
        hidden_size=hidden,
        layers=layers,
        experts=experts,
        quant=quant,
        cross_layer=cross,
        vision=None,
        context=_context(cfg, default_max=1048576),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mtp_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
        source=source,
    )


# -- vision towers -------------------------------------------------------------------------------


def _parse_vision(v: dict, model_type: str, cfg: dict, text_hidden: int) -> VisionSpec:
    """MoonViT (Kimi K2.5, transformers' Kimi_K25VisionConfig names or the remote-code `vt_*` names)
    and MoonViT3d (Kimi K3: RMSNorm, qkv_hidden_size, fixed position embedding, no biases)."""
    if model_type == "qwen3_5_moe":  # Qwen3_5MoeVisionConfig's names and defaults
        merge = int(v.get("spatial_merge_size", 2))
        return VisionSpec(
            kind="qwen3_5_vit", num_layers=int(v.get("depth", 27)), hidden_size=int(v.get("hidden_size", 1152)),
            intermediate_size=int(v.get("intermediate_size", 4304)), num_heads=int(v.get("num_heads", 16)),
            patch_size=int(v.get("patch_size", 16)), merge_kernel=(merge, merge),
            text_hidden_size=int(v.get("out_hidden_size", 3584)), norm="layer_norm", bias=True,
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            num_positions=int(v.get("num_position_embeddings", 2304)))
    merge = tuple(v.get("merge_kernel_size") or (2, 2))
    if model_type == "kimi_k3":
        return VisionSpec(
            kind="moonvit3d",
            num_layers=int(_get(v, "vt_num_hidden_layers", "num_hidden_layers", default=27)),
            hidden_size=int(_get(v, "vt_hidden_size", "hidden_size", default=1024)),
            intermediate_size=int(_get(v, "vt_intermediate_size", "intermediate_size", default=4096)),
            num_heads=int(_get(v, "vt_num_attention_heads", "num_attention_heads", default=12)),
            patch_size=int(v.get("patch_size", 14)),
            merge_kernel=merge,
            text_hidden_size=int(v.get("text_hidden_size", text_hidden)),
            qkv_hidden_size=int(v.get("qkv_hidden_size", 1536)),
            pos_emb=None if "fixed" in str(v.get("pos_emb_type", "divided_fixed")) else
            (int(v.get("init_pos_emb_height", 64)), int(v.get("init_pos_emb_width", 64))),
            norm="rms_norm" if v.get("norm_type", "rmsnorm") == "rmsnorm" else "layer_norm",
            bias=bool(v.get("linear_bias", False)),
            projector_hidden_size=int(v.get("mm_hidden_size", 1024)) * merge[0] * merge[1],
        )
    hidden = int(_get(v, "vt_hidden_size", "hidden_size", default=1152))
    return VisionSpec(
        kind="moonvit",
        num_layers=int(_get(v, "vt_num_hidden_layers", "num_hidden_layers", default=27)),
        hidden_size=hidden,
        intermediate_size=int(_get(v, "vt_intermediate_size", "intermediate_size", default=4304)),
        num_heads=int(_get(v, "vt_num_attention_heads", "num_attention_heads", default=16)),
        patch_size=int(v.get("patch_size", 14)),
        merge_kernel=merge,
        text_hidden_size=text_hidden,
        pos_emb=(int(_get(v, "init_pos_emb_height", "pos_emb_height", default=64)),
                 int(_get(v, "init_pos_emb_width", "pos_emb_width", default=64))),
        norm="layer_norm",
        bias=True,
        projector_hidden_size=int(_get(cfg, "projection_hidden_size", default=1152) or hidden),  # Kimi_K25Config's default
    )
