"""moe_experts_mxfp4 "triton": routed experts in canonical MXFP4, path A or path B chosen per call.

Path A (`moe_experts_mxfp4_fused`): the packed E2M1 codes and E8M0 scales are read straight from the
canonical layout and upcast to bf16 in registers (moe_gemm's docstring has the bit manipulation);
activations bf16, accumulation float32; 0.53125 weight bytes read per parameter of an active expert.
No host synchronisation: the decode path, captured in CUDA graphs.
Path B (moe_fp8.moe_experts_mxfp4_fp8): the active experts converted to FP8 into the cross-layer
workspace (reused across calls and layers until evicted), FP8 GEMM on the tensor cores; one host
synchronisation per call: the prefill path.

Eager calls of path A at decode sizes on CUDA replay a CUDA graph of the layer (kernels/moe_graphs.py:
one per layer and token bucket, DAYZERO_MOE_GRAPHS=0 turns it off): their host time, not the kernels,
bounded an eager decode step.

Selection (`select_path`), per call: DAYZERO_MOE_PATH = auto (default) | a | b, or the `path` argument.
auto picks B only where it measured faster than A: the device's workspace already holds every expert
of this layer (so the call converts nothing), the call has DAYZERO_MOE_B_MIN_TOKENS to
DAYZERO_MOE_B_MAX_TOKENS tokens (defaults DEFAULT_B_MIN_TOKENS, DEFAULT_B_MAX_TOKENS: excluded),
no CUDA graph is being captured, and path A's prefill kernel is moe_mma, not moe_wgmma (sm_90): since
moe_wgmma (2026-12-01, third run, bench/moe_wgmma.py) A takes 1.21 / 1.70 ms on gpt-oss-120b at 512 /
2048 tokens and 2.26 / 2.34 ms on DeepSeek-V4, against a warm B's 2.08 / 2.94 and 3.48 / 3.80 ms below;
else A. Forcing "b" with a workspace too small for the call's
active experts raises ValueError naming the workspace setting.
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
# Tokens per call for which auto picks a warm path B, from the H200 run of bench/moe.py (2026-12-01,
# BENCHMARKS.md), path A (prefill kernel moe_mma) eager vs path B with every expert resident / with an
# empty workspace, gpt-oss-120b: 2.05 vs 2.16 / 5.08 ms at 128 tokens, 2.17 vs 2.08 / 5.12 at 512,
# 3.19 vs 2.94 / 5.95 at 2048, 7.33 vs 7.60 / 10.59 at 8192; DeepSeek-V4: 2.85 vs 3.02 / 8.34 at 128,
# 4.05 vs 3.48 / 9.30 at 512, 4.03 vs 3.80 / 9.63 at 2048, 10.69 vs 10.94 / 16.58 at 8192. A cold B
# is slower than A at every size, so B is never picked when it would convert.
DEFAULT_B_MIN_TOKENS = 512
DEFAULT_B_MAX_TOKENS = 4096
B_MAX_TOKENS_ENV = "DAYZERO_MOE_B_MAX_TOKENS"


def _setting_path() -> str:
    path = os.environ.get(PATH_ENV, "auto").lower()
    if path not in PATHS:
        raise ValueError(f"{PATH_ENV} must be one of {', '.join(PATHS)}, got {path!r}")
    return path


def _tokens_setting(env: str, default: int) -> int:
    raw = os.environ.get(env)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{env} must be a whole number of tokens, got {raw!r}") from None


def b_min_tokens() -> int:
    return _tokens_setting(B_MIN_TOKENS_ENV, DEFAULT_B_MIN_TOKENS)


def b_max_tokens() -> int:
    return _tokens_setting(B_MAX_TOKENS_ENV, DEFAULT_B_MAX_TOKENS)


def select_path(x: torch.Tensor, topk_ids: torch.Tensor, experts, path: str | None = None) -> str:
    """"a" or "b" for this call (module docstring)."""
    path = (path or _setting_path()).lower()
    if path not in PATHS:
        raise ValueError(f"moe_experts_mxfp4: path must be one of {', '.join(PATHS)}, got {path!r}")
    if path != "auto":
        return path
    tokens = topk_ids.shape[0]
    if not b_min_tokens() <= tokens < b_max_tokens() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return "a"
    from dayzero.kernels.moe_wgmma import available

    if available(x):  # path A's Gluon prefill kernel beats a warm B at every size measured (module docstring)
        return "a"
    from dayzero.kernels.fp8_workspace import default_workspace

    return "b" if len(default_workspace(x.device).resident(experts)) == experts.num_experts else "a"


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
    if configs is None:  # eager decode sizes on CUDA: replay this layer's graph (kernels/moe_graphs.py)
        from dayzero.kernels.moe_graphs import graphed

        return graphed(lambda a, i, w: _fused(a, i, w, experts, activation, None), x, topk_ids, topk_weights,
                       experts, activation)
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
                     inter=n13 // 2, configs=configs, high_scales=lambda: scale_facts(experts, s13, s2)[0],
                     normal_scales=lambda: scale_facts(experts, s13, s2)[1])


def scale_facts(experts, s13: torch.Tensor, s2: torch.Tensor) -> tuple[bool, bool]:
    """(high, normal) over every E8M0 byte of the layer: high, some byte exceeds 128 (the prefill kernel
    then multiplies twice per code pair, moe_wgmma); normal, every byte lies in 1..254 (no subnormal
    2^-127, no NaN: the decode kernels then turn a byte into its float32 factor with one shift,
    moe_decode._e8m0_factor). One host synchronisation per layer object, at its first call, cached on
    it with the scale tensors' storage and version counters (an in-place change of the scales, a weight
    reload, recomputes it); during CUDA graph capture nothing is computed and (True, False) is returned
    (always exact)."""
    key = (s13.data_ptr(), s13._version, s2.data_ptr(), s2._version)
    cached = getattr(experts, "_dayzero_scale_facts", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    if s13.is_cuda and torch.cuda.is_current_stream_capturing():
        return True, False
    high = (s13 > 128).any() | (s2 > 128).any()
    normal = ((s13 - 1) < 254).all() & ((s2 - 1) < 254).all()  # uint8: 0 wraps to 255
    facts = (bool(high), bool(normal))
    experts._dayzero_scale_facts = (key, facts)
    return facts
