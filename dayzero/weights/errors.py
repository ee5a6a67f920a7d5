"""Errors raised while reading checkpoints.

Every error is a `WeightsError` (a `ValueError`), and carries `.tensor` (the tensor name) and
`.file` (the path of the file at fault) where they apply, `None` otherwise. Schema checks report
every problem at once: the raised error is the first problem, and `.problems` lists them all.
"""

from __future__ import annotations

from pathlib import Path


class WeightsError(ValueError):
    def __init__(self, message: str, *, tensor: str | None = None, file: str | Path | None = None):
        super().__init__(message)
        self.tensor = tensor
        self.file = Path(file) if file is not None else None
        self.problems: list[WeightsError] = [self]


class NoWeightsError(WeightsError):
    """The path holds no safetensors weights (missing, config-only, or another format)."""


class CorruptCheckpointError(WeightsError):
    """A file or index is malformed: bad header, truncated data, missing shard, duplicate tensor."""


class MissingTensorError(WeightsError):
    """The model expects a tensor the checkpoint does not have."""


class UnexpectedTensorError(WeightsError):
    """The checkpoint has a tensor the model does not expect."""


class TensorShapeError(WeightsError):
    """A tensor's shape differs from the model's expectation."""


class TensorDtypeError(WeightsError):
    """A tensor's dtype differs from the model's expectation."""


class InvalidValuesError(WeightsError):
    """A tensor holds values its format forbids (NaN block scales): loading it would give wrong weights."""
