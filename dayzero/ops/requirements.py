"""Which operators a model needs, by canonical op name, and which backends cover them.

The names below are the vocabulary shared by the spec, the registry and the kernels: an op
registered under another name is not found. `required_ops(layer)` lists what one decoder layer
calls; `model_ops(spec)` adds the model-level parts (embedding, final norm, lm_head, hyper-head,
vision tower). Coverage comes from `dayzero.ops.backends_for`; an op it does not know is
reported with no backend, i.e. missing.
"""

from __future__ import annotations

from dayzero.spec import LayerSpec, ModelSpec

# norms
RMS_NORM = "rms_norm"
ADD_RMS_NORM = "add_rms_norm"  # a plain residual add fused with the norm after it
LAYER_NORM = "layer_norm"
GATED_RMS_NORM = "gated_rms_norm"
# position
ROPE = "rope"
ROPE_KV_WRITE = "rope_kv_write"  # GQA: q and k rotated, k and v written into their paged streams
# projections
EMBEDDING = "embedding"
LINEAR = "linear"  # bf16
LINEAR_FP8_BLOCK = "linear_fp8_block"  # e4m3 weights, one scale per 128x128 block
# attention
# (the paged ops read the KV pool in place, dayzero/ops/paged.py)
MLA_ATTENTION = "paged_mla_attention"
GQA_ATTENTION = "paged_gqa_attention"  # sinks and sliding window are parameters
INDEX_TOPK = "paged_index_topk"  # DSA: lightning-indexer scores and the causal top-k per query
SPARSE_MLA_ATTENTION = "paged_sparse_mla_attention"
KV_COMPRESSOR = "kv_compressor"  # DeepSeek-V4 CSA/HCA compression of ratio-token windows
SPARSE_ATTENTION = "sparse_attention"  # DeepSeek-V4: window + selected compressed entries, with sinks
V4_INDEXER = "v4_indexer"  # DeepSeek-V4 indexer scores over compressed entries (visibility by window)
V4_TOPK_SELECT = "v4_topk_select"
V4_INDEX_TOPK = "v4_index_topk"  # both: the CSA indexer's selection, what the model calls (prefill)
PAGED_V4_INDEX_TOPK = "paged_v4_index_topk"  # the same for decodes, over the paged index keys in place
PAGED_V4_ATTENTION = "paged_v4_attention"  # sparse_attention for decodes, over the paged streams in place
SHORT_CONV1D = "short_conv1d"
KDA_CHUNK = "kda_chunk"  # prefill of [B, T] blocks
KDA_CHUNK_VARLEN = "kda_chunk_varlen"  # a step's prompt chunks packed, states in their slots (what models call)
SHORT_CONV1D_VARLEN = "short_conv1d_varlen"
KDA_RECURRENT = "kda_recurrent"  # decode of [B, T] states (kda_recurrent_slots is what the models call)
KDA_RECURRENT_SLOTS = "kda_recurrent_slots"  # decode, states updated in their pool
KDA_GATE = "kda_gate"  # per-channel log decay from the raw forget gate (plain or lower-bounded); GDN's per head
GDN_CHUNK = "gdn_chunk"  # Gated DeltaNet prefill of [B, T] blocks
GDN_CHUNK_VARLEN = "gdn_chunk_varlen"  # a step's prompt chunks packed, states in their slots (what models call)
GDN_RECURRENT = "gdn_recurrent"  # decode of [B, T] states
GDN_RECURRENT_SLOTS = "gdn_recurrent_slots"  # decode, states updated in their pool (what models call)
# MoE
ROUTE_SOFTMAX_TOPK = "route_softmax_topk"
ROUTE_SIGMOID_GROUPED = "route_sigmoid_grouped"
ROUTE_SQRTSOFTPLUS = "route_sqrtsoftplus"
ROUTE_HASH = "route_hash"
MOE_EXPERTS_BF16 = "moe_experts_bf16"
MOE_EXPERTS_FP8 = "moe_experts_fp8"
MOE_EXPERTS_MXFP4 = "moe_experts_mxfp4"
# activations
SWIGLU = "swiglu"
SWIGLU_CLAMPED = "swiglu_clamped"  # gpt-oss
SITU = "situ"
# cross-layer
HYPER_CONNECTION = "hyper_connection"  # mix the streams into a block input (also the final hyper-head)
HYPER_CONNECTION_POST = "hyper_connection_post"  # write a block's output back into the streams
ATTENTION_RESIDUAL = "attention_residual"
# vision
VISION_POS_EMBED = "vision_pos_embed"  # MoonViT: the learned grid resampled per image, + time sin/cos
VARLEN_ATTENTION = "varlen_attention"  # bidirectional attention within each packed image
GELU = "gelu"
VISION_ENCODER = "vision_encoder"  # a vision tower dayzero does not run yet (Kimi K3's MoonViT3d): no op has it

