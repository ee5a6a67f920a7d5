"""Facts about the machine that never change while the process runs, looked up once: a CUDA device's
compute capability and SM count (torch.cuda.get_device_capability and get_device_properties cost a few
microseconds each, and an eager MoE layer asked for them seven times per call: tools/profile_moe_host.py),
whether Triton and a CUDA device exist, whether an optional kernel library imports there (fla-core), and
whether Triton runs kernels in its CPU interpreter."""

from __future__ import annotations

import functools
import importlib.util

import torch


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _facts(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of CUDA `device` (an index-less "cuda" is the current device)."""
    return _facts(_index(device))[0]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA `device`."""
    return _facts(_index(device))[1]


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def triton_cuda() -> bool:
    """Whether Triton kernels can run compiled here: Triton is installed and a CUDA device exists (the
    registry's `available` check of every Triton kernel)."""
    return triton_installed() and torch.cuda.is_available()


@functools.cache
def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter. Triton decides when a kernel is decorated, from
    TRITON_INTERPRET (read through Triton's own knobs); asked once, at the first launch, after the kernel
    modules were imported."""
    import triton

    return bool(triton.knobs.runtime.interpret)


@functools.cache
def cuda_library(module: str, *names: str) -> bool:
    """Whether a CUDA device exists and `from module import names` works (an optional kernel library such
    as fla-core: not installed, or built for another Triton / torch, reads as unavailable)."""
    if not torch.cuda.is_available():
        return False
    try:
        imported = importlib.import_module(module)
        return all(hasattr(imported, name) for name in names)
    except Exception:
        return False
