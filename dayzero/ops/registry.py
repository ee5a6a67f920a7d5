"""The operator registry: one reference implementation per op, kernels beside it per device.

An op is defined once by its reference function, written in plain PyTorch. The reference is
the specification: it runs on every device and every kernel registered for the op is tested
against it. Kernels (Triton, or any faster implementation) are registered for the device types
they run on, with a priority and an availability check (for example "triton imports and a CUDA
device exists"); an optional `supports(*args, **kwargs)` predicate lets a kernel decline a call
(a shape or dtype it does not handle), in which case the next candidate runs.

Selection, per call: the device type of the first tensor argument picks the candidates; the
highest-priority available kernel whose `supports` accepts the call wins; the reference is the
last resort and always accepts. `DAYZERO_BACKEND=reference` (or `force_backend("reference")`)
pins every op to one backend so that paths can be measured against each other.

A kernel may have named variants (`variants={name: what it is}`): the implementations it chooses among
per call, inside the kernel library (dayzero/kernels/<family>/choose.py), not here. They are listed
here so that `dayzero ops` shows what can run, and DAYZERO_VARIANT=op=variant forces one (the kernel
library reads that setting; `check_variants` checks every pair against the lists).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping

import torch

from dayzero import settings

REFERENCE = "reference"
ANY_DEVICE = "*"


@dataclass(frozen=True)
class Implementation:
    """One way to compute an op: `fn` runs on the device types in `devices` ("*" = any)."""

    backend: str
    fn: Callable
    devices: tuple[str, ...]
    priority: int = 0
    available: Callable[[], bool] = lambda: True
    supports: Callable[..., bool] | None = None
    variants: tuple[tuple[str, str], ...] = ()  # (name, what it is): what the kernel chooses among per call

    def runs_on(self, device_type: str) -> bool:
        return ANY_DEVICE in self.devices or device_type in self.devices


@dataclass
class Op:
    """A named operator; calling it dispatches to the best implementation for the inputs."""

    name: str
    doc: str
    reference: Implementation
    kernels: list[Implementation] = field(default_factory=list)
    registry: "Registry | None" = field(default=None, repr=False)

    def implementations(self) -> list[Implementation]:
        return sorted(self.kernels, key=lambda k: -k.priority) + [self.reference]

    def select(self, device_type: str, args: tuple | None = None, kwargs: dict | None = None) -> Implementation:
        """The implementation a call with these arguments gets; with args None, ignoring the
        kernels' per-call `supports` checks (what a call their checks accept would get)."""
        check_call = args is not None
        args, kwargs = args or (), kwargs or {}
        forced = self.registry.forced_backend() if self.registry else None
        for impl in self.implementations():
            if forced is not None and impl.backend != forced:
                continue
            if not impl.runs_on(device_type) or not impl.available():
                continue
            if check_call and impl.supports is not None and not impl.supports(*args, **kwargs):
                continue
            return impl
        if forced is not None:
            raise RuntimeError(
                f"op '{self.name}' has no '{forced}' implementation for device '{device_type}' "
                f"(available: {', '.join(i.backend for i in self.implementations())}); "
                f"unset DAYZERO_BACKEND or pick another backend"
            )
        return self.reference

    def __call__(self, *args, **kwargs):
        impl = self.select(_device_type_of(args, kwargs), args, kwargs)
        registry = self.registry
        if registry is None or not registry._recorders:
            return impl.fn(*args, **kwargs)
        if registry._depth == 0:
            for calls, by_backend in registry._recorders:
                key = f"{self.name}@{impl.backend}" if by_backend else self.name
                calls[key] = calls.get(key, 0) + 1
        registry._depth += 1
        try:
            return impl.fn(*args, **kwargs)
        finally:
            registry._depth -= 1


def _device_type_of(args: tuple, kwargs: dict) -> str:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


