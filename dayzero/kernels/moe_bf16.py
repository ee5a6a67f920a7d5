"""Path C: routed experts stored in bf16 (dequantized at load), grouped GEMM in Triton
(moe_experts_bf16, "triton"). The same kernel as path A with the weight tile loaded as bf16, so the
two paths differ only in the bytes they read: 2 per parameter here, 0.53125 for MXFP4.
"""

from __future__ import annotations

import torch

from dayzero.kernels.moe_checks import check_bf16_call
from dayzero.kernels.moe_gemm import moe_layer


def moe_experts_bf16(x, topk_ids, topk_weights, experts, activation, configs=None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with bf16 experts; x bf16 [T, H] -> [T, H]."""
    check_bf16_call(x, topk_ids, topk_weights, experts, activation)

    def run(a, ids, w):
        return moe_layer(a, ids, w, experts.w13, None, experts.w2, None, experts.b13, experts.b2, activation,
                         inter=experts.w13.shape[1] // 2, configs=configs)

    if configs is None:  # eager decode sizes on CUDA: replay this layer's graph (kernels/moe_graphs.py)
        from dayzero.kernels.moe_graphs import graphed

        return graphed(run, x, topk_ids, topk_weights, experts, activation)
    return run(x, topk_ids, topk_weights)
