"""The operator library: each op is a reference function (the specification) plus optional kernels.

Importing this package defines the built-in ops in `REGISTRY`. Call an op like a function,
`ops.rms_norm(x, w, eps)`; the registry picks the implementation from the inputs' device.
"""

from typing import Iterable

from dayzero.ops.registry import REGISTRY, Registry, reference_op
from dayzero.ops.norm import add_rms_norm, layer_norm, rms_norm
from dayzero.ops.rope import rope
from dayzero.ops.kv_write import rope_kv_write
from dayzero.ops.activation import swiglu, swiglu_clamped
from dayzero.ops.embedding import embedding
from dayzero.ops.linear import linear, linear_fp8_block, linear_mxfp4
from dayzero.ops.moe import Activation, ExpertWeights, moe_experts_bf16, moe_experts_fp8, moe_experts_mxfp4
from dayzero.ops.quant import mxfp4_dequantize, mxfp4_to_fp8_op as mxfp4_to_fp8
from dayzero.ops.routing_softmax import route_softmax_topk
from dayzero.ops.routing_deepseek import route_sigmoid_grouped
from dayzero.ops.routing_v4 import route_hash, route_sqrtsoftplus
from dayzero.ops.attention_gqa import gqa_attention, paged_gqa_attention
from dayzero.ops.attention_mla import mla_attention, paged_mla_attention, paged_sparse_mla_attention, sparse_mla_attention
from dayzero.ops.dsa import lightning_indexer, paged_index_topk, topk_select
from dayzero.ops.attention_v4 import kv_compressor, sparse_attention, v4_index_topk, v4_indexer, v4_topk_select
from dayzero.ops.attention_v4_paged import paged_v4_attention, paged_v4_index_topk
from dayzero.ops.hyper_connection import hyper_connection, hyper_connection_post
from dayzero.ops.kda import (gated_rms_norm, kda_chunk, kda_chunk_varlen, kda_gate, kda_recurrent, kda_recurrent_slots,
                             short_conv1d, short_conv1d_varlen)
from dayzero.ops.gdn import gdn_chunk, gdn_chunk_varlen, gdn_recurrent, gdn_recurrent_slots
from dayzero.ops.k3 import attention_residual, situ
from dayzero.ops.vision import gelu, varlen_attention, vision_pos_embed
import dayzero.kernels  # noqa: E402,F401  (registers the Triton kernels; imports Triton only at their first call)


def backends_for(name: str) -> list[str]:
    """Backends that implement op `name` (reference first); [] when the op is not defined."""
    return REGISTRY.backends_for(name)


def coverage_table(names: Iterable[str] | None = None) -> str:
    """`dayzero ops`: op x backend, and the kernels' variants (DAYZERO_VARIANT checked first)."""
    REGISTRY.check_variants()
    return REGISTRY.coverage_table(names)


# every op is importable under its registry name: `from dayzero.ops import kda_chunk`
__all__ = ["REGISTRY", "Registry", "backends_for", "coverage_table", "reference_op", "Activation", "ExpertWeights",
           *REGISTRY.names()]
