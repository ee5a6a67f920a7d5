"""Dense projections with FP8 block-scaled weights on CUDA: `linear_fp8_block` (DeepSeek-V3 / V3.2 / V4,
Kimi K2 release checkpoints: e4m3 weights [N, K] with one scale per 128 x 128 block), where the reference
op dequantizes the whole weight through float32 at every call (a V3.2 decode step at batch 1 spent
about 20 ms of its 21.6 there: BENCHMARKS.md).

Importing this package registers the "triton" kernel; Triton is imported at the first call. `supports`
declines what it does not handle (then the reference op runs): x bf16 / fp16 / float32 on CUDA with
unit stride in K, the weight float8_e4m3fn [N, K] contiguous, scales float32 or float8_e8m0fnu
[ceil(N/bn), ceil(K/bk)] contiguous with bk a power of two in [16, 256], a bias of x's dtype or none.

    _fp8_block   the kernels (module docstring) and the one place that chooses between them: a fused
                 GEMM that dequantizes weight tiles as it reads them (few rows: decode), or one dequantize
                 pass into a bf16 copy and cuBLAS (many rows: prefill)
"""

from __future__ import annotations

import torch

from dayzero.kernels.devices import triton_cuda
from dayzero.ops.registry import REGISTRY

PRIORITY = 10  # above the reference
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)
VARIANTS = {"auto": "the fused GEMM up to _fp8_block.FUSED_ROWS rows, dequantize + cuBLAS above",
            "fused": "always the fused GEMM", "dequant": "always dequantize + cuBLAS"}


def supports_linear_fp8_block(x, weight, scale_inv, bias=None, block=(128, 128)) -> bool:
    if not (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in DTYPES and x.dim() >= 1):
        return False
    if not (weight.is_cuda and weight.dtype == torch.float8_e4m3fn and weight.dim() == 2 and weight.is_contiguous()):
        return False
    n, k = weight.shape
    bn, bk = (int(b) for b in block)
    grid = (-(-n // bn), -(-k // bk))
    if x.shape[-1] != k or x.stride(-1) != 1 or bk < 16 or bk > 256 or bk & (bk - 1) or bn < 1:
        return False
    if not (scale_inv.is_cuda and scale_inv.dtype in SCALE_DTYPES and tuple(scale_inv.shape) == grid
            and scale_inv.is_contiguous()):
        return False
    return bias is None or (bias.is_cuda and bias.dtype == x.dtype and tuple(bias.shape) == (n,))


def linear_fp8_block(x, weight, scale_inv, bias=None, block=(128, 128)):
    from dayzero.kernels.linear import _fp8_block

    return _fp8_block.linear_fp8_block(x, weight, scale_inv, bias, block)


REGISTRY.register_kernel("linear_fp8_block", linear_fp8_block, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_linear_fp8_block, variants=VARIANTS)
