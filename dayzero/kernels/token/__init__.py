"""Per-token layer kernels: rms_norm, add_rms_norm and rope on CUDA, one launch each (the references take several
PyTorch ops, and at decode a step's host time is mostly launches).

Importing this package registers the "triton" kernels; Triton is imported at the first call. Each
declines (`supports`) what it does not handle, which then runs on the reference op (dayzero/ops/norm.py,
dayzero/ops/rope.py).

    _rms_norm   one program per row: float32 statistics, the reference's rounding order (weight before or
                after the cast back)
    _rope       one program per (token, head block): either pair layout, float32 arithmetic
"""

from __future__ import annotations

import torch

from dayzero.kernels.devices import triton_cuda
from dayzero.ops.registry import REGISTRY

PRIORITY = 10  # above the reference
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_DIM = 16384


def supports_rms_norm(x, weight, eps=1e-6, weight_in_float32=False) -> bool:
    return (x.is_cuda and x.dtype in DTYPES and weight.dtype in DTYPES and x.dim() >= 1 and x.numel() > 0
            and weight.shape == x.shape[-1:] and x.shape[-1] <= MAX_DIM and x.stride(-1) == 1
            and weight.is_contiguous() and _rows_viewable(x))


def supports_add_rms_norm(x, residual, weight, eps=1e-6, weight_in_float32=False) -> bool:
    return (supports_rms_norm(x, weight, eps, weight_in_float32) and residual.shape == x.shape
            and residual.dtype == x.dtype and residual.is_cuda and residual.stride(-1) == 1 and _rows_viewable(residual))


def supports_rope(x, cos, sin, interleaved) -> bool:
    return (x.is_cuda and x.dtype in DTYPES and x.dim() in (2, 3) and x.shape[0] > 0 and x.stride(-1) == 1
            and cos.dtype == torch.float32 and sin.dtype == torch.float32 and cos.dim() == 2
            and cos.shape == sin.shape and cos.shape[0] == x.shape[0] and 2 * cos.shape[1] == x.shape[-1]
            and cos.stride(-1) == 1 and sin.stride(-1) == 1 and x.shape[-1] <= 1024)


def _rows_viewable(x: torch.Tensor) -> bool:
    """x [..., D] can be read as rows with one row stride (contiguous leading dims)."""
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return False
    return True


def rms_norm(x, weight, eps=1e-6, weight_in_float32=False):
    from dayzero.kernels.token import _rms_norm

    return _rms_norm.rms_norm(x, weight, eps, weight_in_float32)


def add_rms_norm(x, residual, weight, eps=1e-6, weight_in_float32=False):
    from dayzero.kernels.token import _rms_norm

    return _rms_norm.rms_norm(x, weight, eps, weight_in_float32, residual)


def rope(x, cos, sin, interleaved):
    from dayzero.kernels.token import _rope

    return _rope.rope(x, cos, sin, interleaved)


REGISTRY.register_kernel("rms_norm", rms_norm, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_rms_norm)
REGISTRY.register_kernel("add_rms_norm", add_rms_norm, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_add_rms_norm)
REGISTRY.register_kernel("rope", rope, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_rope)