ALL_OPS = (
    RMS_NORM, ADD_RMS_NORM, LAYER_NORM, GATED_RMS_NORM, ROPE, ROPE_KV_WRITE, EMBEDDING, LINEAR, LINEAR_FP8_BLOCK,
    MLA_ATTENTION, GQA_ATTENTION, INDEX_TOPK, SPARSE_MLA_ATTENTION, KV_COMPRESSOR,
    SPARSE_ATTENTION, V4_INDEXER, V4_TOPK_SELECT, V4_INDEX_TOPK, PAGED_V4_INDEX_TOPK, PAGED_V4_ATTENTION,
    SHORT_CONV1D, SHORT_CONV1D_VARLEN, KDA_GATE, KDA_CHUNK, KDA_CHUNK_VARLEN, KDA_RECURRENT, KDA_RECURRENT_SLOTS,
    GDN_CHUNK, GDN_CHUNK_VARLEN, GDN_RECURRENT, GDN_RECURRENT_SLOTS,
    ROUTE_SOFTMAX_TOPK, ROUTE_SIGMOID_GROUPED, ROUTE_SQRTSOFTPLUS, ROUTE_HASH,
    MOE_EXPERTS_BF16, MOE_EXPERTS_FP8, MOE_EXPERTS_MXFP4,
    SWIGLU, SWIGLU_CLAMPED, SITU, HYPER_CONNECTION, HYPER_CONNECTION_POST, ATTENTION_RESIDUAL, VISION_POS_EMBED,
    VARLEN_ATTENTION, GELU, VISION_ENCODER,
)

_ROUTE_OP = {"softmax": ROUTE_SOFTMAX_TOPK, "sigmoid": ROUTE_SIGMOID_GROUPED, "sqrtsoftplus": ROUTE_SQRTSOFTPLUS}
# int4 experts run through the same converted-FP8 path as MXFP4 until an int4 kernel exists.
_EXPERTS_OP = {"bf16": MOE_EXPERTS_BF16, "fp8": MOE_EXPERTS_FP8, "mxfp4": MOE_EXPERTS_MXFP4, "int4": MOE_EXPERTS_MXFP4}
_ACTIVATION_OP = {"swiglu": SWIGLU, "swiglu_clamped": SWIGLU_CLAMPED, "situ": SITU}


def _linear_op(fmt: str) -> str:
    return LINEAR_FP8_BLOCK if fmt == "fp8" else LINEAR


