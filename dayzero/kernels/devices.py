"""Facts about the machine that never change while the process runs, looked up once: a CUDA device's
compute capability and SM count (torch.cuda.get_device_capability and get_device_properties cost a few
microseconds each, and an eager MoE layer asked for them seven times per call: tools/profile_moe_host.py),
whether Triton and a CUDA device exist, whether an optional kernel library imports there (fla-core),
whether Triton runs kernels in its CPU interpreter; and the one side stream per device that CUDA graph
warm-ups run on."""

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
def _warmup_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of CUDA `device` on which every CUDA graph's warm-up runs before its capture (the
    decode graphs, the MoE layer graphs). One per device for the process: torch gives each stream that runs
    a cuBLAS matmul a workspace of its own (32 MiB on Hopper) and keeps it until the process ends, so a new
    stream per capture kept 32 MiB per graph (H100, 2026-12-06: the demo's 5 decode graphs left 160 MiB
    allocated after its engine was gone; tests/engine/test_graphs.py)."""
    return _warmup_stream(_index(device))


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
