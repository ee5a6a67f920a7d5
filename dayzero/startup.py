"""Startup phases, timed: where the time between `LLM(...)` and the first step goes.

    timer = StartupTimer()
    with timer.phase("weights", bytes=n, detail="3 files, 8 threads"):
        ...
    with timer.phase("engine"):
        with timer.phase("kv_pool") as phase:    # opened inside "engine": one of its children
            ...
            phase.bytes = storage.nbytes()       # facts known only at the end may be set on the phase
    timer.summary()   # one line: "startup 4.21 s: config 0.01 s, weights 3.90 s (12.8 GiB, 3.5 GB/s), ...,
                      #   engine 0.30 s [kv_pool 0.25 s (40.00 GiB)]"
    timer.report()    # a table, children indented
    timer.as_dict()   # {"total_s": ..., "phases": [{"name", "seconds", "bytes", "gb_per_s", "detail", "children"}]}

Top-level phases follow one another, so their seconds add up to the total (the time from the timer's
creation to the end of the last phase) less the gaps between phases, which `report()` shows as
"(between phases)". A phase's seconds include its children's. Rates are decimal GB/s (bytes / 1e9 / s),
sizes binary (GiB), as the rest of dayzero prints them. One thread records phases; it is not shared.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

from dayzero.units import format_bytes


@dataclass
class Phase:
    name: str
    seconds: float = 0.0  # wall clock, children included
    bytes: int | None = None  # bytes the phase moved or allocated, where that is what it does
    detail: str = ""  # a few words on how (files, threads, layout)
    children: list[Phase] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float | None:
        if self.bytes is None or self.seconds <= 0:
            return None
        return self.bytes / 1e9 / self.seconds

    def describe(self, detail: bool = True) -> str:
        """'weights 3.90 s (12.80 GiB, 3.50 GB/s; 3 files, 8 threads)'; without the detail after ';'."""
        facts = []
        if self.bytes is not None:
            rate = self.gb_per_s if self.bytes and self.seconds >= 0.001 else None
            facts.append(format_bytes(self.bytes) + (f", {rate:.2f} GB/s" if rate is not None else ""))
        if detail and self.detail:
            facts.append(self.detail)
        return f"{self.name} {self.seconds:.2f} s" + (f" ({'; '.join(facts)})" if facts else "")

    def as_dict(self) -> dict:
        return {"name": self.name, "seconds": self.seconds, "bytes": self.bytes, "gb_per_s": self.gb_per_s,
                "detail": self.detail, "children": [c.as_dict() for c in self.children]}


class StartupTimer:
    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.ended = self.started  # the end of the last top-level phase
        self.phases: list[Phase] = []  # top level, in order
        self._open: list[Phase] = []

    @contextlib.contextmanager
    def phase(self, name: str, *, bytes: int | None = None, detail: str = "") -> Iterator[Phase]:
        """Time the block as phase `name`; inside another phase's block it is that phase's child.
        The phase is recorded even when the block raises (with the seconds until then)."""
        record = Phase(name, bytes=bytes, detail=detail)
        (self._open[-1].children if self._open else self.phases).append(record)
        self._open.append(record)
        t0 = time.perf_counter()
        try:
            yield record
        finally:
            now = time.perf_counter()
            record.seconds = now - t0
            self._open.pop()
            if not self._open:
                self.ended = now

    def record(self, name: str, seconds: float, *, bytes: int | None = None, detail: str = "") -> Phase:
        """A phase timed elsewhere that has just ended (e.g. by a loader that reports its own seconds), as
        a child of the open phase, or top level when none is open."""
        record = Phase(name, seconds, bytes, detail)
        (self._open[-1].children if self._open else self.phases).append(record)
        if not self._open:
            self.ended = time.perf_counter()
        return record

    def get(self, name: str) -> Phase | None:
        """The first phase named `name`, at any depth."""
        stack = list(self.phases)
        while stack:
            p = stack.pop(0)
            if p.name == name:
                return p
            stack[:0] = p.children
        return None

    @property
    def total_seconds(self) -> float:
        return self.ended - self.started

    @property
    def phase_seconds(self) -> float:
        """The top-level phases' seconds added up (total_seconds less the gaps between phases)."""
        return sum(p.seconds for p in self.phases)

    def summary(self) -> str:
        """One line: the top-level phases (seconds, and bytes with their rate), children in brackets."""
        def line(p: Phase) -> str:
            inner = ", ".join(line(c) for c in p.children)
            return p.describe(detail=False) + (f" [{inner}]" if inner else "")

        return f"startup {self.total_seconds:.2f} s: " + ", ".join(line(p) for p in self.phases)

    def report(self) -> str:
        lines = [f"startup {self.total_seconds:.2f} s"]

        def add(phases: list[Phase], depth: int) -> None:
            for p in phases:
                lines.append("  " * depth + p.describe())
                add(p.children, depth + 1)

        add(self.phases, 1)
        gaps = self.total_seconds - self.phase_seconds
        if gaps >= 0.005:
            lines.append(f"  (between phases) {gaps:.2f} s")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"total_s": self.total_seconds, "phases": [p.as_dict() for p in self.phases]}
