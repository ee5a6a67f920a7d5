"""Kernel tests run twice over: on CPU tensors under Triton's interpreter (small shapes, in CI) and on
CUDA (full model shapes, skipped without a GPU). Without a GPU this folder sets TRITON_INTERPRET=1
before Triton is first imported (dayzero imports Triton only at a kernel's first call)."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_ready() -> str | None:
    """Why the CPU interpreter tests cannot run here, or None."""
    try:
        import triton  # noqa: F401  (only whether it imports)
    except ImportError:
        return "triton is not installed"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "set TRITON_INTERPRET=1 before Triton is imported to run the interpreter tests"
    return None


INTERPRETER_SKIP = _interpreter_ready()
interpreter = pytest.mark.skipif(INTERPRETER_SKIP is not None, reason=INTERPRETER_SKIP or "")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
