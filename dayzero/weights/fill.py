"""Filling a model's weights from a checkpoint: reader threads over byte ranges, each tensor read once,
straight to where it lives.

A target (dayzero.models.base.WeightTarget) says where one checkpoint tensor goes: `assign(tensor)`
stores it (casting floats, converting layouts) and must copy what it is given; `dest`, where set, is
the tensor the stored bytes become as they are (a plain copy, or packed bytes reinterpreted: int8 /
uint8 / F8_E8M0). Per tensor:

    stored bytes fit dest    read into dest: on CPU straight into its memory (no buffer); elsewhere
                             through the reading thread's buffer (pinned on CUDA) and a copy per piece.
                             A tensor above `piece_bytes` is cut into pieces that any thread reads.
    otherwise                read whole into the thread's buffer (pinned on CUDA), moved to the device,
                             then assign(tensor): conversions run where the weights live.
    a shard (dim, start, stop)  only that slice is read (one read a run of the dimensions before dim:
                             a tensor-parallel rank never reads the other ranks' shares), then as above
                             through assign.

"Fit": same byte count, dest contiguous, and the stored dtype is dest's, or both are single-byte
packed dtypes (uint8, int8, float8_e8m0fnu). Float formats are never reinterpreted: a bf16 tensor
into a float32 parameter goes through assign, which casts. So nothing is read twice, the model is
never held on the host, and host memory is one buffer per thread (the larger of `piece_bytes` and the
largest tensor that goes through assign).

Work is cut in file order (pieces of large tensors, runs of small ones up to about `piece_bytes`) and
taken by the workers in that order, so each file is read roughly front to back. Reads are
os.preadv on one descriptor per file (no shared seek position; the GIL is released while reading).
The caller checks the schema first (dayzero.weights.match_layout / check_schema): dtypes and shapes
are not checked again here, only that every target's tensor exists. A target's value check
(`target.check`, dayzero/weights/values.py: block scales) runs on the tensor as stored, where it was
loaded; the counts are read back once, after every read, and any refused value raises
InvalidValuesError naming the tensor and the file.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from tqdm import tqdm

from dayzero import settings
from dayzero.weights.checkpoint import Checkpoint
from dayzero.weights.errors import CorruptCheckpointError, InvalidValuesError, MissingTensorError
from dayzero.weights.header import TensorInfo
from dayzero.weights.loader import LoadSummary
from dayzero.weights.schema import schema_error

PIECE_BYTES = 32 << 20  # a work item's bytes: one piece of a large tensor, or a run of small ones
MAX_AUTO_THREADS = 8  # DAYZERO_LOAD_THREADS=0: min(this, CPU count)
REINTERPRETABLE = frozenset({torch.uint8, torch.int8, torch.float8_e8m0fnu})  # one byte, no float cast


class Target(Protocol):
    assign: Callable[[torch.Tensor], None]
    dest: torch.Tensor | None


@dataclass(frozen=True)
class _Read:
    info: TensorInfo
    target: Any
    lo: int  # byte range [lo, hi) of the tensor (a shard: 0 and its bytes)
    hi: int
    direct: bool  # into target.dest, else whole through assign
    shard: bool = False  # only target.shard's slice, through assign


def resolve_threads(threads: int | None) -> int:
    """threads, else DAYZERO_LOAD_THREADS; 0 means min(MAX_AUTO_THREADS, the CPU count)."""
    n = settings.get().load_threads if threads is None else threads
    if n < 0:
        raise ValueError(f"load threads must be >= 0 (0: automatic), got {n}")
    return n or min(MAX_AUTO_THREADS, os.cpu_count() or 1)


def fill_targets(checkpoint: Checkpoint, targets: Mapping[str, Target], *, device: str | torch.device,
                 threads: int | None = None, piece_bytes: int | None = None, progress: bool = True) -> LoadSummary:
    """Read every target's tensor from `checkpoint` (already under the model's names) into it.

    threads: reader threads (default DAYZERO_LOAD_THREADS; 0: automatic). piece_bytes: a work item's size
    (default PIECE_BYTES). progress: a tqdm bar over bytes, shown only on a tty. Raises
    CorruptCheckpointError naming the file and tensor when a file ends early (truncated after it was
    opened); the first error stops the other readers. On CUDA it returns once every copy and conversion
    has run (the seconds include them)."""
    t0 = time.perf_counter()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the caller's current device, not the workers' default
        device = torch.device("cuda", torch.cuda.current_device())
    piece_bytes = piece_bytes or PIECE_BYTES
    absent = [name for name in targets if name not in checkpoint.tensors]
    if absent:
        raise MissingTensorError(f"{len(absent)} tensor(s) the model needs are not in {checkpoint.path}: "
                                 f"{', '.join(absent[:20])}", tensor=absent[0], file=checkpoint.path)
    infos = sorted((checkpoint.tensors[name] for name in targets), key=lambda i: (str(i.file), i.start))
    items = _work_items(infos, targets, piece_bytes)
    threads = max(1, min(resolve_threads(threads), len(items)))
    total = sum(_read_bytes(i, targets[i.name]) for i in infos)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="Loading weights",
               disable=not (progress and sys.stderr.isatty()))
    fds = {path: os.open(path, os.O_RDONLY) for path in dict.fromkeys(i.file for i in infos)}
    reader = _Reader(fds, device, piece_bytes, bar)
    try:
        if threads == 1:
            for item in items:
                reader.run(item)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="dayzero-load") as pool:
                futures = [pool.submit(reader.run, item) for item in items]
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                failed = next((f for f in done if f.exception() is not None), None)
                if failed is not None:
                    reader.stop.set()
                    pool.shutdown(cancel_futures=True)
                    raise failed.exception()
    finally:
        for fd in fds.values():
            os.close(fd)
        bar.close()
    _check_values(infos, targets, reader.checked)
    if device.type == "cuda":  # conversions queued by assign are part of the load (and of its seconds)
        torch.cuda.synchronize(device)
    bytes_by_dtype = Counter()
    for info in infos:
        bytes_by_dtype[info.dtype] += _read_bytes(info, targets[info.name])
    return LoadSummary(len(infos), len(fds), dict(bytes_by_dtype.most_common()), time.perf_counter() - t0,
                       str(device), threads)


def _check_values(infos: list[TensorInfo], targets: Mapping[str, Target], checked: list) -> None:
    """Run the value checks of the targets read straight into their memory (the others ran as they were
    read: `checked`), read every count back at once, and raise InvalidValuesError naming each tensor and
    file that holds refused values."""
    checked = list(checked)
    for info in infos:
        target = targets[info.name]
        check = getattr(target, "check", None)
        if check is not None and getattr(target, "shard", None) is None and (dest := _dest_bytes(info, target)) is not None:
            checked.append((info, check, check.count(dest.view(info.torch_dtype))))
    if not checked:
        return
    counts = torch.stack([c for _, _, c in checked]).tolist()  # one read back
    problems = [InvalidValuesError(f"{info.where}: {n} of its {info.numel} values are {check.refused}; the file is "
                                   "corrupt (re-download it)", tensor=info.name, file=info.file)
                for (info, check, _), n in zip(checked, counts) if n]
    if problems:
        raise schema_error(problems, f"{len(problems)} tensor(s) hold values their format does not allow")


def _dest_bytes(info: TensorInfo, target: Target) -> torch.Tensor | None:
    """dest as flat bytes where the stored tensor's bytes fit it (module docstring), else None."""
    dest = getattr(target, "dest", None)
    if dest is None or not dest.is_contiguous() or dest.numel() * dest.element_size() != info.nbytes:
        return None
    stored = info.torch_dtype
    if stored != dest.dtype and not (stored in REINTERPRETABLE and dest.dtype in REINTERPRETABLE):
        return None
    return dest.reshape(-1).view(torch.uint8)


