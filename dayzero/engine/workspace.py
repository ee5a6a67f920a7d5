"""The FP8 expert workspace of path B (MXFP4 experts converted per activated expert into a bounded, cross-layer
FP8 buffer), made where the kernel library needs one and handed to the model's MoE layers; every
rank of a parallel job makes its own, sized for the experts it holds (E / ep)."""

from __future__ import annotations

from dayzero import settings
from dayzero.kernels import moe as moe_kernels


def _workspace_takers(model) -> list:
    """The model's modules that pass an FP8 expert workspace to their routed-expert op (a class attribute
    `fp8_workspace`, None until the engine sets it; the MXFP4 expert modules have it)."""
    return [m for m in model.modules() if hasattr(type(m), "fp8_workspace")]


def attach_expert_workspace(model, gib: float | None, max_tokens: int):
    """Make the FP8 expert workspace of path B where the kernel library needs one and hand it to the
    model's MoE layers; returns it, or None. Its size is kernels.moe.workspace_bytes: 0 (no workspace)
    wherever the library never chooses path B, so the KV budget (which subtracts it) and the kernels'
    own choice agree. gib: LLM(fp8_workspace_gib=); 0 turns the workspace, and path B, off."""
    e = model.spec.experts
    takers = _workspace_takers(model)
    nbytes = 0
    if e is not None and takers:
        local = e.num // model.parallel.ep_size  # an expert-parallel rank activates only its own experts
        nbytes = moe_kernels.workspace_bytes(e.format, local, e.top_k, e.input_dim, e.intermediate_size, max_tokens,
                                             moe_kernels.Device.of(model.device_), settings.get(), gib=gib)
    if nbytes == 0:
        if gib:
            raise ValueError(f"fp8_workspace_gib={gib}: this model's experts ({e.format if e else 'none'}) on "
                             f"{model.device_} never run path B, which is what the workspace is for (MXFP4 experts "
                             f"on CUDA other than sm_90, or DAYZERO_VARIANT=moe_experts_mxfp4=fp8); leave it unset")
        return None
    workspace = moe_kernels.Fp8Workspace(nbytes, model.device_, prefetch=settings.get().fp8_prefetch)
    for module in takers:
        module.fp8_workspace = workspace
    return workspace
