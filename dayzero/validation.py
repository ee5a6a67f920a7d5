"""Which configs dayzero runs: the one check `load_spec` applies, so that `dayzero inspect` and the
model loader accept and reject exactly the same configs.

`check_supported(spec, cfg)` runs the validator of the text model's family on the parsed spec and
the text config (defaults already filled in, dayzero.spec.with_defaults). A validator refuses a
value the family's model file would not compute as the reference does (transformers' modeling
code, or the release's for fields transformers lacks) or whose weights it cannot hold: an
`UnsupportedModelError` naming the field, the value and what is supported. A field missing from
config.json has the reference's default and is refused only where that default is unsupported too.
"""

from __future__ import annotations

from typing import Any, Callable

ModelSpec = Any  # dayzero.spec.ModelSpec (not imported: spec imports this module)

FP8_BLOCK = (128, 128)  # the DeepSeek-V3 family's FP8 scale block [out, in]
MXFP4_BLOCK = 32  # values per E8M0 scale along K


class UnsupportedModelError(ValueError):
    """A config value the engine cannot run: names the field, the value, and what is supported."""

    def __init__(self, field_name: str, value: Any, supported: tuple | list | None = None, where: str = ""):
        self.field = field_name
        self.value = value
        self.supported = tuple(supported) if supported is not None else ()
        msg = f"unsupported value {value!r} for config field '{field_name}'"
        if where:
            msg += f" in {where}"
        if self.supported:
            msg += "; supported: " + ", ".join(str(s) for s in self.supported)
        super().__init__(msg)


class _Checker:
    """require(field, ok, supported): raise UnsupportedModelError for `field`'s value unless ok."""

    def __init__(self, spec: ModelSpec, cfg: dict):
        self.cfg = cfg
        self.where = spec.source or f"config.json ({spec.text_model_type})"

    def require(self, field: str, ok: bool, supported: tuple, value: Any = None) -> None:
        if not ok:
            raise UnsupportedModelError(field, self.cfg.get(field) if value is None else value, supported, self.where)


def _rope(cfg: dict) -> tuple[str, dict]:
    """(the config field naming the rope type, e.g. "rope_scaling.type", the rope parameters)."""
    for name in ("rope_scaling", "rope_parameters"):  # as the config wrote it (spec copies rope_scaling over)
        if cfg.get(name):
            params = cfg[name]
            return f"{name}.{'type' if 'type' in params and 'rope_type' not in params else 'rope_type'}", params
    return "rope_parameters.rope_type", {}


def _rope_kind(params: dict) -> str:
    return params.get("rope_type", params.get("type")) or "default"


def _check_group_routing(check: _Checker, spec: ModelSpec, group_field: str, experts_field: str) -> None:
    e = spec.experts
    r = e.routing
    check.require(group_field, r.n_group >= 1 and e.num % r.n_group == 0, (f"a divisor of {experts_field}={e.num}",),
                  r.n_group)
    check.require(group_field, r.topk_group >= r.n_group or e.num // r.n_group >= 2, (f"at most {experts_field} / 2",),
                  r.n_group)


def _deepseek_v3(spec: ModelSpec, cfg: dict) -> None:
    """deepseek_v3, kimi_k2, deepseek_v32 (models/deepseek_v3.py)."""
    check = _Checker(spec, cfg)
    q = spec.quant
    check.require("quantization_config.quant_method", q.method in (None, "fp8"), ("fp8", None), q.method)
    if q.method == "fp8":
        block = list(q.fp8_block) if q.fp8_block else None
        check.require("quantization_config.weight_block_size", block == list(FP8_BLOCK), (list(FP8_BLOCK),), block)
    check.require("scoring_func", cfg["scoring_func"] == "sigmoid", ("sigmoid",))
    check.require("topk_method", cfg["topk_method"] == "noaux_tc", ("noaux_tc",))
    check.require("hidden_act", cfg["hidden_act"] == "silu", ("silu",))
    a = spec.layers[0].attention
    check.require("num_key_value_heads", a.num_kv_heads == a.num_heads, (a.num_heads,), a.num_kv_heads)
    field, rope = _rope(cfg)
    check.require(field, _rope_kind(rope) in ("default", "yarn"), ("default", "yarn"), _rope_kind(rope))
    e = spec.experts
    if e is not None:
        if e.format == "fp8":  # gate and up rows stack into w13: their 128-row scale blocks must not straddle the seam
            check.require("moe_intermediate_size", e.intermediate_size % FP8_BLOCK[0] == 0,
                          (f"a multiple of {FP8_BLOCK[0]} (FP8 experts)",))
        _check_group_routing(check, spec, "n_group", "n_routed_experts")
    if spec.text_model_type == "deepseek_v32":
        check.require("q_lora_rank", a.q_lora_rank is not None, ("an integer (the indexer reads the q latent)",))
        check.require("index_head_dim", a.index_head_dim >= a.qk_rope_head_dim, (">= qk_rope_head_dim",))


