"""The suite's time on CI's 2 cores: long variants run with DAYZERO_FULL_TESTS=1 only."""

from __future__ import annotations

import os

FULL = os.environ.get("DAYZERO_FULL_TESTS") == "1"


def ci_cases(cases: list, keep: int = 1) -> list:
    """All of `cases` with DAYZERO_FULL_TESTS=1, else the first `keep` (CI's share of a sweep)."""
    return list(cases) if FULL else list(cases)[:keep]
