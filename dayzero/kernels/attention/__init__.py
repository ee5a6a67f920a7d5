"""Triton attention kernels, registered for CUDA beside the reference ops (dayzero.ops).

    gqa.py          paged_gqa_attention "triton": checks, `supports`, the entry running a plan
    choose.py       `choose`: decode vs prefill kernel per sequence run, splits and tiles (host sizes only)
    _gqa_decode.py  split-KV decode (flash-decoding) and its reduce kernel
    _gqa_prefill.py flash-attention prefill over packed varlen queries with cached prefixes
    _paged.py       the paged tile load (block table, FP8 dequantisation) and the product both kernels share

Importing this package imports no Triton (that happens at the first call, after a test session may
have set TRITON_INTERPRET); the kernels are available where Triton is installed and a CUDA device exists.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from dayzero.ops.registry import REGISTRY

PRIORITY = 10


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def available() -> bool:
    return _triton_installed() and torch.cuda.is_available()


def paged_gqa_attention(*args, **kwargs):
    from dayzero.kernels.attention.gqa import paged_gqa_attention as kernel

    return kernel(*args, **kwargs)


def supports_paged_gqa(*args, **kwargs) -> bool:
    from dayzero.kernels.attention.gqa import supports

    return supports(*args, **kwargs)


REGISTRY.register_kernel("paged_gqa_attention", paged_gqa_attention, backend="triton", devices=["cuda"],
                         priority=PRIORITY, available=available, supports=supports_paged_gqa)