def _deepseek_v4(spec: ModelSpec, cfg: dict) -> None:
    """deepseek_v4 (models/deepseek_v4.py)."""
    check = _Checker(spec, cfg)
    check.require("num_key_value_heads", cfg["num_key_value_heads"] in (1, None), (1,))
    check.require("attention_bias", not cfg["attention_bias"], (False,))
    check.require("mlp_bias", not cfg["mlp_bias"], (False,))
    check.require("hidden_act", cfg["hidden_act"] == "silu", ("silu",))
    check.require("scoring_func", cfg["scoring_func"] == "sqrtsoftplus", ("sqrtsoftplus",))
    check.require("norm_topk_prob", bool(cfg["norm_topk_prob"]), (True,))  # transformers always renormalises
    check.require("n_shared_experts", int(cfg["n_shared_experts"] or 0) == 1, (1,))
    check.require("tie_word_embeddings", not spec.tie_word_embeddings, (False,))
    check.require("sliding_window", int(cfg["sliding_window"] or 0) >= 1, ("an integer >= 1",))
    q = spec.quant
    check.require("quantization_config.quant_method", q.method in (None, "fp8"), ("fp8", None), q.method)
    check.require("expert_dtype", q.expert_format in ("bf16", "fp8", "mxfp4"), ("fp8", "fp4"), q.expert_format)
    block = tuple(q.fp8_block or FP8_BLOCK)
    a = spec.layers[0].attention
    check.require("o_groups", (a.num_heads * a.head_dim) % a.o_groups == 0, ("a divisor of num_attention_heads * head_dim",))
    if q.dense_format == "fp8":  # FP8 blocks of rows must not be split between output groups
        check.require("o_lora_rank", a.o_groups == 1 or a.o_lora_rank % block[0] == 0, (f"a multiple of {block[0]} (FP8 block rows)",))
    e = spec.experts
    if e.format == "fp8":
        check.require("moe_intermediate_size", e.intermediate_size % block[0] == 0, (f"a multiple of {block[0]}",))
    if e.format == "mxfp4":
        check.require("moe_intermediate_size", e.intermediate_size % MXFP4_BLOCK == 0, (f"a multiple of {MXFP4_BLOCK}",))
        check.require("hidden_size", spec.hidden_size % MXFP4_BLOCK == 0, (f"a multiple of {MXFP4_BLOCK}",))


def _gpt_oss(spec: ModelSpec, cfg: dict) -> None:
    """gpt_oss (models/gpt_oss.py)."""
    check = _Checker(spec, cfg)
    q = spec.quant
    check.require("quantization_config.quant_method", q.method in (None, "mxfp4") and q.dense_format == "bf16",
                  ("mxfp4", None), q.method)
    e = spec.experts
    if e.format == "mxfp4":
        for name, size in (("hidden_size", spec.hidden_size), ("intermediate_size", e.intermediate_size)):
            check.require(name, size % MXFP4_BLOCK == 0, (f"a multiple of {MXFP4_BLOCK} (MXFP4 blocks)",), size)
    a = spec.layers[0].attention
    check.require("num_key_value_heads", a.num_kv_heads > 0 and a.num_heads % a.num_kv_heads == 0,
                  (f"a divisor of num_attention_heads={a.num_heads}",), a.num_kv_heads)
    check.require("head_dim", a.head_dim % 2 == 0, ("an even number (rope pairs)",), a.head_dim)
    field, rope = _rope(cfg)
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    check.require("partial_rotary_factor", factor == 1.0, (1.0,), factor)
    if rope:  # absent: transformers' GptOssConfig yarn
        check.require(field, _rope_kind(rope) in ("default", "yarn"), ("default", "yarn"), _rope_kind(rope))


