"""Triton attention kernels over the paged KV pool (dayzero.ops.paged), registered beside the reference
ops for CUDA; importing this package imports no Triton.

    _mla_ops        paged_mla_attention "triton": the step split into decode and prefill runs; supports
    _mla_decode     absorbed-form split-KV decode (all heads of a sequence in one tile) and its split merge;
                    with SPARSE, paged_sparse_mla_attention (each query row over its selected keys)
    _mla_prefill    expanded-form varlen causal flash attention over gathered, up-projected latents
    gqa             paged_gqa_attention "triton": checks, supports, the entry that runs a plan
    gqa_choose      `choose`: which GQA kernel takes which sequences, splits and tiles (host sizes only)
    _gqa_decode     GQA split-KV decode (flash-decoding, a kv head's query group in one tile) and its reduce
    _gqa_prefill    GQA flash-attention prefill over packed varlen queries with cached prefixes
    _paged_tile     page lookup, paged tile load (FP8 dequantisation) and the product the GQA kernels share
"""

from dayzero.kernels.attention._mla_ops import register_mla
from dayzero.kernels.attention.gqa import register_gqa
from dayzero.ops.registry import REGISTRY

register_mla(REGISTRY)
register_gqa(REGISTRY)
