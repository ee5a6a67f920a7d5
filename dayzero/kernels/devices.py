"""Facts about a CUDA device that never change while the process runs (compute capability, SM count),
looked up once per device instead of at every kernel launch: torch.cuda.get_device_capability and
get_device_properties cost a few microseconds each, and an eager MoE layer asked for them seven times
per call (tools/profile_moe_host.py)."""

from __future__ import annotations

import functools

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
