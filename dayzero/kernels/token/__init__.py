"""Per-token layer kernels: rms_norm, add_rms_norm, rope and rope_kv_write on CUDA, one launch each (the references take several
PyTorch ops, and at decode a step's host time is mostly launches).

Importing this package registers the "triton" kernels; Triton is imported at the first call. Each
declines (`supports`) what it does not handle, which then runs on the reference op (dayzero/ops/norm.py,
dayzero/ops/rope.py).

    _rms_norm   one program per row: float32 statistics, the reference's rounding order (weight before or
                after the cast back)
    _rope       one program per (token, head block): either pair layout, float32 arithmetic
    _kv_write   rope_kv_write: a GQA layer's q and k rotated, k and v written into their paged streams
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


def supports_rope_kv_write(q, k, v, cos, sin, interleaved, k_data, v_data, pages, offsets, k_scales=None,
                           v_scales=None) -> bool:
    """Streams of the inputs' dtype (an FP8 stream's quantization stays on the reference op)."""
    if k_scales is not None or v_scales is not None or q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        return False
    n, d = q.shape[0], q.shape[-1]
    return (supports_rope(q, cos, sin, interleaved) and k.dtype == v.dtype == q.dtype and k.shape[0] == n
            and k.shape[-1] == d and k.stride(-1) == 1 and v.stride(-1) == 1 and k.is_cuda and v.is_cuda
            and all(t.is_cuda and t.dim() == 4 and t.dtype == q.dtype and t.stride(-1) == 1
                    and tuple(t.shape[2:]) == tuple(k.shape[1:]) for t in (k_data, v_data))
            and all(t.is_cuda and t.dtype == torch.int64 and t.shape == (n,) for t in (pages, offsets)))


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


def rope_kv_write(*args, **kwargs):
    from dayzero.kernels.token import _kv_write

    return _kv_write.rope_kv_write(*args, **kwargs)


def rope(x, cos, sin, interleaved):
    from dayzero.kernels.token import _rope

    return _rope.rope(x, cos, sin, interleaved)


REGISTRY.register_kernel("rms_norm", rms_norm, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_rms_norm)
REGISTRY.register_kernel("add_rms_norm", add_rms_norm, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_add_rms_norm)
REGISTRY.register_kernel("rope", rope, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_rope)
REGISTRY.register_kernel("rope_kv_write", rope_kv_write, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_rope_kv_write)
