"""Fault injection: make chosen engine steps fail, to test what a failed step does to the server.

The runner asks its `FaultInjector` once per step attempt (`check`), right after the step's forward
ran: the step's KV entries and recurrent states are written, its snapshots saved, and the step then
raises, which is the hardest moment to recover from (an exception raised earlier leaves less to undo).
A plan is a comma-separated list of
    KIND@N    the N-th step attempt fails (0-based, counting every attempt, failed ones included)
    KIND/N    every N-th attempt fails (attempts N - 1, 2N - 1, ...)
with KIND `error` (a RuntimeError: the step's requests fail with a 500 naming it) or `oom`
(torch.OutOfMemoryError: the engine retries the step's requests within a smaller token budget,
docs/engine.md "A failed step"). `DAYZERO_INJECT_FAULTS` (dayzero/settings.py) gives the plan of every
engine a process starts; a test sets `engine.runner.faults = FaultInjector("oom@3")` directly.
"""

from __future__ import annotations

import torch

KINDS = ("error", "oom")


class InjectedFault(RuntimeError):
    """The `error` kind: an exception inside a step, as a failing kernel or op would raise."""


def parse_plan(plan: str) -> tuple[tuple[str, str, int], ...]:
    """"oom@3,error/50" -> (("oom", "@", 3), ("error", "/", 50)); ValueError naming the bad item."""
    items = []
    for item in filter(None, (part.strip() for part in plan.split(","))):
        sep = "@" if "@" in item else "/"
        kind, _, n = (s.strip() for s in item.partition(sep))
        if kind not in KINDS or not n.isdigit() or (sep == "/" and int(n) < 1):
            raise ValueError(f"fault plan item {item!r} is not KIND@N or KIND/N (N >= 1 with /) with KIND one of "
                             f"{', '.join(KINDS)}; got it in {plan!r}")
        items.append((kind, sep, int(n)))
    return tuple(items)


class FaultInjector:
    def __init__(self, plan: str = ""):
        self.plan = parse_plan(plan)
        self.attempts = 0  # step attempts checked so far
        self.injected: list[tuple[int, str]] = []  # (attempt, kind) of every fault raised

    def check(self) -> None:
        """Called once per step attempt: raise the fault the plan puts on this attempt, if any."""
        attempt, self.attempts = self.attempts, self.attempts + 1
        for kind, sep, n in self.plan:
            if (sep == "@" and attempt == n) or (sep == "/" and (attempt + 1) % n == 0):
                self.injected.append((attempt, kind))
                message = f"injected {kind} fault at step attempt {attempt} (DAYZERO_INJECT_FAULTS / FaultInjector)"
                raise torch.OutOfMemoryError(message) if kind == "oom" else InjectedFault(message)
