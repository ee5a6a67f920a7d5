"""Triton attention kernels over the paged KV pool (dayzero.ops.paged), registered beside the reference
ops for CUDA; importing this package imports no Triton.

    _mla_ops      paged_mla_attention "triton": the step split into decode and prefill runs; supports
    _mla_decode   absorbed-form split-KV decode (all heads of a sequence in one tile) and its split merge
    _mla_prefill  expanded-form varlen causal flash attention over gathered, up-projected latents
"""

from dayzero.kernels.attention._mla_ops import register_mla
from dayzero.ops.registry import REGISTRY

register_mla(REGISTRY)
