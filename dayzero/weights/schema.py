"""Checking a checkpoint's catalogue against the tensors a model expects, before reading data."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from dayzero.weights.checkpoint import Checkpoint
from dayzero.weights.errors import (InvalidValuesError, MissingTensorError, TensorDtypeError, TensorShapeError,
                                    UnexpectedTensorError, WeightsError)

# Problems listed in one error message; all of them are still in the error's .problems.
MAX_REPORTED_PROBLEMS = 20


@dataclass(frozen=True)
class TensorSpec:
    """What the model expects of one tensor, as loaded into torch (F4: float4_e2m1fn_x2 shape).
    shape None: any shape; a None entry: any size along that dim. dtype None: any dtype; a tuple:
    any of those (FLOAT_DTYPES for a float weight the loader casts to the model's dtype)."""

    shape: tuple[int | None, ...] | None = None
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None

    def dtype_matches(self, dtype: torch.dtype) -> bool:
        if self.dtype is None:
            return True
        return dtype in self.dtype if isinstance(self.dtype, tuple) else dtype == self.dtype


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def find_problems(checkpoint: Checkpoint, expected: Mapping[str, TensorSpec], *,
                  allow_unexpected: bool = False,
                  ignore_unexpected: Iterable[str | re.Pattern] = ()) -> list[WeightsError]:
    """Every mismatch between `expected` and the checkpoint, most serious kind first: missing,
    wrong shape, wrong dtype, unexpected. Unexpected tensors matching an `ignore_unexpected`
    regex (re.search, like transformers' _keys_to_ignore_on_load_unexpected) are not problems."""
    missing, shape, dtype, unexpected = [], [], [], []
    for name, spec in expected.items():
        info = checkpoint.tensors.get(name)
        if info is None:
            missing.append(MissingTensorError(
                f"{name}: expected by the model ({_describe(spec)}) but not in {checkpoint.path} "
                f"({len(checkpoint.files)} file(s))", tensor=name, file=checkpoint.path))
            continue
        if spec.shape is not None and not _shape_matches(spec.shape, info.torch_shape):
            shape.append(TensorShapeError(
                f"{info.where}: expected shape {_format_shape(spec.shape)}, found "
                f"{_format_shape(info.torch_shape)}", tensor=name, file=info.file))
        if not spec.dtype_matches(info.torch_dtype):
            dtype.append(TensorDtypeError(
                f"{info.where}: expected dtype {_dtype_name(spec.dtype)}, found "
                f"{_dtype_name(info.torch_dtype)} ({info.dtype})", tensor=name, file=info.file))

    if not allow_unexpected:
        patterns = [re.compile(p) for p in ignore_unexpected]
        for name, info in checkpoint.tensors.items():
            if name not in expected and not any(p.search(name) for p in patterns):
                unexpected.append(UnexpectedTensorError(
                    f"{info.where}: not expected by the model ({info.dtype} "
                    f"{list(info.shape)}); pass allow_unexpected=True or an ignore_unexpected "
                    f"pattern to skip it", tensor=name, file=info.file))
    return missing + shape + dtype + unexpected


def check_schema(checkpoint: Checkpoint, expected: Mapping[str, TensorSpec], *,
                 allow_unexpected: bool = False,
                 ignore_unexpected: Iterable[str | re.Pattern] = ()) -> None:
    """Raise the first of `find_problems`, with all of them in its message and `.problems`."""
    problems = find_problems(checkpoint, expected, allow_unexpected=allow_unexpected,
                             ignore_unexpected=ignore_unexpected)
    if problems:
        raise schema_error(problems, f"Checkpoint {checkpoint.path} does not match the model")


def count_problems(problems: list[WeightsError]) -> str:
    """'3 missing, 1 wrong shape': the problems counted by kind, most serious first."""
    return ", ".join(f"{sum(type(p) is kind for p in problems)} {label}"
                     for kind, label in _KINDS.items() if any(type(p) is kind for p in problems))


def schema_error(problems: list[WeightsError], heading: str) -> WeightsError:
    """One error for a non-empty list of problems: the first problem itself when it is alone,
    else an error of the first one's type whose message is `heading`, the counts and the first
    MAX_REPORTED_PROBLEMS problems; `.problems` holds them all."""
    if len(problems) == 1:
        return problems[0]
    lines = [f"{heading}: {count_problems(problems)}"]
    lines += [f"  - {p}" for p in problems[:MAX_REPORTED_PROBLEMS]]
    if len(problems) > MAX_REPORTED_PROBLEMS:
        lines.append(f"  ... and {len(problems) - MAX_REPORTED_PROBLEMS} more")
    first = problems[0]
    error = type(first)("\n".join(lines), tensor=first.tensor, file=first.file)
    error.problems = problems
    return error


_KINDS = {MissingTensorError: "missing", TensorShapeError: "wrong shape", TensorDtypeError: "wrong dtype",
          UnexpectedTensorError: "unexpected", InvalidValuesError: "invalid values"}


def _shape_matches(expected: tuple[int | None, ...], found: tuple[int, ...]) -> bool:
    return len(expected) == len(found) and all(e is None or e == f for e, f in zip(expected, found))


def _format_shape(shape: tuple[int | None, ...]) -> str:
    dims = ", ".join("?" if d is None else str(d) for d in shape)
    return f"({dims},)" if len(shape) == 1 else f"({dims})"


def _dtype_name(dtype: torch.dtype | tuple[torch.dtype, ...]) -> str:
    if isinstance(dtype, tuple):
        return " or ".join(_dtype_name(d) for d in dtype)
    return str(dtype).removeprefix("torch.")


def _describe(spec: TensorSpec) -> str:
    shape = "any shape" if spec.shape is None else f"shape {_format_shape(spec.shape)}"
    dtype = "any dtype" if spec.dtype is None else _dtype_name(spec.dtype)
    return f"{shape}, {dtype}"