def _shard_geometry(info: TensorInfo, shard: tuple[int, int, int]) -> tuple[int, int, int, tuple[int, ...]]:
    """(runs, bytes a run, bytes between runs, the slice's shape) of shard (dim, start, stop) of the stored
    tensor: the slice is `runs` contiguous runs, the first at byte start x (bytes a unit of dim)."""
    dim, start, stop = shard
    shape = tuple(info.torch_shape)
    if not (0 <= dim < len(shape) and 0 <= start < stop <= shape[dim]):
        raise ValueError(f"{info.file}: tensor {info.name!r} {list(shape)}: no slice [{start}, {stop}) along dim {dim}")
    unit = info.torch_dtype.itemsize
    for n in shape[dim + 1:]:
        unit *= n
    runs = 1
    for n in shape[:dim]:
        runs *= n
    return runs, (stop - start) * unit, shape[dim] * unit, shape[:dim] + (stop - start,) + shape[dim + 1:]


def _read_bytes(info: TensorInfo, target: Target) -> int:
    shard = getattr(target, "shard", None)
    if shard is None:
        return info.nbytes
    runs, run, _, _ = _shard_geometry(info, shard)
    return runs * run


def _work_items(infos: list[TensorInfo], targets: Mapping[str, Target], piece_bytes: int) -> list[list[_Read]]:
    items: list[list[_Read]] = []
    run: list[_Read] = []
    run_bytes = 0
    for info in infos:
        target = targets[info.name]
        if getattr(target, "shard", None) is not None:  # its own item: a slice through assign
            items.append([_Read(info, target, 0, _read_bytes(info, target), False, shard=True)])
            continue
        direct = _dest_bytes(info, target) is not None
        n = info.nbytes
        if run and (run_bytes + n > piece_bytes or run[-1].info.file != info.file or (direct and n > piece_bytes)):
            items.append(run)
            run, run_bytes = [], 0
        if direct and n > piece_bytes:
            items += [[_Read(info, target, lo, min(n, lo + piece_bytes), True)] for lo in range(0, n, piece_bytes)]
        else:
            run.append(_Read(info, target, 0, n, direct))
            run_bytes += n
    if run:
        items.append(run)
    return items