class Registry:
    """Holds the ops. The process-wide instance is `REGISTRY`; tests may build their own."""

    def __init__(self) -> None:
        self._ops: dict[str, Op] = {}
        self._forced: list[str] = []
        self._recorders: list[tuple[dict[str, int], bool]] = []
        self._depth = 0

    # -- definition -------------------------------------------------------------------------
    def define(self, name: str, reference: Callable, doc: str | None = None) -> Op:
        if name in self._ops:
            raise ValueError(f"op '{name}' is already defined")
        impl = Implementation(REFERENCE, reference, (ANY_DEVICE,), priority=-(2**31))
        op = Op(name, (doc or reference.__doc__ or "").strip(), impl, registry=self)
        self._ops[name] = op
        return op

    def register_kernel(
        self,
        name: str,
        fn: Callable,
        *,
        backend: str,
        devices: Iterable[str],
        priority: int = 10,
        available: Callable[[], bool] = lambda: True,
        supports: Callable[..., bool] | None = None,
        variants: Mapping[str, str] | None = None,
    ) -> Implementation:
        op = self.get(name)
        if backend == REFERENCE:
            raise ValueError(f"'{REFERENCE}' is the name of the reference backend; pick another for op '{name}'")
        if any(k.backend == backend for k in op.kernels):
            raise ValueError(f"op '{name}' already has a '{backend}' kernel")
        impl = Implementation(backend, fn, tuple(devices), priority, available, supports,
                              tuple((variants or {}).items()))
        op.kernels.append(impl)
        return impl

    # -- lookup -----------------------------------------------------------------------------
    def get(self, name: str) -> Op:
        try:
            return self._ops[name]
        except KeyError:
            known = ", ".join(sorted(self._ops)) or "none"
            raise KeyError(f"unknown op '{name}'; defined ops: {known}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._ops

    def names(self) -> list[str]:
        return sorted(self._ops)

    def backends_for(self, name: str) -> list[str]:
        """Backends that implement `name` (reference first); [] when the op is not defined."""
        op = self._ops.get(name)
        if op is None:
            return []
        return [REFERENCE] + [k.backend for k in sorted(op.kernels, key=lambda k: -k.priority)]

    def selected_backend(self, name: str, device_type: str) -> str:
        """The backend a call on `device_type` would get, ignoring per-call `supports` checks."""
        return self.get(name).select(device_type).backend

    def variants(self, name: str) -> dict[str, dict[str, str]]:
        """{backend: {variant: what it is}} of op `name`'s kernels that have variants."""
        return {k.backend: dict(k.variants) for k in self.get(name).kernels if k.variants}

    def check_variants(self) -> None:
        """Every op=variant pair of DAYZERO_VARIANT names a defined op and a variant its kernels list
        (the kernel library reads the setting; a misspelt op would otherwise be ignored)."""
        for name, forced in settings.get().variants:
            if name not in self._ops:
                with_variants = [n for n in self.names() if self.variants(n)]
                raise ValueError(f"DAYZERO_VARIANT names op {name!r}, which is not defined; ops with variants: "
                                 f"{', '.join(with_variants) or 'none'}")
            known = sorted({v for table in self.variants(name).values() for v in table})
            if forced not in known:
                raise ValueError(f"DAYZERO_VARIANT names {name}={forced}; {name} has "
                                 f"{'variants ' + ', '.join(known) if known else 'no variants'}")

    # -- forcing a backend ------------------------------------------------------------------
    def forced_backend(self) -> str | None:
        if self._forced:
            return self._forced[-1]
        return settings.get().backend

    @contextlib.contextmanager
    def force_backend(self, backend: str) -> Iterator[None]:
        self._forced.append(backend)
        try:
            yield
        finally:
            self._forced.pop()

    @contextlib.contextmanager
    def record_calls(self, by_backend: bool = False) -> Iterator[dict[str, int]]:
        """Count the ops called from outside any op (what a model calls directly, not the ops a
        reference implementation calls inside): {op name: calls}, or {"op@backend": calls} with
        by_backend, filled while the block runs."""
        calls: dict[str, int] = {}
        entry = (calls, by_backend)
        self._recorders.append(entry)
        try:
            yield calls
        finally:
            self._recorders.remove(entry)

    # -- reporting --------------------------------------------------------------------------
    def coverage(self, names: Iterable[str] | None = None) -> dict[str, dict[str, str]]:
        """{op: {backend: devices}} for `names` (all defined ops by default); undefined ops map to {}."""
        table: dict[str, dict[str, str]] = {}
        for name in names if names is not None else self.names():
            op = self._ops.get(name)
            if op is None:
                table[name] = {}
                continue
            row = {REFERENCE: "any"}
            for k in op.kernels:
                state = ",".join(k.devices) if k.available() else ",".join(k.devices) + " (unavailable here)"
                row[k.backend] = state
            table[name] = row
        return table

    def coverage_table(self, names: Iterable[str] | None = None) -> str:
        """A text table, op x backend: the devices each backend runs on, '-' where none, 'MISSING' for undefined ops."""
        cov = self.coverage(names)
        backends = [REFERENCE] + sorted({b for row in cov.values() for b in row} - {REFERENCE})
        header = ["op"] + backends
        rows = []
        for name, row in cov.items():
            if not row:
                rows.append([name, "MISSING"] + [""] * (len(backends) - 1))
            else:
                rows.append([name] + [row.get(b, "-") for b in backends])
        widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
        fmt = "  ".join("{:<%d}" % w for w in widths)
        lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
        lines += [fmt.format(*r) for r in rows]
        variants = [(name, backend, table) for name in cov if name in self._ops
                    for backend, table in self.variants(name).items()]
        if variants:
            lines += ["", "kernel variants (the kernel chooses per call; DAYZERO_VARIANT=op=variant forces one):"]
            for name, backend, table in variants:
                lines.append(f"  {name} [{backend}]")
                width = max(map(len, table))
                lines += [f"    {v:<{width}}  {what}" for v, what in table.items()]
        return "\n".join(line.rstrip() for line in lines)


REGISTRY = Registry()


def reference_op(name: str, doc: str | None = None) -> Callable[[Callable], Op]:
    """Decorator: define op `name` in the process-wide registry with the decorated reference."""

    def wrap(fn: Callable) -> Op:
        return REGISTRY.define(name, fn, doc)

    return wrap
