"""Value checks at load: what a checkpoint's bytes may hold beyond what its header says.

The header gives dtypes and shapes (checked before any data is read: dayzero/weights/schema.py); a few
tensors also have values their format forbids, and loading them would give silently wrong weights. A
target (dayzero.models.base.WeightTarget) names its check; `fill_targets` runs it on the tensor as
stored, on the device it is loaded to, and reads every result back once at the end.

    SCALES         block scales of quantized weights: float32 / bf16 scales must be finite and >= 0
                   (DeepSeek's weight_scale_inv, V4's FP8 `.scale`); E8M0 scales (F8_E8M0 or their bytes
                   as U8: MXFP4 and ue8m0 FP8) must not be 0xFF, the format's NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dayzero.formats.mxfp4 import E8M0_NAN


@dataclass(frozen=True)
class ValueCheck:
    count: Callable[[torch.Tensor], torch.Tensor]  # stored tensor -> 0-dim int64 on its device: values refused
    refused: str  # what those values are, for the error


def _bad_scales(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.uint8, torch.int8, torch.float8_e8m0fnu):
        return (t.view(torch.uint8) == E8M0_NAN).sum()
    return (~torch.isfinite(t) | (t < 0)).sum()


SCALES = ValueCheck(_bad_scales, "NaN, infinite or negative block scales (E8M0: its NaN code 0xFF)")
