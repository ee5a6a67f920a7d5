"""The vision encoder's packed bidirectional attention (`varlen_attention`) on CUDA, through torch's own
kernels (backend "torch"): no kernel of ours, the library ones fit.

    flash      torch.nn.attention.varlen.varlen_attn (FlashAttention-2's varlen kernel inside torch, >= 2.10):
               one launch over every image of the batch; bf16 / fp16, head dim a multiple of 8 up to 256
    sdpa       F.scaled_dot_product_attention once per image (FlashAttention / memory-efficient backends):
               any float dtype (float32 included), one launch per image
`choose` picks flash where it applies, else sdpa; DAYZERO_VARIANT=varlen_attention=sdpa forces the other.
The reference op (dayzero/ops/vision.py) stays the specification and the CPU path.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from dayzero import settings
from dayzero.ops.registry import REGISTRY

PRIORITY = 10
FLASH_DTYPES = (torch.bfloat16, torch.float16)
VARIANTS = {"flash": "torch's varlen_attn (FlashAttention-2 varlen), one launch for the batch",
            "sdpa": "scaled_dot_product_attention per image"}


@functools.cache
def _varlen_attn():
    """(torch's varlen_attn, whether it takes `scale`), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, "scale" in inspect.signature(varlen_attn).parameters


def supports(q, k, v, cu_seqlens, cu_seqlens_host, scale) -> bool:
    return (all(isinstance(t, torch.Tensor) and t.is_cuda for t in (q, k, v, cu_seqlens)) and q.dim() == 3
            and k.shape == q.shape and v.dim() == 3 and v.shape[:2] == q.shape[:2] and q.dtype == k.dtype == v.dtype
            and q.dtype.is_floating_point)


def choose(q, v) -> str:
    forced = settings.get().variant("varlen_attention")
    if forced is not None:
        return forced
    flash = (_varlen_attn() is not None and q.dtype in FLASH_DTYPES and q.shape[-1] == v.shape[-1]
             and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)
    return "flash" if flash else "sdpa"


def varlen_attention(q, k, v, cu_seqlens, cu_seqlens_host, scale):
    if choose(q, v) == "flash":
        return _flash(q, k, v, cu_seqlens, cu_seqlens_host, scale)
    return _sdpa(q, k, v, cu_seqlens_host, scale)


def _flash(q, k, v, cu_seqlens, cu_seqlens_host, scale):
    attn, takes_scale = _varlen_attn()
    longest = max(b - a for a, b in zip(cu_seqlens_host[:-1], cu_seqlens_host[1:]))
    cu = cu_seqlens.to(torch.int32)
    if takes_scale:
        return attn(q, k, v, cu, cu, longest, longest, scale=scale)
    # an older varlen_attn scales by head_dim^-0.5: fold the difference into q
    return attn(q * (scale * q.shape[-1] ** 0.5), k, v, cu, cu, longest, longest)


def _sdpa(q, k, v, cu_seqlens_host, scale):
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for start, end in zip(cu_seqlens_host[:-1], cu_seqlens_host[1:]):
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, L, D]
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[0].transpose(0, 1)
    return out


REGISTRY.register_kernel("varlen_attention", varlen_attention, backend="torch", devices=["cuda"], priority=PRIORITY,
                         available=torch.cuda.is_available, supports=supports, variants=VARIANTS)