class _Reader:
    """What the workers share: the open files, the device, the progress bar, a stop flag; each thread
    has its own buffer (pinned when the weights go to CUDA)."""

    def __init__(self, fds: dict, device: torch.device, piece_bytes: int, bar: tqdm):
        self.fds, self.device, self.piece_bytes, self.bar = fds, device, piece_bytes, bar
        self.pin = device.type == "cuda"
        self.local = threading.local()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.checked: list = []  # (info, check, count on the device) of the targets checked as they were read

    def run(self, item: list[_Read]) -> None:
        if self.stop.is_set():
            return
        for r in item:
            if r.shard:
                self._read_shard(r)
            elif r.direct:
                self._read_direct(r)
            else:
                self._read_assign(r)
            with self.lock:
                self.bar.update(r.hi - r.lo)

    def _read_direct(self, r: _Read) -> None:
        dest = _dest_bytes(r.info, r.target)[r.lo:r.hi]
        if dest.device.type == "cpu":
            self._pread(dest, r)
        else:
            staging = self._buffer(r.hi - r.lo)
            self._pread(staging, r)
            dest.copy_(staging)  # from pinned memory; synchronous, so the buffer is free again after

    def _read_assign(self, r: _Read) -> None:
        staging = self._buffer(r.info.nbytes)
        self._pread(staging, r)
        tensor = staging.view(r.info.torch_dtype).reshape(r.info.torch_shape)
        self._assign(r, tensor.to(self.device))

    def _assign(self, r: _Read, tensor: torch.Tensor) -> None:
        """The target's check on the tensor as stored (its count read back with the others'), then assign."""
        check = getattr(r.target, "check", None)
        if check is not None:
            count = check.count(tensor)
            with self.lock:
                self.checked.append((r.info, check, count))
        with torch.no_grad():
            r.target.assign(tensor)

    def _read_shard(self, r: _Read) -> None:
        runs, run, stride, shape = _shard_geometry(r.info, r.target.shard)
        staging = self._buffer(runs * run)
        first = r.target.shard[1] * (run // (r.target.shard[2] - r.target.shard[1]))
        for i in range(runs):
            self._pread_at(staging[i * run:(i + 1) * run], r.info, r.info.start + i * stride + first)
        tensor = staging.view(r.info.torch_dtype).reshape(shape)
        self._assign(r, tensor.to(self.device))

    def _buffer(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self.local, "buffer", None)
        if buf is None or buf.numel() < nbytes:
            self.local.buffer = None  # the smaller buffer is freed before the larger one is made
            buf = self.local.buffer = torch.empty(max(nbytes, self.piece_bytes), dtype=torch.uint8,
                                                  pin_memory=self.pin)
        return buf[:nbytes]

    def _pread(self, out: torch.Tensor, r: _Read) -> None:
        """Bytes [r.lo, r.hi) of r's tensor into the CPU uint8 tensor `out`."""
        self._pread_at(out, r.info, r.info.start + r.lo)

    def _pread_at(self, out: torch.Tensor, info: TensorInfo, offset: int) -> None:
        """len(out) bytes of info's file from `offset` into the CPU uint8 tensor `out`."""
        view = memoryview(out.numpy())
        fd, done = self.fds[info.file], 0
        while done < len(view):  # a read may return less than asked (and at most ~2 GiB on Linux)
            n = os.preadv(fd, [view[done:]], offset + done)
            if not n:
                raise CorruptCheckpointError(
                    f"{info.file}: tensor {info.name!r}: file ended {offset + done - info.start} bytes into its {info.nbytes} "
                    f"bytes; it was truncated after opening", tensor=info.name, file=info.file)
            done += n
