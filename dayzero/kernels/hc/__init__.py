"""DeepSeek-V4's manifold-constrained hyper-connections on CUDA: `hyper_connection` (the mixing weights,
their Sinkhorn-Knopp projection and the block input) in one GEMM and one launch, `hyper_connection_post`
(the streams' update) in one launch, where the reference ops take about a hundred small PyTorch ops per
site at 20 Sinkhorn iterations (a decode step of V4 runs 2 sites a layer and the hyper-head).

Importing this package registers the "triton" kernels; Triton is imported at the first call. `supports`
declines what they do not handle (then the reference op runs): streams of bf16 / fp16 / float32 with
contiguous [n, D] rows, n <= MAX_STREAMS, the mixing weights float32 and contiguous.

    _mix   the two kernels (module docstring: the order of the reference's float32 math)
"""

from __future__ import annotations

import torch

from dayzero.kernels.devices import triton_cuda
from dayzero.ops.registry import REGISTRY

PRIORITY = 10  # above the reference
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_STREAMS = 16


def _streams_ok(streams: torch.Tensor) -> bool:
    return (streams.is_cuda and streams.dtype in DTYPES and streams.dim() >= 3 and streams.is_contiguous()
            and 1 <= streams.shape[-2] <= MAX_STREAMS)


def supports_hyper_connection(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps) -> bool:
    if not _streams_ok(streams):
        return False
    n, d = streams.shape[-2:]
    weights = (fn, base, scale)
    return (all(w.is_cuda and w.dtype == torch.float32 and w.is_contiguous() for w in weights)
            and fn.dim() == 2 and fn.shape[1] == n * d and fn.shape[0] in (n, (2 + n) * n)
            and base.shape == (fn.shape[0],) and scale.dim() == 1 and sinkhorn_iters >= 1)


def supports_hyper_connection_post(block_out, streams, post, comb) -> bool:
    if not _streams_ok(streams):
        return False
    n, d = streams.shape[-2:]
    lead = streams.shape[:-2]
    return (block_out.is_cuda and block_out.dtype == streams.dtype and block_out.is_contiguous()
            and block_out.shape == lead + (d,) and post.shape == lead + (n,) and comb.shape == lead + (n, n)
            and all(t.is_cuda and t.dtype == torch.float32 and t.is_contiguous() for t in (post, comb)))


def hyper_connection(*args):
    from dayzero.kernels.hc import _mix

    return _mix.hyper_connection(*args)


def hyper_connection_post(*args):
    from dayzero.kernels.hc import _mix

    return _mix.hyper_connection_post(*args)


REGISTRY.register_kernel("hyper_connection", hyper_connection, backend="triton", devices=["cuda"], priority=PRIORITY,
                         available=triton_cuda, supports=supports_hyper_connection)
REGISTRY.register_kernel("hyper_connection_post", hyper_connection_post, backend="triton", devices=["cuda"],
                         priority=PRIORITY, available=triton_cuda, supports=supports_hyper_connection_post)
