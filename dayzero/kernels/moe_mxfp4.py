"""moe_experts_mxfp4 "triton": routed experts in canonical MXFP4, path A or path B chosen per call.

Path A (`moe_experts_mxfp4_fused`): the packed E2M1 codes and E8M0 scales are read straight from the
canonical layout and upcast to bf16 in registers (moe_gemm's docstring has the bit manipulation);
activations bf16, accumulation float32; 0.53125 weight bytes read per parameter of an active expert.
No host synchronisation: the decode path, captured in CUDA graphs.
Path B (moe_fp8.moe_experts_mxfp4_fp8): the active experts converted to FP8 into the cross-layer
workspace (reused across calls and layers until evicted), FP8 GEMM on the tensor cores; one host
synchronisation per call: the prefill path.

Selection (`select_path`), per call: DAYZERO_MOE_PATH = auto (default) | a | b, or the `path` argument.
auto picks B when the call has at least DAYZERO_MOE_B_MIN_TOKENS tokens (default
DEFAULT_B_MIN_TOKENS), the workspace can hold min(experts, tokens * top_k) experts (the most a call
can activate) and no CUDA graph is being captured; else A. Forcing "b" with a workspace too small for
the call's active experts raises ValueError naming the workspace setting.
"""

from __future__ import annotations

import os

import torch

from dayzero.formats import mxfp4
from dayzero.kernels.moe_checks import check_mxfp4_call
from dayzero.kernels.moe_gemm import moe_layer

PATH_ENV = "DAYZERO_MOE_PATH"
B_MIN_TOKENS_ENV = "DAYZERO_MOE_B_MIN_TOKENS"
PATHS = ("auto", "a", "b")
# Tokens per call from which auto picks path B, from the H200 measurements of bench/moe.py --paths A B
# --prefetch (2026-11-30, docs/kernels.md): per layer, path A eager vs path B with a cold workspace /
# in the steady state of a 2.2-layer workspace with prefetch, gpt-oss-120b: 4.06 vs 5.72 / 5.18 ms at
# 2048 tokens, 6.84 vs 7.01 / 6.23 ms at 4096, 11.6 vs 9.78 / 9.05 ms at 8192; DeepSeek-V4: 7.24 vs
# 9.23 / 7.68 ms at 2048, 11.0 vs 11.2 / 10.1 ms at 4096, 18.9 vs 15.2 / 14.3 ms at 8192. With a warm
# workspace B wins from 512 tokens (a workspace holding every layer's experts makes that the case).
DEFAULT_B_MIN_TOKENS = 4096


def _setting_path() -> str:
    path = os.environ.get(PATH_ENV, "auto").lower()
    if path not in PATHS:
        raise ValueError(f"{PATH_ENV} must be one of {', '.join(PATHS)}, got {path!r}")
    return path


def b_min_tokens() -> int:
    raw = os.environ.get(B_MIN_TOKENS_ENV)
    if raw is None:
        return DEFAULT_B_MIN_TOKENS
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{B_MIN_TOKENS_ENV} must be a whole number of tokens, got {raw!r}") from None


def select_path(x: torch.Tensor, topk_ids: torch.Tensor, experts, path: str | None = None) -> str:
    """"a" or "b" for this call (module docstring)."""
    path = (path or _setting_path()).lower()
    if path not in PATHS:
        raise ValueError(f"moe_experts_mxfp4: path must be one of {', '.join(PATHS)}, got {path!r}")
    if path != "auto":
        return path
    tokens, top_k = topk_ids.shape
    if tokens < b_min_tokens() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return "a"
    from dayzero.kernels.fp8_workspace import default_workspace

    most_active = min(experts.num_experts, tokens * top_k)
    return "b" if default_workspace(x.device).num_slots_for(experts) >= most_active else "a"


def moe_experts_mxfp4(x, topk_ids, topk_weights, experts, activation, configs=None, path: str | None = None,
                      workspace=None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with MXFP4 experts; x bf16 [T, H] -> [T, H].
    path: "a", "b", "auto" or None (the setting); configs: the GEMM tiles of the chosen path;
    workspace: path B's (default: the device's). Runs compiled on CUDA tensors, and on CPU tensors
    under TRITON_INTERPRET=1 (the tests)."""
    check_mxfp4_call(x, topk_ids, topk_weights, experts, activation)
    if select_path(x, topk_ids, experts, path) == "b":
        from dayzero.kernels.moe_fp8 import moe_experts_mxfp4_fp8

        return moe_experts_mxfp4_fp8(x, topk_ids, topk_weights, experts, activation, workspace, configs)
    return _fused(x, topk_ids, topk_weights, experts, activation, configs)


def moe_experts_mxfp4_fused(x, topk_ids, topk_weights, experts, activation, configs=None) -> torch.Tensor:
    """Path A: the fused MXFP4 grouped GEMM (module docstring)."""
    check_mxfp4_call(x, topk_ids, topk_weights, experts, activation)
    return _fused(x, topk_ids, topk_weights, experts, activation, configs)


def _fused(x, topk_ids, topk_weights, experts, activation, configs) -> torch.Tensor:
    E, n13 = experts.w13.shape[:2]
    H = x.shape[1]
    w13 = experts.w13.view(torch.int32).view(E, n13, H // 8)  # int32 words, 8 codes each
    w2 = experts.w2.view(torch.int32).view(E, H, n13 // 16)
    s13 = mxfp4.as_e8m0_bytes(experts.w13_scale, "experts.w13_scale")
    s2 = mxfp4.as_e8m0_bytes(experts.w2_scale, "experts.w2_scale")
    return moe_layer(x, topk_ids, topk_weights, w13, s13, w2, s2, experts.b13, experts.b2, activation,
                     inter=n13 // 2, configs=configs)