def _attention_ops(layer: LayerSpec) -> list[str]:
    a = layer.attention
    ops = [RMS_NORM, _linear_op(layer.linear_format)]
    if a.kind in ("mla", "dsa"):
        if not a.nope:
            ops.append(ROPE)
        ops.append(MLA_ATTENTION)
        if a.kind == "dsa":  # the indexer's key norm is a LayerNorm; short sequences run dense MLA
            ops += [LAYER_NORM, INDEX_TOPK, SPARSE_MLA_ATTENTION]
    elif a.o_groups is not None:  # DeepSeek-V4: swa / csa / hca share one attention over window + compressed
        ops.append(ROPE)
        if a.kind in ("csa", "hca"):
            ops.append(KV_COMPRESSOR)
        if a.kind == "csa":
            ops += [V4_INDEX_TOPK, PAGED_V4_INDEX_TOPK]
        ops += [SPARSE_ATTENTION, PAGED_V4_ATTENTION]
    elif a.kind in ("swa", "gqa"):  # partial rotary: q and k rotated first, then appended (no fused write)
        ops += [ROPE_KV_WRITE, GQA_ATTENTION] if a.qk_rope_head_dim is None else [ROPE, GQA_ATTENTION]
    elif a.kind == "gdn":  # the gate is kda_gate's with one channel a head
        ops += [SHORT_CONV1D, SHORT_CONV1D_VARLEN, KDA_GATE, GDN_CHUNK_VARLEN, GDN_RECURRENT_SLOTS, GATED_RMS_NORM]
    else:  # kda
        ops += [SHORT_CONV1D, SHORT_CONV1D_VARLEN, KDA_GATE, KDA_CHUNK_VARLEN, KDA_RECURRENT_SLOTS, GATED_RMS_NORM]
    return ops


def _mlp_ops(layer: LayerSpec) -> list[str]:
    mlp = layer.mlp
    act = _ACTIVATION_OP[mlp.activation.kind]
    if mlp.kind == "dense":
        return [_linear_op(layer.linear_format), act]
    e = mlp.experts
    ops = [ROUTE_HASH if mlp.kind == "hash_moe" else _ROUTE_OP[e.routing.function], _EXPERTS_OP[e.format], act]
    if e.num_shared:
        ops.append(_linear_op(layer.linear_format))
    if e.latent_dim:
        ops.append(_linear_op(layer.linear_format))
        if e.latent_norm:
            ops.append(RMS_NORM)
    return ops


def required_ops(layer: LayerSpec) -> list[str]:
    """Canonical ops one decoder layer calls, without duplicates, in call order."""
    ops = _attention_ops(layer) + _mlp_ops(layer)
    if layer.cross_layer == "hyper_connection":
        ops += [HYPER_CONNECTION, HYPER_CONNECTION_POST]
    elif layer.cross_layer == "attention_residual":
        ops.append(ATTENTION_RESIDUAL)
    else:  # plain pre-norm residuals: each add fused with the next norm
        ops.append(ADD_RMS_NORM)
    return list(dict.fromkeys(ops))


def model_level_ops(spec: ModelSpec) -> dict[str, list[str]]:
    """Ops outside the decoder layers, by part."""
    parts = {
        "embedding": [EMBEDDING],
        "final_norm": [RMS_NORM],
        "lm_head": [LINEAR],
    }
    if spec.cross_layer.kind == "hyper_connection":
        parts["hyper_head"] = [HYPER_CONNECTION]
    elif spec.cross_layer.kind == "attention_residual":
        parts["output_mix"] = [ATTENTION_RESIDUAL]
    if spec.vision is not None and spec.vision.kind == "moonvit":  # patch embedding = linear (models/moonvit.py)
        parts["vision_tower"] = [LINEAR, VISION_POS_EMBED, LAYER_NORM, ROPE, VARLEN_ATTENTION, GELU]
    elif spec.vision is not None:
        parts["vision_tower"] = [VISION_ENCODER]
    return parts


def model_ops(spec: ModelSpec) -> list[str]:
    """Every canonical op the model needs, without duplicates."""
    ops: list[str] = []
    for layer in spec.layers:
        ops += required_ops(layer)
    for part_ops in model_level_ops(spec).values():
        ops += part_ops
    return list(dict.fromkeys(ops))


def backends_for(op_name: str) -> list[str]:
    """Backends implementing op_name, [] when none (or when the registry is not importable)."""
    try:
        from dayzero import ops
    except ImportError:
        return []
    return list(ops.backends_for(op_name))


def coverage(ops: list[str]) -> dict[str, list[str]]:
    """{op: backends}; an empty list means the op has no implementation yet."""
    return {op: backends_for(op) for op in ops}
