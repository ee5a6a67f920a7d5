"""KDA (Kimi Linear, Kimi K3) on CUDA through fla-core, the field's Triton library (MIT,
`fla.ops.kda.chunk_kda` for prompts, `fused_recurrent_kda` for decode), registered as backend "fla"
beside the reference ops, which stay the specification and the CPU path (fla's chunk kernels do not run
under Triton's interpreter). Available only where `fla` imports (`pip install fla-core einops`; not a
dependency of dayzero) and a CUDA device exists; elsewhere, and for what `supports` declines, the
reference runs.

The contracts are the same: q, k [B, T, H, dk], v [B, T, H, dv], g float log decay [B, T, H, dk] (from
`kda_gate`, so the gate is not recomputed in the kernel), beta [B, T, H] in (0, 1) (already a sigmoid),
state float32 [B, H, dk, dv] (fla's [N, HV, K, V] with N = B and no grouped values), scale default
dk^-0.5, q and k L2-normalised in the kernel when l2norm_qk; returns (o in q's dtype, final state
float32). chunk_size is the reference's own detail: fla chunks by 64 (kimi_linear.KDA_CHUNK_SIZE).
kda_chunk_varlen: a step's prompt chunks packed [N, H, d] (fla's cu_seqlens, B = 1), their states read
from and written back to the requests' slots of the pool."""

from __future__ import annotations

import torch

from dayzero.kernels.devices import cuda_library
from dayzero.ops.registry import REGISTRY

PRIORITY = 10  # above the reference
DTYPES = (torch.bfloat16, torch.float16)  # float32 runs on the reference: fla's float32 chunk kernels took
# over 150 s to autotune on the H200 (a GPU test run timed out on one), longer than any first request may wait


def fla_available() -> bool:
    """fla-core's KDA imports and a CUDA device exists (looked up once)."""
    return cuda_library("fla.ops.kda", "chunk_kda", "fused_recurrent_kda")


def supports_kda(q, k, v, g, beta, state=None, scale=None, l2norm_qk=True, chunk_size=64) -> bool:
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in (q, k, v, g, beta)):
        return False
    if q.dim() != 4 or q.dtype not in DTYPES or k.shape != q.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    b, t, h, _ = q.shape
    if v.dim() != 4 or v.shape[:3] != (b, t, h) or g.shape != q.shape or beta.shape != (b, t, h) or t == 0:
        return False
    return state is None or (state.is_cuda and state.dtype == torch.float32
                             and tuple(state.shape) == (b, h, q.shape[3], v.shape[3]))


def supports_kda_slots(q, k, v, g, beta, pool, slots, scale=None, l2norm_qk=True) -> bool:
    """As supports_kda for one token per request, and the pool a contiguous float32 [S, H, dk, dv] on
    q's device with int slots [B]."""
    return (supports_kda(q, k, v, g, beta) and q.shape[1] == 1 and isinstance(pool, torch.Tensor)
            and isinstance(slots, torch.Tensor) and pool.is_cuda and pool.dtype == torch.float32
            and pool.is_contiguous() and tuple(pool.shape[1:]) == (q.shape[2], q.shape[3], v.shape[3])
            and slots.is_cuda and slots.dim() == 1 and slots.shape[0] == q.shape[0]
            and slots.dtype in (torch.int32, torch.int64))


def kda_chunk(q, k, v, g, beta, state=None, scale=None, l2norm_qk=True, chunk_size=64):
    from fla.ops.kda import chunk_kda

    o, final = chunk_kda(q, k, v, g.float(), beta, scale=scale, initial_state=state, output_final_state=True,
                         use_qk_l2norm_in_kernel=l2norm_qk)
    return o.to(q.dtype), final.float()


def supports_kda_varlen(q, k, v, g, beta, query_start, query_start_host, pool, slots, scale=None, l2norm_qk=True,
                        chunk_size=64) -> bool:
    """Packed [N, H, d] prompts of q's dtype on CUDA, the pool as supports_kda_slots wants it."""
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in (q, k, v, g, beta, query_start, pool, slots)):
        return False
    return (q.dim() == 3 and supports_kda(q[None], k[None], v[None], g[None], beta[None]) and pool.dtype == torch.float32
            and pool.is_contiguous() and tuple(pool.shape[1:]) == (q.shape[1], q.shape[2], v.shape[2])
            and slots.dim() == 1 and slots.shape[0] == len(query_start_host) - 1 == query_start.shape[0] - 1
            and query_start_host[-1] == q.shape[0])


def kda_chunk_varlen(q, k, v, g, beta, query_start, query_start_host, pool, slots, scale=None, l2norm_qk=True,
                     chunk_size=64):
    """fla's chunk kernel over the packed prompts (cu_seqlens, with the host copy so it reads no device
    value), from and back to the requests' slots."""
    from fla.ops.kda import chunk_kda

    cu = query_start.long()
    o, final = chunk_kda(q[None], k[None], v[None], g[None].float(), beta[None], scale=scale,
                         initial_state=pool[slots], output_final_state=True, use_qk_l2norm_in_kernel=l2norm_qk,
                         cu_seqlens=cu, cu_seqlens_cpu=torch.tensor(query_start_host, dtype=torch.long))
    pool[slots] = final.float()
    return o[0].to(q.dtype)


def kda_recurrent(q, k, v, g, beta, state=None, scale=None, l2norm_qk=True):
    from fla.ops.kda import fused_recurrent_kda

    o, final = fused_recurrent_kda(q, k, v, g.float(), beta, scale=scale, initial_state=state,
                                   output_final_state=True, use_qk_l2norm_in_kernel=l2norm_qk)
    return o.to(q.dtype), final.float()


def kda_recurrent_slots(q, k, v, g, beta, pool, slots, scale=None, l2norm_qk=True):
    """fla's decode kernel reading each request's state at pool[slots[b]] and storing the final state
    there (its continuous-batching form, `ssm_state_indices` with an in-place final state)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    o, _ = fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g.float(), beta=beta, scale=scale, initial_state=pool,
                                   inplace_final_state=True, ssm_state_indices=slots,
                                   use_qk_l2norm_in_kernel=l2norm_qk)
    return o.to(q.dtype)


REGISTRY.register_kernel("kda_chunk", kda_chunk, backend="fla", devices=["cuda"], priority=PRIORITY,
                         available=fla_available, supports=supports_kda)
REGISTRY.register_kernel("kda_recurrent", kda_recurrent, backend="fla", devices=["cuda"], priority=PRIORITY,
                         available=fla_available, supports=supports_kda)
REGISTRY.register_kernel("kda_recurrent_slots", kda_recurrent_slots, backend="fla", devices=["cuda"],
                         priority=PRIORITY, available=fla_available, supports=supports_kda_slots)
REGISTRY.register_kernel("kda_chunk_varlen", kda_chunk_varlen, backend="fla", devices=["cuda"], priority=PRIORITY,
                         available=fla_available, supports=supports_kda_varlen)
