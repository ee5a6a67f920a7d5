"""Argument checks of the routed-expert kernels, in plain PyTorch (importable without Triton): each
raises ValueError naming the argument a kernel cannot take, instead of letting it read out of bounds.
The registry's `supports` predicates run the same checks and decline instead of raising."""

from __future__ import annotations

import torch

from dayzero.kernels.checks import check_tensor, cuda_supports
from dayzero.ops.moe import Activation, ExpertWeights


def check_routing_args(op: str, x, topk_ids, topk_weights, experts, activation) -> None:
    """Checks shared by the Triton expert ops; ValueError naming the argument."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"{op}: x must be a contiguous bf16 [tokens, hidden] tensor, got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    T = x.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: topk_ids must be int32/int64 [tokens={T}, top_k], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        raise ValueError(f"{op}: topk_weights must be a float tensor shaped like topk_ids {tuple(topk_ids.shape)}, "
                         f"got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}")
    if activation.kind == "swiglu_clamped":
        if activation.alpha is None or activation.limit is None:
            raise ValueError(f"{op}: activation swiglu_clamped needs alpha and limit, got {activation}")
    elif activation.kind != "swiglu":
        raise ValueError(f"{op}: unknown activation {activation.kind!r}; supported: swiglu, swiglu_clamped")


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_biases(op: str, experts, num_experts: int, inter: int, hidden: int, device: torch.device) -> None:
    if experts.b13 is not None:
        check_tensor(op, "experts.b13", experts.b13, (num_experts, 2 * inter), FLOAT_DTYPES, device)
    if experts.b2 is not None:
        check_tensor(op, "experts.b2", experts.b2, (num_experts, hidden), FLOAT_DTYPES, device)


def check_mxfp4_call(x, topk_ids, topk_weights, experts: ExpertWeights, activation: Activation) -> None:
    """moe_experts_mxfp4: canonical MXFP4 w13 [E, 2I, H/32, 16] / w2 [E, H, I/32, 16], uint8
    (or float8_e8m0fnu) scales [E, N, K/32], hidden and intermediate multiples of 32."""
    op = "moe_experts_mxfp4[triton]"
    check_routing_args(op, x, topk_ids, topk_weights, experts, activation)
    if experts.format != "mxfp4":
        raise ValueError(f"{op}: experts.format must be 'mxfp4', got {experts.format!r}")
    w13 = experts.w13
    if not isinstance(w13, torch.Tensor) or w13.dim() != 4:
        raise ValueError(f"{op}: experts.w13 must be uint8 [E, 2I, H/32, 16], got {getattr(w13, 'shape', w13)}")
    E, n13, H = w13.shape[0], w13.shape[1], x.shape[1]
    if H % 32 or n13 % 64:
        raise ValueError(f"{op}: hidden ({H}) and intermediate ({n13 / 2:g}) must be multiples of 32 (MXFP4 blocks)")
    inter = n13 // 2
    scale_dtypes = (torch.uint8, torch.float8_e8m0fnu)
    check_tensor(op, "experts.w13", w13, (E, 2 * inter, H // 32, 16), (torch.uint8,), x.device)
    check_tensor(op, "experts.w13_scale", experts.w13_scale, (E, 2 * inter, H // 32), scale_dtypes, x.device)
    check_tensor(op, "experts.w2", experts.w2, (E, H, inter // 32, 16), (torch.uint8,), x.device)
    check_tensor(op, "experts.w2_scale", experts.w2_scale, (E, H, inter // 32), scale_dtypes, x.device)
    check_biases(op, experts, E, inter, H, x.device)


def _stacked_sizes(op, fmt, dtype_name, x, topk_ids, topk_weights, experts, activation) -> tuple[int, int, int]:
    """Routing checks, the format, and (E, intermediate, hidden) of unpacked stacked experts."""
    check_routing_args(op, x, topk_ids, topk_weights, experts, activation)
    if experts.format != fmt:
        raise ValueError(f"{op}: experts.format must be {fmt!r}, got {experts.format!r}")
    w13 = experts.w13
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"{op}: experts.w13 must be {dtype_name} [E, 2I, H], got {getattr(w13, 'shape', w13)}")
    return w13.shape[0], w13.shape[1] // 2, x.shape[1]


def check_bf16_call(x, topk_ids, topk_weights, experts: ExpertWeights, activation: Activation) -> None:
    """moe_experts_bf16 (path C): bf16 w13 [E, 2I, H] / w2 [E, H, I]."""
    op = "moe_experts_bf16[triton]"
    E, inter, H = _stacked_sizes(op, "bf16", "bf16", x, topk_ids, topk_weights, experts, activation)
    check_tensor(op, "experts.w13", experts.w13, (E, 2 * inter, H), (torch.bfloat16,), x.device)
    check_tensor(op, "experts.w2", experts.w2, (E, H, inter), (torch.bfloat16,), x.device)
    check_biases(op, experts, E, inter, H, x.device)


def check_fp8_call(x, topk_ids, topk_weights, experts: ExpertWeights, activation: Activation) -> None:
    """moe_experts_fp8 (FP8 GEMM): float8_e4m3fn w13 [E, 2I, H] / w2 [E, H, I] with float32 128x128
    block scales [E, ceil(N/128), ceil(K/128)]; hidden and intermediate multiples of 16 (row alignment)."""
    op = "moe_experts_fp8[triton]"
    E, inter, H = _stacked_sizes(op, "fp8", "float8_e4m3fn", x, topk_ids, topk_weights, experts, activation)
    w13 = experts.w13
    if H % 16 or inter % 16:
        raise ValueError(f"{op}: hidden ({H}) and intermediate ({inter}) must be multiples of 16 (row alignment)")
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    fp8 = (torch.float8_e4m3fn,)
    check_tensor(op, "experts.w13", w13, (E, 2 * inter, H), fp8, x.device)
    check_tensor(op, "experts.w13_scale", experts.w13_scale, (E, cdiv(2 * inter, 128), cdiv(H, 128)),
                 (torch.float32,), x.device)
    check_tensor(op, "experts.w2", experts.w2, (E, H, inter), fp8, x.device)
    check_tensor(op, "experts.w2_scale", experts.w2_scale, (E, cdiv(H, 128), cdiv(inter, 128)), (torch.float32,),
                 x.device)
    check_biases(op, experts, E, inter, H, x.device)


supports_mxfp4 = cuda_supports(check_mxfp4_call)
supports_bf16 = cuda_supports(check_bf16_call)
supports_fp8 = cuda_supports(check_fp8_call)
