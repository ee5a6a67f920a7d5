"""Per-layer state of the routed-expert kernels (the scale facts, the layer graphs), kept with the weights:
keyed by the layer's w13 tensor, the model's parameter, so that an ExpertWeights built anew at every
call (as the models build them) finds its layer's state. An entry goes when that tensor is collected.
Whoever reads an entry checks the tensors it depends on (addresses and version counters): an in-place
change of the weights or a reload recomputes it."""

from __future__ import annotations

import functools
import weakref

_STATES: dict[int, tuple[weakref.ref, dict]] = {}  # id(w13) -> (reference to w13, its layer's state)


def _forget(ident: int, ref: weakref.ref) -> None:
    found = _STATES.get(ident)
    if found is not None and found[0] is ref:
        del _STATES[ident]


def layer_state(experts) -> dict:
    """The mutable state dict of the layer whose weights `experts` holds."""
    w13 = experts.w13
    found = _STATES.get(id(w13))
    if found is not None and found[0]() is w13:
        return found[1]
    state: dict = {}
    _STATES[id(w13)] = (weakref.ref(w13, functools.partial(_forget, id(w13))), state)
    return state


def tensors_key(experts) -> tuple:
    """The addresses and version counters of the layer's tensors (what a cached graph reads)."""
    return tuple((t.data_ptr(), t._version) for t in (experts.w13, experts.w2, experts.w13_scale, experts.w2_scale,
                                                       experts.b13, experts.b2) if t is not None)
