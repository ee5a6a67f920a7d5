"""Top-k routing kernels: route_softmax_topk, route_sigmoid_grouped, route_sqrtsoftplus, route_hash on CUDA.

Importing this package registers one "triton" kernel per routing op (one Triton kernel, _topk.py, serves
them all); Triton is imported at the first call. Each declines (`supports`, _checks.py, plain PyTorch)
what it does not handle, which then runs on the reference op (dayzero/ops/routing_*.py).
"""

from __future__ import annotations

from dayzero.kernels.devices import triton_cuda
from dayzero.kernels.routing._checks import SUPPORTS
from dayzero.ops.registry import REGISTRY

PRIORITY = 10  # above the reference


def route_softmax_topk(*args, **kwargs):
    from dayzero.kernels.routing import _topk

    return _topk.route_softmax_topk(*args, **kwargs)


def route_sigmoid_grouped(*args, **kwargs):
    from dayzero.kernels.routing import _topk

    return _topk.route_sigmoid_grouped(*args, **kwargs)


def route_sqrtsoftplus(*args, **kwargs):
    from dayzero.kernels.routing import _topk

    return _topk.route_sqrtsoftplus(*args, **kwargs)


def route_hash(*args, **kwargs):
    from dayzero.kernels.routing import _topk

    return _topk.route_hash(*args, **kwargs)


for _fn in (route_softmax_topk, route_sigmoid_grouped, route_sqrtsoftplus, route_hash):
    REGISTRY.register_kernel(_fn.__name__, _fn, backend="triton", devices=["cuda"], priority=PRIORITY,
                             available=triton_cuda, supports=SUPPORTS[_fn.__name__])
