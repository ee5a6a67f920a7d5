"""The routed-expert ops as the registry calls them (moe_experts_mxfp4 / bf16 / fp8, backend "triton"):
check the arguments, take the plan choose.py gives the call (or the caller's pinned one), and run it:
a replay of the layer's CUDA graph (_graphs.py) where the plan says so, else the plan's layer:

    decode, decode_sm90  prep (dispatch + quantize x) -> gate/up GEMM -> down GEMM -> combine (_decode.py,
                         the Gluon GEMMs of _decode_sm90.py where the DecodeConfig says so)
    gemm, mma            dispatch -> gate/up GEMM (bias, activation) -> down GEMM (bias, router weight)
                         -> combine (_gemm.py or _mma.py)
    wgmma                dispatch -> gather + permute x -> the two Gluon GEMMs -> combine (_wgmma.py)
    fp8                  MXFP4 weights: the active experts converted into the layer's FP8 workspace
                         (path B, one host synchronisation); FP8 weights: as stored; then _fp8.py's layer

Every layer runs compiled on CUDA tensors and, except the Gluon ones, on CPU tensors under
TRITON_INTERPRET=1 (the tests). No path but B synchronises with the host after the layer's first call.
"""

from __future__ import annotations

import functools

import torch

from dayzero import settings
from dayzero.formats import mxfp4
from dayzero.kernels.devices import interpreted
from dayzero.kernels.moe import _graphs
from dayzero.kernels.moe._checks import check_bf16_call, check_fp8_call, check_mxfp4_call
from dayzero.kernels.moe._common import kernel_activation
from dayzero.kernels.moe._decode import decode_gemm, prep, quantize_rows
from dayzero.kernels.moe._decode_sm90 import decode_gemm_sm90
from dayzero.kernels.moe._dispatch import combine, dispatch
from dayzero.kernels.moe._fp8 import identity_slots, moe_layer_fp8
from dayzero.kernels.moe._gemm import grouped_gemm
from dayzero.kernels.moe._mma import mma_gemm
from dayzero.kernels.moe._state import layer_state
from dayzero.kernels.moe._wgmma import moe_layer_wgmma
from dayzero.kernels.moe.choose import (GLUON_KERNELS, KERNELS, OP_OF_FORMAT, Device, Plan, Shapes, choose,
                                        needs_workspace_state)
from dayzero.kernels.moe.configs import PREP_MAX_PAIRS, DecodeConfig, GemmConfig, MmaConfig, WgmmaConfig


# -- the ops ----------------------------------------------------------------------------------------

