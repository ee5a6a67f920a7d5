"""Reading tensors from a checkpoint onto a device, one tensor at a time.

Each tensor is read with seek + readinto straight into a fresh CPU buffer (the file is never
read whole, and at most one tensor is in host memory at a time), then moved to the device.
Quantized and packed data (U8, I8, F8_*, F4) keeps its bits: a requested dtype applies to
F16, BF16, F32 and F64 tensors only.
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from tqdm import tqdm

from dayzero.weights.checkpoint import Checkpoint, format_bytes
from dayzero.weights.errors import CorruptCheckpointError, MissingTensorError
from dayzero.weights.header import CASTABLE_DTYPES, TensorInfo
from dayzero.weights.schema import TensorSpec, check_schema


@dataclass
class LoadSummary:
    num_tensors: int
    num_files: int
    bytes_by_dtype: dict[str, int]  # bytes read, by safetensors dtype code (before any cast)
    seconds: float  # opening and reading, wall clock
    device: str
    threads: int = 1  # reader threads (dayzero.weights.fill)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())

    def __str__(self) -> str:
        rate = self.total_bytes / self.seconds if self.seconds > 0 else 0.0
        return (f"Loaded {self.num_tensors} tensors ({format_bytes(self.total_bytes)}) from "
                f"{self.num_files} file(s) to {self.device} in {self.seconds:.2f} s "
                f"({format_bytes(int(rate))}/s" + (f", {self.threads} threads)" if self.threads > 1 else ")"))


def iter_tensors(checkpoint: Checkpoint | str | Path, names: Iterable[str] | None = None, *,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 expected: Mapping[str, TensorSpec] | None = None, allow_unexpected: bool = False,
                 ignore_unexpected: Iterable[str | re.Pattern] = (),
                 progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in file order, each read then moved to `device`.

    names: read only these (each must exist). expected: checked against the whole catalogue
    before this returns, so a mismatch raises here, not mid-stream; then exactly the expected
    tensors are yielded (allowed and ignored extras are skipped, never read). dtype: cast
    F16/BF16/F32/F64 tensors to it. progress: a tqdm bar over bytes, shown only on a tty.
    """
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = Checkpoint.open(checkpoint)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating point dtype; only float weights are cast")
    device = torch.device(device)

    if expected is not None:
        check_schema(checkpoint, expected, allow_unexpected=allow_unexpected,
                     ignore_unexpected=ignore_unexpected)
        selected = [info for name, info in checkpoint.tensors.items() if name in expected]
    else:
        selected = list(checkpoint.tensors.values())
    if names is not None:
        names = list(names)
        absent = [n for n in names if n not in checkpoint.tensors]
        if absent:
            raise MissingTensorError(
                f"{len(absent)} requested tensor(s) not in {checkpoint.path}: "
                f"{', '.join(absent[:20])}", tensor=absent[0], file=checkpoint.path)
        wanted = set(names)
        selected = [info for info in selected if info.name in wanted]
    for info in selected:  # raise before reading if torch cannot hold one (F6, odd-width F4)
        _ = info.torch_dtype, info.torch_shape
    return _stream(selected, device, dtype, progress)


def load_state_dict(path: Checkpoint | str | Path, expected: Mapping[str, TensorSpec] | None = None,
                    device: str | torch.device = "cpu", dtype: torch.dtype | None = None, *,
                    allow_unexpected: bool = False, ignore_unexpected: Iterable[str | re.Pattern] = (),
                    progress: bool = True, return_summary: bool = False,
                    ) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], LoadSummary]:
    """Every tensor (or exactly the expected ones) as {name: tensor}; with return_summary,
    also a LoadSummary. Arguments as for iter_tensors."""
    t0 = time.perf_counter()
    checkpoint = path if isinstance(path, Checkpoint) else Checkpoint.open(path)
    state_dict = {}
    bytes_by_dtype = Counter()
    for name, tensor in iter_tensors(checkpoint, device=device, dtype=dtype, expected=expected,
                                     allow_unexpected=allow_unexpected,
                                     ignore_unexpected=ignore_unexpected, progress=progress):
        state_dict[name] = tensor
        info = checkpoint.tensors[name]
        bytes_by_dtype[info.dtype] += info.nbytes
    if not return_summary:
        return state_dict
    files = {checkpoint.tensors[name].file for name in state_dict}
    summary = LoadSummary(len(state_dict), len(files), dict(bytes_by_dtype.most_common()),
                          time.perf_counter() - t0, str(torch.device(device)))
    return state_dict, summary


def read_tensor(f: BinaryIO, info: TensorInfo) -> torch.Tensor:
    """Bytes [info.start, info.end) of the open file `f` as a CPU tensor of info's dtype/shape."""
    buffer = torch.empty(info.nbytes, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    f.seek(info.start)
    done = 0
    while done < info.nbytes:  # readinto may return less than asked for large reads
        n = f.readinto(view[done:])
        if not n:
            raise CorruptCheckpointError(
                f"{info.file}: tensor {info.name!r}: file ended after {done} of its {info.nbytes} "
                f"bytes; it was truncated after opening", tensor=info.name, file=info.file)
        done += n
    return buffer.view(info.torch_dtype).reshape(info.torch_shape)


def _stream(infos: list[TensorInfo], device: torch.device, dtype: torch.dtype | None,
            progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    bar = tqdm(total=sum(i.nbytes for i in infos), unit="B", unit_scale=True, unit_divisor=1024,
               desc="Loading weights", disable=not (progress and sys.stderr.isatty()))
    path, f = None, None
    try:
        for info in infos:
            if info.file != path:
                if f is not None:
                    f.close()
                path, f = info.file, open(info.file, "rb", buffering=0)
            tensor = read_tensor(f, info)
            cast = dtype if info.dtype in CASTABLE_DTYPES else None
            yield info.name, tensor.to(device=device, dtype=cast)
            bar.update(info.nbytes)
    finally:
        if f is not None:
            f.close()
        bar.close()
