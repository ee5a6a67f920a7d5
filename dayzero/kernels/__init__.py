"""Triton kernels for the operator library, registered beside the reference ops for CUDA.

Importing this package registers the kernels without importing Triton (that happens at the first
call, so TRITON_INTERPRET can still be set by a test session first); a kernel is available where
Triton is installed and a CUDA device exists. Each kernel declines (through `supports`) any call it
does not handle, which then falls to the reference. See docs/kernels.md.

    moe_dispatch  tokens sorted by expert, padded to the GEMM's BLOCK_M; the final k-slot reduction
    moe_gemm      grouped GEMM, MXFP4 (upcast in registers) or bf16 weights, fused SwiGLU/bias/router weight
    moe_decode    path A at decode token counts: int8 activations x E2M1 codes by dp4a, no tensor cores
    moe_mxfp4     moe_experts_mxfp4 "triton": path A or B per call (the selection policy)
    moe_fp8       path B (MXFP4 -> FP8 conversion, FP8 grouped GEMM); moe_experts_fp8 "triton"
    fp8_workspace the cross-layer FP8 expert workspace of path B (LRU slots, stats, prefetch)
    moe_bf16      moe_experts_bf16 "triton" (path C)
    moe_checks    the argument checks (plain PyTorch) and the `supports` predicates
    routing       top-k routing: softmax, sigmoid + bias + group limit, sqrtsoftplus, hash (checks inside;
                  its `supports` predicates import it, and Triton, at the first CUDA call)
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from dayzero.kernels.moe_checks import supports_bf16, supports_fp8, supports_mxfp4
from dayzero.ops.registry import REGISTRY

TRITON_PRIORITY = 10


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_cuda_available() -> bool:
    return triton_installed() and torch.cuda.is_available()


def moe_experts_mxfp4(*args, **kwargs):
    from dayzero.kernels.moe_mxfp4 import moe_experts_mxfp4 as kernel

    return kernel(*args, **kwargs)


def moe_experts_bf16(*args, **kwargs):
    from dayzero.kernels.moe_bf16 import moe_experts_bf16 as kernel

    return kernel(*args, **kwargs)


def moe_experts_fp8(*args, **kwargs):
    from dayzero.kernels.moe_fp8 import moe_experts_fp8 as kernel

    return kernel(*args, **kwargs)


REGISTRY.register_kernel("moe_experts_mxfp4", moe_experts_mxfp4, backend="triton", devices=["cuda"],
                         priority=TRITON_PRIORITY, available=triton_cuda_available, supports=supports_mxfp4)
REGISTRY.register_kernel("moe_experts_bf16", moe_experts_bf16, backend="triton", devices=["cuda"],
                         priority=TRITON_PRIORITY, available=triton_cuda_available, supports=supports_bf16)


def _routing(name: str):
    """dayzero.kernels.routing.<name>, imported (with Triton) at the first call."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module("dayzero.kernels.routing"), name)(*args, **kwargs)

    call.__name__ = name
    return call


for _op, _supports in (("route_softmax_topk", "supports_softmax"), ("route_sigmoid_grouped", "supports_sigmoid_grouped"),
                       ("route_sqrtsoftplus", "supports_sqrtsoftplus"), ("route_hash", "supports_hash")):
    REGISTRY.register_kernel(_op, _routing(_op), backend="triton", devices=["cuda"], priority=TRITON_PRIORITY,
                             available=triton_cuda_available, supports=_routing(_supports))
REGISTRY.register_kernel("moe_experts_fp8", moe_experts_fp8, backend="triton", devices=["cuda"],
                         priority=TRITON_PRIORITY, available=triton_cuda_available, supports=supports_fp8)
import dayzero.kernels.attention  # noqa: E402,F401  (registers the attention kernels)
