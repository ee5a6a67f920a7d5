"""Path A: routed experts in canonical MXFP4, fused grouped GEMM in Triton (moe_experts_mxfp4, "triton").

The packed E2M1 codes and E8M0 scales are read straight from the canonical layout and upcast to bf16
in registers (moe_gemm's docstring has the bit manipulation); activations are bf16, accumulation
float32. Weight bytes read per active expert: 0.53125 per parameter (values + scales).
"""

from __future__ import annotations

import torch

from dayzero.formats import mxfp4
from dayzero.kernels.moe_checks import check_mxfp4_call
from dayzero.kernels.moe_gemm import moe_layer


def moe_experts_mxfp4(x, topk_ids, topk_weights, experts, activation, configs=None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with MXFP4 experts; x bf16 [T, H] -> [T, H].
    Runs compiled on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (the tests)."""
    check_mxfp4_call(x, topk_ids, topk_weights, experts, activation)
    E, n13 = experts.w13.shape[:2]
    H = x.shape[1]
    w13 = experts.w13.view(torch.int32).view(E, n13, H // 8)  # int32 words, 8 codes each
    w2 = experts.w2.view(torch.int32).view(E, H, n13 // 16)
    s13 = mxfp4.as_e8m0_bytes(experts.w13_scale, "experts.w13_scale")
    s2 = mxfp4.as_e8m0_bytes(experts.w2_scale, "experts.w2_scale")
    return moe_layer(x, topk_ids, topk_weights, w13, s13, w2, s2, experts.b13, experts.b2, activation,
                     inter=n13 // 2, configs=configs)