def moe_experts_mxfp4(x, topk_ids, topk_weights, experts, activation, plan: Plan | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with MXFP4 experts; x bf16 [T, H] -> [T, H].
    plan: run this instead of choose()'s (a benchmark or a test pinning a kernel and its tiles)."""
    check_mxfp4_call(x, topk_ids, topk_weights, experts, activation)
    return _run(plan, x, topk_ids, topk_weights, experts, activation)


def moe_experts_bf16(x, topk_ids, topk_weights, experts, activation, plan: Plan | None = None) -> torch.Tensor:
    """The same with bf16 experts (path C)."""
    check_bf16_call(x, topk_ids, topk_weights, experts, activation)
    return _run(plan, x, topk_ids, topk_weights, experts, activation)


def moe_experts_fp8(x, topk_ids, topk_weights, experts, activation, plan: Plan | None = None) -> torch.Tensor:
    """The same with FP8 E4M3 experts and 128 x 128 float32 block scales (DeepSeek-V3)."""
    check_fp8_call(x, topk_ids, topk_weights, experts, activation)
    return _run(plan, x, topk_ids, topk_weights, experts, activation)


@functools.lru_cache(maxsize=64)
def _device(device: torch.device, capturing: bool) -> Device:
    return Device.of(device, capturing=capturing, interpreted=interpreted())


def device_of(x: torch.Tensor) -> Device:
    """The Device facts of a call on x (a CUDA graph being captured included)."""
    return _device(x.device, x.is_cuda and torch.cuda.is_current_stream_capturing())


def shapes_of(x: torch.Tensor, topk_ids: torch.Tensor, experts) -> Shapes:
    return Shapes(experts.format, x.shape[0], topk_ids.shape[1], experts.w13.shape[0], x.shape[1],
                  experts.w13.shape[1] // 2)


def plan_for(x: torch.Tensor, topk_ids: torch.Tensor, experts) -> Plan:
    """The plan choose() gives this call: its shapes, its device, the settings, and (for MXFP4 in path
    B's token range) whether the layer's workspace holds every expert of the layer."""
    shapes, device, current = shapes_of(x, topk_ids, experts), device_of(x), settings.get()
    warm = False
    if needs_workspace_state(shapes, device, current):
        workspace = experts.workspace
        warm = workspace is not None and workspace.holds_layer(experts)
    return choose(shapes, device, current, workspace_warm=warm)


def _run(plan: Plan | None, x, topk_ids, topk_weights, experts, activation) -> torch.Tensor:
    """Run the caller's plan (checked first) or, with None, the one choose() gives the call."""
    if plan is None:
        plan = plan_for(x, topk_ids, experts)
    else:
        _check_plan(plan, experts.format, x)
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    layer = _LAYERS[plan.kernel]

    def run(a, ids, w):
        return layer(plan, a, ids, w, experts, activation)

    if plan.graph_tokens:
        return _graphs.replay(run, plan, x, topk_ids, topk_weights, experts, activation)
    return run(x, topk_ids, topk_weights)


_CONFIGS = {"decode": DecodeConfig, "decode_sm90": DecodeConfig, "wgmma": WgmmaConfig, "gemm": (GemmConfig, GemmConfig),
            "mma": (MmaConfig, MmaConfig), "fp8": (GemmConfig, GemmConfig)}


def _check_plan(plan: Plan, weights: str, x: torch.Tensor) -> None:
    """A pinned plan must name a kernel of the op, its config type, and a device the kernel runs on."""
    op = OP_OF_FORMAT[weights]
    if plan.kernel not in KERNELS[op]:
        raise ValueError(f"{op}: no kernel {plan.kernel!r}; its kernels: {', '.join(KERNELS[op])}")
    want = _CONFIGS[plan.kernel]
    ok = (isinstance(plan.config, tuple) and len(plan.config) == 2 and all(map(isinstance, plan.config, want))
          if isinstance(want, tuple) else isinstance(plan.config, want))
    if not ok:
        name = f"({want[0].__name__}, {want[1].__name__})" if isinstance(want, tuple) else want.__name__
        raise ValueError(f"{op}: kernel {plan.kernel!r} takes a {name} config, got {plan.config!r}")
    gluon = plan.kernel in GLUON_KERNELS or (isinstance(plan.config, DecodeConfig) and plan.config.gluon)
    if gluon and not device_of(x).sm90:
        raise ValueError(f"{op}: kernel {plan.kernel!r} with {plan.config} runs Gluon code, compiled for sm_90 only; "
                         f"x is on {x.device}{' (interpreted)' if interpreted() else ''}")


# -- the layers -------------------------------------------------------------------------------------

def _mxfp4_operands(experts, hidden: int):
    """(w13, s13, w2, s2): the codes as int32 words [E, N, K/8], the scales as E8M0 bytes [E, N, K/32]."""
    E, n13 = experts.w13.shape[:2]
    w13 = experts.w13.view(torch.int32).view(E, n13, hidden // 8)  # 8 codes per word
    w2 = experts.w2.view(torch.int32).view(E, hidden, n13 // 16)
    return (w13, mxfp4.as_e8m0_bytes(experts.w13_scale, "experts.w13_scale"), w2,
            mxfp4.as_e8m0_bytes(experts.w2_scale, "experts.w2_scale"))


def scale_facts(experts, s13: torch.Tensor, s2: torch.Tensor) -> tuple[bool, bool]:
    """(high, normal) over every E8M0 byte of the layer: high, some byte exceeds 128 (the wgmma kernel then
    multiplies twice per code pair); normal, every byte lies in 1..254 (no subnormal 2^-127, no NaN: the
    decode kernels then turn a byte into its float32 factor with one shift). One host synchronisation per
    layer, at its first call, kept with the layer (_state.py) with the scale tensors' storage and version
    counters (an in-place change of the scales, a weight reload, recomputes it); during CUDA graph capture
    nothing is computed and (True, False) is returned (always exact)."""
    key = (s13.data_ptr(), s13._version, s2.data_ptr(), s2._version)
    state = layer_state(experts)
    cached = state.get("scale_facts")
    if cached is not None and cached[0] == key:
        return cached[1]
    if s13.is_cuda and torch.cuda.is_current_stream_capturing():
        return True, False
    high = (s13 > 128).any() | (s2 > 128).any()
    normal = ((s13 - 1) < 254).all() & ((s2 - 1) < 254).all()  # uint8: 0 wraps to 255
    facts = (bool(high), bool(normal))
    state["scale_facts"] = (key, facts)
    return facts


def _decode_layer(plan, x, topk_ids, topk_weights, experts, activation) -> torch.Tensor:
    """The decode layer of plan.config (a DecodeConfig): block_m 1 with at most PREP_MAX_PAIRS pairs runs
    the pair-order dispatch (the Gluon GEMMs need it), else prep's sorted one, else the atomic dispatch
    and a quantize launch."""
    config: DecodeConfig = plan.config
    T, H = x.shape
    w13, s13, w2, s2 = _mxfp4_operands(experts, H)
    normal = scale_facts(experts, s13, s2)[1]
    E, inter = w13.shape[0], w13.shape[1] // 2
    pairs = topk_ids.numel()
    pair_ids = None
    if config.block_m == 1 and pairs <= PREP_MAX_PAIRS:
        topk_ids = topk_ids.contiguous()  # the tensor prep reads too: written before prep
        pair_ids = topk_ids.view(-1)
        d, xq, xs = prep(x, topk_ids, E, 1, pair_order=True)
    elif config.gluon:
        raise ValueError(f"moe_experts_mxfp4: the Gluon decode GEMMs need the pair-order dispatch (block_m 1, at "
                         f"most {PREP_MAX_PAIRS} pairs), got block_m {config.block_m} and {pairs} pairs")
    elif pairs <= PREP_MAX_PAIRS:
        d, xq, xs = prep(x, topk_ids, E, config.block_m)
    else:
        d = dispatch(topk_ids, E, config.block_m)
        xq, xs = quantize_rows(x)
    act, alpha = kernel_activation(activation)
    k = topk_ids.shape[1]
    router_weights = topk_weights.contiguous().view(-1)
    if config.gluon1:
        hq, hs = decode_gemm_sm90(xq, xs, w13, s13, experts.b13, pair_ids, top_k=k, out_features=inter, gather=True,
                                  activation=act, alpha=alpha, limit=activation.limit, block_n=config.block_n1,
                                  block_k=config.block_k1, num_warps=config.num_warps1, stages=config.stages1,
                                  normal_scales=normal)
    else:
        hq, hs = decode_gemm(xq, xs, w13, s13, experts.b13, d, out_features=inter, gather=True, activation=act,
                             alpha=alpha, limit=activation.limit, block_n=config.block_n1, block_k=config.block_k1,
                             num_warps=config.num_warps1, stages=config.stages1, pair_ids=pair_ids,
                             normal_scales=normal)
    if config.gluon2:
        y = decode_gemm_sm90(hq, hs, w2, s2, experts.b2, pair_ids, top_k=k, out_features=H, gather=False,
                             router_weights=router_weights, block_n=config.block_n2, block_k=config.block_k2,
                             num_warps=config.num_warps2, stages=config.stages2, normal_scales=normal)
    else:
        y = decode_gemm(hq.view(-1, inter // 2), hs, w2, s2, experts.b2, d, out_features=H, gather=False,
                        router_weights=router_weights, block_n=config.block_n2, block_k=config.block_k2,
                        num_warps=config.num_warps2, stages=config.stages2, pair_ids=pair_ids, early=config.early2,
                        normal_scales=normal)
    return combine(y, d, T, x.dtype)


def _tensor_core_layer(plan, x, topk_ids, topk_weights, experts, activation) -> torch.Tensor:
    """The gemm or mma layer of plan.config, a (gate/up, down) pair of one BLOCK_M; MXFP4 or bf16 weights."""
    c1, c2 = plan.config
    if c1.block_m != c2.block_m:
        raise ValueError(f"{plan.kernel}: both GEMMs must use one BLOCK_M, got {c1.block_m} and {c2.block_m}")
    T, H = x.shape
    if experts.format == "mxfp4":
        w13, s13, w2, s2 = _mxfp4_operands(experts, H)
    else:
        w13, s13, w2, s2 = experts.w13, None, experts.w2, None
    E, inter = w13.shape[0], w13.shape[1] // 2
    gemm = mma_gemm if plan.kernel == "mma" else grouped_gemm
    d = dispatch(topk_ids, E, c1.block_m)
    act, alpha = kernel_activation(activation)
    h = gemm(x, w13, s13, experts.b13, d, out_features=inter, gather=True, activation=act, alpha=alpha,
             limit=activation.limit, config=c1)
    y = gemm(h, w2, s2, experts.b2, d, out_features=H, gather=False, router_weights=topk_weights.contiguous().view(-1),
             config=c2)
    return combine(y, d, T, x.dtype)


def _wgmma_layer(plan, x, topk_ids, topk_weights, experts, activation) -> torch.Tensor:
    w13, s13, w2, s2 = _mxfp4_operands(experts, x.shape[1])
    high = scale_facts(experts, s13, s2)[0]
    return moe_layer_wgmma(x, topk_ids, topk_weights, w13, s13, w2, s2, experts.b13, experts.b2, activation,
                           inter=w13.shape[1] // 2, config=plan.config, high_scales=high)


def _fp8_layer(plan, x, topk_ids, topk_weights, experts, activation) -> torch.Tensor:
    E, inter = experts.num_experts, experts.w13.shape[1] // 2
    if experts.format == "fp8":  # stored FP8 experts: each its own slot, 128 x 128 block scales
        return moe_layer_fp8(x, topk_ids, topk_weights, experts.w13, experts.w13_scale, experts.w2, experts.w2_scale,
                             identity_slots(E, x.device), experts.b13, experts.b2, activation, num_experts=E,
                             inter=inter, configs=plan.config, w_scale_rows=128)
    workspace = experts.workspace
    if workspace is None:
        raise ValueError("moe_experts_mxfp4: path B (kernel 'fp8') converts the active experts into an FP8 expert "
                         "workspace, and experts.workspace is None; the engine passes one where "
                         "kernels.moe.workspace_bytes is above 0 (DAYZERO_FP8_WORKSPACE_GIB, LLM(fp8_workspace_gib=))")
    slot_of_expert = workspace.prepare(experts, topk_ids)
    return moe_layer_fp8(x, topk_ids, topk_weights, workspace.w13, workspace.w13_scale, workspace.w2,
                         workspace.w2_scale, slot_of_expert, experts.b13, experts.b2, activation, num_experts=E,
                         inter=inter, configs=plan.config)


_LAYERS = {"decode": _decode_layer, "decode_sm90": _decode_layer, "gemm": _tensor_core_layer,
           "mma": _tensor_core_layer, "wgmma": _wgmma_layer, "fp8": _fp8_layer}
