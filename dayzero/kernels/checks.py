"""Argument checks shared by the kernel families, in plain PyTorch (importable without Triton): each raises
ValueError naming the argument a kernel cannot take, instead of letting it read out of bounds; and
`cuda_supports`, which turns a check into the registry's `supports` predicate (decline instead of raise)."""

from __future__ import annotations

import torch


def check_tensor(op: str, name: str, t, shape: tuple, dtypes: tuple, device: torch.device) -> None:
    """t is a contiguous tensor of `shape` and one of `dtypes` on `device`, starting on a 16-byte boundary."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a tensor {shape}, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes:
        want = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{op}: {name} must be {want} {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, x on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} {tuple(t.shape)} must be contiguous (call .contiguous() at load)")
    if t.data_ptr() % 16:
        raise ValueError(f"{op}: {name} must start on a 16-byte boundary (data_ptr {t.data_ptr():#x})")


def cuda_supports(check, errors: tuple[type[Exception], ...] = (ValueError,)):
    """A registry `supports` predicate: the call's first tensor is on CUDA and `check` accepts it."""
    def supports(first, *args, **kwargs) -> bool:
        if not isinstance(first, torch.Tensor) or not first.is_cuda:
            return False
        try:
            check(first, *args, **kwargs)
        except errors:
            return False
        return True

    supports.__doc__ = f"True when {check.__name__} accepts the call and its first tensor is on CUDA."
    return supports
