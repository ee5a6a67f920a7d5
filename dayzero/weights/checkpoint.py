"""A checkpoint's catalogue of tensors, found from Hugging Face file layouts.

Layouts, in the order they are looked for in a directory:
    sharded    model.safetensors.index.json, whose "weight_map" maps tensor name -> shard file
    single     model.safetensors
    sharded    exactly one other *.safetensors.index.json
    directory  one or more *.safetensors with no index (every file is read)
A path to a .safetensors file or an index .json is taken as that file.

Opening reads only headers. The catalogue is ordered by file, then by offset in the file,
so reading it in order reads each file front to back.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from dayzero.units import format_bytes
from dayzero.weights.errors import CorruptCheckpointError, NoWeightsError
from dayzero.weights.header import SafetensorsFile, TensorInfo, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Weight files of other formats: named in the error when no safetensors are found.
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


@dataclass
class Checkpoint:
    path: Path  # the directory or file that was opened
    layout: str  # "single" | "sharded" | "directory"
    files: list[Path]  # the .safetensors files, in reading order
    tensors: dict[str, TensorInfo]  # ordered by file, then offset
    metadata: dict[str, str]  # __metadata__ of the first file (e.g. {"format": "pt"})
    open_seconds: float  # time spent finding files and reading headers

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        t0 = time.perf_counter()
        path = Path(path)
        layout, files, index = _find_layout(path)
        weight_map = _read_index(index) if index is not None else None
        if weight_map is not None:
            files = _shards_of(index, weight_map)
        headers = [read_header(f) for f in files]
        tensors = _catalogue(headers)
        if weight_map is not None:
            _check_index(index, weight_map, tensors)
        metadata = headers[0].metadata if headers else {}
        return cls(path, layout, files, tensors, metadata, time.perf_counter() - t0)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def bytes_by_dtype(self) -> dict[str, int]:
        """{safetensors dtype code: bytes}, largest first."""
        counts = Counter()
        for t in self.tensors.values():
            counts[t.dtype] += t.nbytes
        return dict(counts.most_common())

    def summary(self) -> str:
        lines = [f"{self.path}: {self.layout}, {len(self.files)} file(s), {len(self.tensors)} "
                 f"tensors, {format_bytes(self.total_bytes)} (headers read in "
                 f"{self.open_seconds:.2f} s)"]
        lines += [f"  {dtype:<12}{format_bytes(n):>12}" for dtype, n in self.bytes_by_dtype().items()]
        return "\n".join(lines)


def _find_layout(path: Path) -> tuple[str, list[Path], Path | None]:
    """(layout, safetensors files, index file); a sharded layout's files come from its index."""
    if not path.exists():
        raise NoWeightsError(f"Checkpoint path {path} does not exist", file=path)
    if path.is_file():
        if path.name.endswith(".json"):
            return "sharded", [], path
        return "single", [path], None

    if (path / INDEX_NAME).is_file():
        return "sharded", [], path / INDEX_NAME
    if (path / SINGLE_NAME).is_file():
        return "single", [path / SINGLE_NAME], None
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CorruptCheckpointError(
            f"{path} holds several index files ({', '.join(p.name for p in indexes)}) and no "
            f"{INDEX_NAME}; pass the path of the one to load", file=path)
    if indexes:
        return "sharded", [], indexes[0]
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if files:
        return "directory", files, None

    looked_for = f"{INDEX_NAME}, {SINGLE_NAME}, *.safetensors.index.json, *.safetensors"
    names = sorted(p.name for p in path.iterdir())
    other = [n for n in names if n.endswith(OTHER_WEIGHT_SUFFIXES)]
    if other:
        hint = (f"; it has weights in another format ({', '.join(other[:5])}), convert them to "
                f"safetensors first")
    elif names:
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        hint = f"; it holds only {shown}"
    else:
        hint = "; it is empty"
    raise NoWeightsError(f"No weights found in {path}: looked for {looked_for}{hint}", file=path)


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(
            f"{index}: not a valid index, expected JSON with a \"weight_map\" ({e!r})",
            file=index) from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CorruptCheckpointError(
            f"{index}: \"weight_map\" must map tensor names to shard file names", file=index)
    return weight_map


def _shards_of(index: Path, weight_map: dict[str, str]) -> list[Path]:
    by_shard = defaultdict(list)
    for name, shard in weight_map.items():
        by_shard[shard].append(name)
    shards = []
    for shard, names in sorted(by_shard.items()):
        shard_path = index.parent / shard
        if not shard_path.is_file():
            raise CorruptCheckpointError(
                f"{index} lists shard {shard} for {len(names)} tensor(s) (e.g. {names[0]}), but "
                f"{shard_path} does not exist; the download is incomplete",
                tensor=names[0], file=shard_path)
        shards.append(shard_path)
    return shards


def _catalogue(headers: list[SafetensorsFile]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for header in headers:
        for name, info in header.tensors.items():
            if name in tensors:
                raise CorruptCheckpointError(
                    f"Tensor {name} is present in two files, {tensors[name].file} and "
                    f"{info.file}; remove the stale file", tensor=name, file=info.file)
            tensors[name] = info
    return tensors


def _check_index(index: Path, weight_map: dict[str, str], tensors: dict[str, TensorInfo]) -> None:
    """Every index entry must be in the shard it names. Shard tensors absent from the index are
    kept: the files are what gets loaded."""
    for name, shard in weight_map.items():
        shard_path = index.parent / shard
        info = tensors.get(name)
        if info is None or info.file != shard_path:
            where = f"; it is in {info.file}" if info is not None else ""
            raise CorruptCheckpointError(
                f"{index} lists tensor {name} in {shard_path}, but that shard has no such "
                f"tensor{where}", tensor=name, file=shard_path)
