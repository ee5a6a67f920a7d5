"""Routed-expert (MoE) kernels: moe_experts_mxfp4, moe_experts_bf16 and moe_experts_fp8 on CUDA.

Importing this package registers the three ops' "triton" kernels with the registry (dayzero/ops/
registry.py), each with the variants it chooses among; Triton is imported at the first call, so
TRITON_INTERPRET can still be set by a test session first. A kernel is available where Triton is
installed and a CUDA device exists; it declines (`supports`, _checks.py) any call it does not handle,
which then runs on the reference op.

Public:
    choose.py    choose(shapes, device, settings) -> Plan: the one place the kernel and its tiles are
                 chosen; KERNELS lists the variants; workspace_bytes: the device memory path B needs
    configs.py   the tile configurations a Plan carries (a benchmark or a test pins one)
    moe_experts_mxfp4 / _bf16 / _fp8   the kernels themselves (callable on CPU tensors under the
                 interpreter), with an optional pinned `plan`; plan_for(x, topk_ids, experts): what a call gets
    Fp8Workspace, WorkspaceStats       path B's cross-layer workspace, which the engine owns
Private (one kernel family per file): _layer (the ops: check, plan, run), _dispatch, _gemm, _mma, _wgmma,
_decode, _decode_sm90, _fp8, _workspace, _graphs, _state, _checks, _common. See docs/kernels.md.
"""

from __future__ import annotations

from dayzero.kernels.devices import triton_cuda
from dayzero.kernels.moe._checks import supports_bf16, supports_fp8, supports_mxfp4
from dayzero.kernels.moe._workspace import Fp8Workspace, WorkspaceStats
from dayzero.kernels.moe.choose import KERNELS, Device, Plan, Shapes, choose, expert_slot_bytes, workspace_bytes
from dayzero.ops.registry import REGISTRY

PRIORITY = 10  # above the reference

__all__ = ["KERNELS", "Device", "Fp8Workspace", "Plan", "Shapes", "WorkspaceStats", "choose", "expert_slot_bytes",
           "moe_experts_bf16", "moe_experts_fp8", "moe_experts_mxfp4", "plan_for", "workspace_bytes"]


def moe_experts_mxfp4(x, topk_ids, topk_weights, experts, activation, plan: Plan | None = None):
    """The "triton" kernel of moe_experts_mxfp4 (_layer.py)."""
    from dayzero.kernels.moe import _layer

    return _layer.moe_experts_mxfp4(x, topk_ids, topk_weights, experts, activation, plan)


def moe_experts_bf16(x, topk_ids, topk_weights, experts, activation, plan: Plan | None = None):
    """The "triton" kernel of moe_experts_bf16 (_layer.py)."""
    from dayzero.kernels.moe import _layer

    return _layer.moe_experts_bf16(x, topk_ids, topk_weights, experts, activation, plan)


def moe_experts_fp8(x, topk_ids, topk_weights, experts, activation, plan: Plan | None = None):
    """The "triton" kernel of moe_experts_fp8 (_layer.py)."""
    from dayzero.kernels.moe import _layer

    return _layer.moe_experts_fp8(x, topk_ids, topk_weights, experts, activation, plan)


def plan_for(x, topk_ids, experts) -> Plan:
    """The plan choose() gives a call with these arguments (_layer.plan_for)."""
    from dayzero.kernels.moe import _layer

    return _layer.plan_for(x, topk_ids, experts)


for _op, _fn, _supports in (("moe_experts_mxfp4", moe_experts_mxfp4, supports_mxfp4),
                            ("moe_experts_bf16", moe_experts_bf16, supports_bf16),
                            ("moe_experts_fp8", moe_experts_fp8, supports_fp8)):
    REGISTRY.register_kernel(_op, _fn, backend="triton", devices=["cuda"], priority=PRIORITY, available=triton_cuda,
                             supports=_supports, variants=KERNELS[_op])
