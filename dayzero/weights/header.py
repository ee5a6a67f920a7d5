"""The safetensors file format, read without reading tensor data.

Layout of a .safetensors file:
    bytes [0, 8)          header length N, unsigned 64-bit little-endian
    bytes [8, 8 + N)      UTF-8 JSON: {name: {"dtype", "shape", "data_offsets": [begin, end]},
                          optional "__metadata__": {str: str}}, padded with spaces
    bytes [8 + N, EOF)    data section; data_offsets are relative to its start, end exclusive

The tensors fill the data section exactly, one after another (gaps or trailing bytes are refused, as
the safetensors library refuses them). Tensor data is little-endian and row-major. For sub-byte dtypes (F4, F6_*) "shape" counts the
sub-byte values, so a tensor takes numel * bits / 8 bytes, which must be whole.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dayzero.weights.errors import CorruptCheckpointError, WeightsError

# safetensors itself refuses headers above 100 MB; a larger length means a corrupt file.
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class DType:
    code: str  # as written in the header, e.g. "BF16"
    bits: int  # bits per value counted by the header shape
    torch_dtype: torch.dtype | None  # None: torch has no such dtype (the F6 formats)


DTYPES: dict[str, DType] = {d.code: d for d in [
    DType("BOOL", 8, torch.bool),
    DType("U8", 8, torch.uint8),
    DType("I8", 8, torch.int8),
    DType("U16", 16, torch.uint16),
    DType("I16", 16, torch.int16),
    DType("U32", 32, torch.uint32),
    DType("I32", 32, torch.int32),
    DType("U64", 64, torch.uint64),
    DType("I64", 64, torch.int64),
    DType("F16", 16, torch.float16),
    DType("BF16", 16, torch.bfloat16),
    DType("F32", 32, torch.float32),
    DType("F64", 64, torch.float64),
    DType("C64", 64, torch.complex64),
    DType("F8_E4M3", 8, torch.float8_e4m3fn),
    DType("F8_E4M3FNUZ", 8, torch.float8_e4m3fnuz),
    DType("F8_E5M2", 8, torch.float8_e5m2),
    DType("F8_E5M2FNUZ", 8, torch.float8_e5m2fnuz),
    DType("F8_E8M0", 8, torch.float8_e8m0fnu),
    # Two E2M1 values per byte; torch's float4_e2m1fn_x2 halves the last dimension.
    DType("F4", 4, torch.float4_e2m1fn_x2),
    DType("F6_E2M3", 6, None),
    DType("F6_E3M2", 6, None),
]}

# The only dtypes a caller-requested cast applies to. Quantized, packed and integer data is
# never cast: its bits mean something only together with its scales.
CASTABLE_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: bytes [start, end) of `file`, absolute offsets.

    stored_as: the name in the file when it differs from `name`, i.e. when a tensor layout
    (dayzero.weights.layouts) renamed the tensor or cut it out of a larger one."""

    name: str
    file: Path
    dtype: str  # safetensors code, a key of DTYPES
    shape: tuple[int, ...]  # as in the header
    start: int
    end: int
    stored_as: str | None = None

    @property
    def where(self) -> str:
        """'NAME in FILE', naming the stored tensor too when a layout mapped it."""
        stored = f" (stored as {self.stored_as})" if self.stored_as else ""
        return f"{self.name}{stored} in {self.file}"

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        torch_dtype = DTYPES[self.dtype].torch_dtype
        if torch_dtype is None:
            raise WeightsError(
                f"{self.name} in {self.file}: dtype {self.dtype} has no torch equivalent; it can be "
                f"catalogued but not loaded", tensor=self.name, file=self.file)
        return torch_dtype

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """Shape of the loaded tensor: the header shape, except packed F4 halves the last dim."""
        if self.dtype != "F4":
            return self.shape
        if not self.shape or self.shape[-1] % 2:
            raise WeightsError(
                f"{self.name} in {self.file}: F4 tensor of shape {list(self.shape)} has an odd last "
                f"dimension and cannot be viewed as torch.float4_e2m1fn_x2 (two values per byte)",
                tensor=self.name, file=self.file)
        return (*self.shape[:-1], self.shape[-1] // 2)


@dataclass
class SafetensorsFile:
    path: Path
    size: int  # bytes on disk
    tensors: dict[str, TensorInfo]  # ordered by start offset
    metadata: dict[str, str] = field(default_factory=dict)


def read_header(path: str | Path) -> SafetensorsFile:
    """Parse and validate the header of one .safetensors file against the file's size."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CorruptCheckpointError(
                f"{path}: only {size} bytes, too short for a safetensors file (the first 8 bytes "
                f"hold the header length)", file=path)
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise CorruptCheckpointError(
                f"{path}: header length {header_len} bytes is larger than the file ({size} bytes); "
                f"the file is truncated or not safetensors", file=path)
        if header_len > MAX_HEADER_BYTES:
            raise CorruptCheckpointError(
                f"{path}: header length {header_len} bytes exceeds the {MAX_HEADER_BYTES} byte "
                f"safetensors limit; the file is corrupt", file=path)
        raw = f.read(header_len)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: header is not valid JSON: {e}", file=path) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(
            f"{path}: header is JSON {type(header).__name__}, expected an object", file=path)

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(f"{path}: __metadata__ is not an object", file=path)

    data_start = 8 + header_len
    data_size = size - data_start
    tensors = [_parse_entry(path, name, entry, data_start, data_size)
               for name, entry in header.items()]
    tensors.sort(key=lambda t: (t.start, t.end))
    _check_no_overlap(path, tensors)
    _check_covered(path, tensors, data_start, data_size)
    return SafetensorsFile(path, size, {t.name: t for t in tensors}, metadata)


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(path: Path, name: str, entry: object, data_start: int, data_size: int) -> TensorInfo:
    def corrupt(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: tensor {name!r}: {what}", tensor=name, file=path)

    if not isinstance(entry, dict):
        raise corrupt(f"header entry is {type(entry).__name__}, expected an object")
    dtype = entry.get("dtype")
    if dtype not in DTYPES:
        raise corrupt(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise corrupt(f"shape {shape!r} is not a list of non-negative integers")
    offsets = entry.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets))
            or not 0 <= offsets[0] <= offsets[1]):
        raise corrupt(f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")

    begin, end = offsets
    bits = math.prod(shape) * DTYPES[dtype].bits
    if bits % 8:
        raise corrupt(f"{dtype} {shape} is {bits} bits, not a whole number of bytes")
    if end - begin != bits // 8:
        raise corrupt(f"data_offsets [{begin}, {end}] hold {end - begin} bytes but {dtype} "
                      f"{shape} needs {bits // 8}")
    if end > data_size:
        raise corrupt(f"data ends at byte {end} of the data section, but the file has only "
                      f"{data_size} data bytes: the file is truncated (re-download it)")
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_covered(path: Path, tensors: list[TensorInfo], data_start: int, data_size: int) -> None:
    """The tensors (sorted, not overlapping) fill the data section exactly, as the safetensors library
    requires: a gap or bytes past the last tensor mean the header length or an offset is wrong, and every
    tensor would be read from the wrong place (a header length off by a few bytes still parses when the
    bytes it gains or loses are spaces)."""
    position = 0
    for t in tensors:
        if t.nbytes == 0:
            continue
        if t.start - data_start != position:
            raise CorruptCheckpointError(
                f"{path}: bytes [{position}, {t.start - data_start}) of the data section belong to no tensor (before "
                f"{t.name!r}); the header length or data_offsets are wrong: the file is corrupt (re-download it)",
                tensor=t.name, file=path)
        position = t.end - data_start
    if position != data_size:
        raise CorruptCheckpointError(
            f"{path}: the data section has {data_size} bytes but its tensors end at byte {position}; the header "
            f"length or data_offsets are wrong: the file is corrupt or was written wrongly (re-download it)", file=path)


def _check_no_overlap(path: Path, tensors: list[TensorInfo]) -> None:
    """`tensors` sorted by start; empty tensors occupy no bytes and cannot overlap."""
    previous = None
    for t in tensors:
        if t.nbytes == 0:
            continue
        if previous is not None and t.start < previous.end:
            raise CorruptCheckpointError(
                f"{path}: tensors {previous.name!r} and {t.name!r} overlap (bytes "
                f"[{previous.start}, {previous.end}) and [{t.start}, {t.end}) of the file)",
                tensor=t.name, file=path)
        previous = t
