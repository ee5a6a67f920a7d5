"""Argument checks of the routing kernels, in plain PyTorch (importable without Triton): each raises
ValueError naming the argument the kernel cannot take; SUPPORTS holds the registry's `supports`
predicates, which run the same checks on CUDA calls and decline instead of raising."""

from __future__ import annotations

import torch

from dayzero.kernels.checks import cuda_supports
from dayzero.ops.routing_v4 import SCORE_FUNCTIONS

MAX_EXPERTS = 512  # E scores of BLOCK_T tokens live in one warp's registers
MAX_TOP_K = 32
MAX_GROUPS = 32  # the group loop is unrolled
SOFTMAX, SIGMOID, SQRTSOFTPLUS = 0, 1, 2
SCORE_CODE = {"softmax": SOFTMAX, "sigmoid": SIGMOID, "sqrtsoftplus": SQRTSOFTPLUS}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)


def _check_logits(op: str, logits) -> tuple[int, int]:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: logits must be a float32/bf16/fp16 [tokens, experts] tensor, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} {tuple(getattr(logits, 'shape', ()))}")
    T, E = logits.shape
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"{op}: logits has {E} experts; the kernel takes 1 to {MAX_EXPERTS}")
    return T, E


def _check_top_k(op: str, top_k, limit: int) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= limit:
        raise ValueError(f"{op}: top_k={top_k!r} must be an int in [1, {limit}]")


def _check_scale(op: str, name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{op}: {name} must be a Python number (a tensor would need a host sync), got {type(value).__name__}")


def _check_bias(op: str, bias, E: int, device: torch.device) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (E,) or bias.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: correction_bias must be a float [{E}] tensor or None, got "
                         f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
    if bias.device != device:
        raise ValueError(f"{op}: correction_bias is on {bias.device}, logits on {device}")


def check_softmax_call(logits, top_k, renormalize=True) -> None:
    op = "route_softmax_topk[triton]"
    _, E = _check_logits(op, logits)
    _check_top_k(op, top_k, min(E, MAX_TOP_K))
    if not isinstance(renormalize, bool):
        raise ValueError(f"{op}: renormalize must be a bool, got {type(renormalize).__name__}")


def check_sigmoid_grouped_call(logits, correction_bias, top_k, n_group=1, topk_group=1, normalize=True,
                               scaling_factor=1.0) -> None:
    op = "route_sigmoid_grouped[triton]"
    _, E = _check_logits(op, logits)
    _check_bias(op, correction_bias, E, logits.device)
    if not isinstance(n_group, int) or not 1 <= n_group <= MAX_GROUPS or E % n_group:
        raise ValueError(f"{op}: n_group={n_group!r} must divide the {E} experts and lie in [1, {MAX_GROUPS}]")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"{op}: topk_group={topk_group!r} must lie in [1, n_group={n_group}]")
    per_group = E // n_group
    if correction_bias is not None and topk_group < n_group and per_group < 2:
        raise ValueError(f"{op}: scoring groups by their two best experts needs >= 2 experts per group, got {per_group}")
    _check_top_k(op, top_k, min(topk_group * per_group, MAX_TOP_K))
    if not isinstance(normalize, bool):
        raise ValueError(f"{op}: normalize must be a bool, got {type(normalize).__name__}")
    _check_scale(op, "scaling_factor", scaling_factor)


def check_sqrtsoftplus_call(logits, correction_bias, top_k, scaling=1.0) -> None:
    op = "route_sqrtsoftplus[triton]"
    _, E = _check_logits(op, logits)
    _check_bias(op, correction_bias, E, logits.device)
    _check_top_k(op, top_k, min(E, MAX_TOP_K))
    _check_scale(op, "scaling", scaling)


def check_hash_call(logits, token_ids, tid2eid, scaling=1.0, score_function="sqrtsoftplus") -> None:
    op = "route_hash[triton]"
    T, _ = _check_logits(op, logits)
    for name, t, shape in (("token_ids", token_ids, "[tokens]"), ("tid2eid", tid2eid, "[vocab, top_k]")):
        if not isinstance(t, torch.Tensor) or t.dtype not in INT_DTYPES:
            raise ValueError(f"{op}: {name} must be an int32/int64 {shape} tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if t.device != logits.device:
            raise ValueError(f"{op}: {name} is on {t.device}, logits on {logits.device}")
    if tuple(token_ids.shape) != (T,):
        raise ValueError(f"{op}: token_ids must be [{T}] (one per row of logits), got {tuple(token_ids.shape)}")
    if tid2eid.dim() != 2 or tid2eid.shape[0] < 1:
        raise ValueError(f"{op}: tid2eid must be [vocab, top_k], got {tuple(tid2eid.shape)}")
    _check_top_k(op, tid2eid.shape[1], MAX_TOP_K)
    _check_scale(op, "scaling", scaling)
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"{op}: unknown score_function {score_function!r}; supported: {', '.join(SCORE_FUNCTIONS)}")


SUPPORTS = {op: cuda_supports(check, (ValueError, TypeError)) for op, check in (
    ("route_softmax_topk", check_softmax_call), ("route_sigmoid_grouped", check_sigmoid_grouped_call),
    ("route_sqrtsoftplus", check_sqrtsoftplus_call), ("route_hash", check_hash_call))}