def _kimi_linear(spec: ModelSpec, cfg: dict) -> None:
    """kimi_linear and Kimi K3's text tower (models/kimi_linear.py)."""
    check = _Checker(spec, cfg)
    # transformers' Kimi Linear never rotates the MLA (the released remote code rotates when false)
    check.require("mla_use_nope", cfg["mla_use_nope"] is True, (True,))
    check.require("moe_router_activation_func", cfg["moe_router_activation_func"] == "sigmoid", ("sigmoid",))
    check.require("hidden_act", cfg["hidden_act"] in ("silu", "situ"), ("silu", "situ"))
    mla = next((layer.attention for layer in spec.layers if layer.attention.kind == "mla"), None)
    if mla is not None:
        check.require("num_key_value_heads", mla.num_kv_heads == mla.num_heads, (mla.num_heads,), mla.num_kv_heads)
    q = spec.quant
    check.require("quantization_config.quant_method", q.dense_format == "bf16" and q.method in (None, "compressed-tensors"),
                  (None, "compressed-tensors"), q.method)
    e = spec.experts
    if e is not None:
        check.require("quantization_config.format", e.format in ("bf16", "mxfp4"),
                      ("mxfp4-pack-quantized (routed experts)", "unquantized"), e.format)
        if e.format == "mxfp4":
            for name, size in (("moe_intermediate_size", e.intermediate_size), ("routed_expert_hidden_size", e.input_dim)):
                check.require(name, size % MXFP4_BLOCK == 0, (f"a multiple of {MXFP4_BLOCK} (MXFP4 experts)",), size)
        check.require("num_shared_experts", e.num_shared >= 1, (">= 1",), e.num_shared)
        _check_group_routing(check, spec, "num_expert_group", "num_experts")


def _gqa(check: _Checker, a, heads_field: str = "num_attention_heads") -> None:
    """Grouped heads that divide, and a rotated part of at least one pair within head_dim (transformers
    rotates ceil(d / 2) pairs of d = int(head_dim * partial_rotary_factor): the frequencies' count)."""
    check.require("num_key_value_heads", a.num_kv_heads > 0 and a.num_heads % a.num_kv_heads == 0,
                  (f"a divisor of {heads_field}={a.num_heads}",), a.num_kv_heads)
    rot = a.qk_rope_head_dim
    check.require("partial_rotary_factor", 0 < rot and 2 * -(-rot // 2) <= a.head_dim,
                  ("a factor rotating at least one pair within head_dim",), rot / a.head_dim)


def _glm4_moe(spec: ModelSpec, cfg: dict) -> None:
    """glm4_moe (models/glm4_moe.py): bf16 weights as released (GLM-4.5-FP8's compressed-tensors
    per-channel FP8 with dynamic per-token activations is another format, refused)."""
    check = _Checker(spec, cfg)
    q = spec.quant
    check.require("quantization_config.quant_method", q.method is None, (None,), q.method)
    check.require("hidden_act", cfg["hidden_act"] == "silu", ("silu",))
    _gqa(check, spec.layers[0].attention)
    field, rope = _rope(cfg)
    check.require(field, _rope_kind(rope) == "default", ("default",), _rope_kind(rope))
    if spec.experts is not None:
        _check_group_routing(check, spec, "n_group", "n_routed_experts")


def _qwen3_5_moe(spec: ModelSpec, cfg: dict) -> None:
    """qwen3_5_moe_text, the text tower of qwen3_5_moe (models/qwen3_5_moe.py): bf16 weights as released."""
    check = _Checker(spec, cfg)
    q = spec.quant
    check.require("quantization_config.quant_method", q.method is None, (None,), q.method)
    check.require("hidden_act", cfg["hidden_act"] == "silu", ("silu",))
    check.require("shared_expert_intermediate_size", spec.experts.shared_intermediate_size > 0, ("> 0",))
    check.require("num_experts_per_tok", 1 <= spec.experts.top_k <= spec.experts.num, (f"1 ... num_experts={spec.experts.num}",))
    # transformers gates every full-attention layer's output (the released configs say attn_output_gate: true)
    check.require("attn_output_gate", cfg.get("attn_output_gate", True) is True, (True,))
    field, rope = _rope(cfg)
    check.require(field, _rope_kind(rope) == "default", ("default",), _rope_kind(rope))
    for layer in spec.layers:
        a = layer.attention
        if a.kind == "gqa":
            _gqa(check, a)
        else:
            check.require("linear_num_value_heads", a.num_heads % a.num_kv_heads == 0,
                          (f"a multiple of linear_num_key_heads={a.num_kv_heads}",), a.num_heads)
            check.require("linear_conv_kernel_dim", a.conv_kernel >= 1, (">= 1",), a.conv_kernel)


VALIDATORS: dict[str, Callable[[ModelSpec, dict], None]] = {
    "deepseek_v3": _deepseek_v3, "deepseek_v32": _deepseek_v3,
    "deepseek_v4": _deepseek_v4, "gpt_oss": _gpt_oss, "kimi_linear": _kimi_linear, "glm4_moe": _glm4_moe,
    "qwen3_5_moe_text": _qwen3_5_moe,
}


def check_supported(spec: ModelSpec, cfg: dict) -> None:
    """Raise UnsupportedModelError unless dayzero runs `spec` (parsed from the text config `cfg`)."""
    VALIDATORS[spec.text_model_type](spec, cfg)
