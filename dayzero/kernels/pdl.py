"""Programmatic dependent launch (PDL, sm_90+) for chains of small kernels: the decode layer's four
launches, each a few microseconds long.

A kernel launched with `launch_pdl=True` may be scheduled while the kernel before it in the stream is
still running, as soon as every program of that one has passed `gdc_launch_dependents` (or exited).
Its programs then sit resident at `gdc_wait` until the earlier kernel has completed and its memory is
visible, so the launch latency and the ramp-up of the next grid overlap the tail of the previous one.

The rule every kernel here follows: `start(PDL)` comes first, before any load or store (a buffer this
kernel writes may be memory the earlier kernel still reads), and it releases the next kernel at once.
Releasing early is safe: the next kernel's programs only take SM slots that this kernel's last wave
has left, and they wait for this kernel's completion before touching memory; a kernel two launches
back has completed by then, because this kernel's programs passed their own wait before releasing.

`DAYZERO_PDL=0` turns it off (dayzero/settings.py). The interpreter has no grid dependencies: off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero import settings
from dayzero.kernels.devices import capability, interpreted


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA of compute capability 9 or more, not under the
    interpreter, and the `pdl` setting on."""
    if device.type != "cuda" or interpreted():
        return False
    return settings.get().pdl and capability(device)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """The keywords for launching a kernel that starts with start(PDL) on `device`: its PDL constexpr,
    and launch_pdl=True where enabled (the interpreter accepts no such option)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def start(PDL: tl.constexpr):
    """First statement of a kernel launched with launch_options: wait for the kernel before (its writes
    visible), then let the next one be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
