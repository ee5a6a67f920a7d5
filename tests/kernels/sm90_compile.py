"""The sm_90 compile reports of tools/sass_*.py (Triton's bundled ptxas and cuobjdump, no GPU) for the kernel
tests, every case compiled in one Python process: a process per case spent about 2 s of its 2.7 s importing
torch and Triton on CI's 2 cores. Test modules register their cases when imported; the first test that asks
for a report compiles every registered case still missing, in a process without TRITON_INTERPRET (which this
folder sets). A case's report is its tool's main() as if run alone: an exit status (0, or 1 when it raised),
what it printed, its stderr (with the traceback) and the file it wrote where its arguments name DUMP (--dump
DUMP). A crash of the process itself fails every case, with its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_RUNNER = r"""
import contextlib, importlib, io, json, sys, traceback

jobs, out_path = json.loads(sys.argv[1]), sys.argv[2]
reports = []
for i, (tool, args) in enumerate(jobs):
    dump = f"{out_path}.{i}.dump"
    sys.argv = [f"tools/{tool}.py", *(dump if a == "DUMP" else a for a in args)]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            importlib.import_module(f"tools.{tool}").main()
        except BaseException:
            traceback.print_exc()
            code = 1
    try:
        with open(dump) as f:
            dumped = f.read()
    except FileNotFoundError:
        dumped = None
    reports.append([code, out.getvalue(), err.getvalue(), dumped])
with open(out_path, "w") as f:
    json.dump(reports, f)
"""

_cases: list[tuple[str, tuple[str, ...]]] = []
_reports: dict[tuple[str, tuple[str, ...]], tuple[int, str, str, str | None]] = {}


def register(tool: str, cases: list[list[str]]) -> list[list[str]]:
    """Note `cases` (argument lists of tools/<tool>.py) to compile with the others; returns them."""
    _cases.extend((tool, tuple(args)) for args in cases)
    return cases


def report(tool: str, args: list[str]) -> tuple[int, str, str, str | None]:
    """(exit status, stdout, stderr, the DUMP file's text or None) of tools/<tool>.py on `args`, compiling
    every registered case not yet compiled."""
    key = (tool, tuple(args))
    if key not in _reports:
        pending = [c for c in dict.fromkeys([*_cases, key]) if c not in _reports]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "reports.json"
            run = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(pending), str(out)], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=600)
            assert run.returncode == 0 and out.exists(), (run.returncode, (run.stdout + run.stderr)[-3000:])
            reports = json.loads(out.read_text())
        _reports.update((c, tuple(r)) for c, r in zip(pending, reports))
    return _reports[key]
