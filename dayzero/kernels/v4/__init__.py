"""DeepSeek-V4 attention kernels registered beside the reference ops (dayzero/ops/attention_v4.py) for
CUDA; importing this package imports no Triton.

    _compressor  kv_compressor "triton": one program per compressed entry, its slots read from the
                 projected tokens in place (CSA's overlapping halves and the carried window included),
                 the per-channel softmax, the pooling and the RMSNorm in one launch (the reference takes
                 about fifty PyTorch ops a call, and a decode step calls it once per compressor)

Not yet: the window + compressed attention and the CSA indexer over the paged streams (issue 28).
"""

from __future__ import annotations

import torch

from dayzero.kernels.devices import triton_cuda
from dayzero.ops.registry import REGISTRY

PRIORITY = 10  # above the reference
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_RATIO, MAX_DIM = 128, 1024


def supports_kv_compressor(kv, gate, ape, norm_weight, eps, overlap, prev_kv=None, prev_gate=None) -> bool:
    """Contiguous [B, tokens, C] kv and gate of one dtype, whole windows, float32 ape [ratio, C]; else the
    reference runs (and raises what is wrong)."""
    if not (isinstance(kv, torch.Tensor) and kv.is_cuda and kv.dtype in DTYPES and kv.dim() == 3 and kv.is_contiguous()):
        return False
    if not (isinstance(gate, torch.Tensor) and gate.shape == kv.shape and gate.dtype == kv.dtype and gate.is_contiguous()):
        return False
    if ape.dim() != 2 or ape.dtype != torch.float32 or not ape.is_contiguous() or ape.shape[1] != kv.shape[2]:
        return False
    ratio, c = ape.shape
    d = c // 2 if overlap else c
    if not 1 <= ratio <= MAX_RATIO or d > MAX_DIM or kv.shape[1] % ratio or (overlap and c % 2):
        return False
    if norm_weight.shape != (d,) or not norm_weight.is_contiguous() or not norm_weight.is_cuda:
        return False
    if (prev_kv is None) != (prev_gate is None) or (prev_kv is not None and not overlap):
        return False
    return prev_kv is None or all(t.shape == (kv.shape[0], ratio, c) and t.is_contiguous() and t.is_cuda
                                  for t in (prev_kv, prev_gate))


def kv_compressor(*args, **kwargs):
    from dayzero.kernels.v4 import _compressor

    return _compressor.kv_compressor(*args, **kwargs)


REGISTRY.register_kernel("kv_compressor", kv_compressor, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_kv_compressor)
