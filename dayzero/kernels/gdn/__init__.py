"""Gated DeltaNet (Qwen3.5) on CUDA through fla-core (MIT; `fla.ops.gated_delta_rule.chunk_gated_delta_rule`
for prompts, `fused_recurrent_gated_delta_rule` for decode), registered as backend "fla" beside the
reference ops, which stay the specification and the CPU path. Available only where fla's gated delta rule
imports (`pip install "dayzero[fla]"`) and a CUDA device exists; elsewhere, and for what `supports`
declines (float32: fla's float32 chunk kernels autotune for minutes, as KDA's), the reference runs.

The contracts are the ops' (dayzero/ops/gdn.py): q, k [B, T, HK, dk], v [B, T, HV, dv] with HV a multiple
of HK (fla's grouped value heads read query/key head h // (HV / HK), the reference's repeat_interleave), g
float32 log decay [B, T, HV] (from `kda_gate`), beta [B, T, HV] already a sigmoid, states float32
[B, HV, dk, dv], q and k L2-normalised in the kernel, scale default dk^-0.5. The varlen and slot forms
gather the requests' states from their slots as the initial states and write the final ones back (fla's
gated delta rule has no in-place state indices, unlike its KDA decode kernel)."""

from __future__ import annotations

import torch

from dayzero.kernels.devices import cuda_library
from dayzero.ops.registry import REGISTRY

PRIORITY = 10  # above the reference
DTYPES = (torch.bfloat16, torch.float16)


def fla_available() -> bool:
    """fla-core's gated delta rule imports and a CUDA device exists (looked up once)."""
    return cuda_library("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")


MAX_DIM = 256  # fla's bound on dk (and dv) per head


def _supported(q, k, v, g, beta, chunked: bool = False) -> bool:
    """q, k [..., HK, dk], v [..., HV, dv] of one 16/bf16 dtype on CUDA, HV a multiple of HK, g / beta [..., HV];
    the chunked kernels' tensor-core products want dk and dv multiples of 16."""
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in (q, k, v, g, beta)):
        return False
    dk, dv = q.shape[-1], v.shape[-1]
    if dk > MAX_DIM or dv > MAX_DIM or (chunked and (dk % 16 or dv % 16)):
        return False
    return (q.dtype in DTYPES and k.shape == q.shape and k.dtype == v.dtype == q.dtype and v.shape[:-2] == q.shape[:-2]
            and v.shape[-2] % q.shape[-2] == 0 and g.shape == v.shape[:-1] and beta.shape == v.shape[:-1]
            and q.shape[-3] > 0)


def _pool_ok(pool, slots, v, k, n: int) -> bool:
    return (isinstance(pool, torch.Tensor) and isinstance(slots, torch.Tensor) and pool.is_cuda and slots.is_cuda
            and pool.dtype == torch.float32 and tuple(pool.shape[1:]) == (v.shape[-2], k.shape[-1], v.shape[-1])
            and slots.dim() == 1 and slots.shape[0] == n and slots.dtype in (torch.int32, torch.int64))


def supports_gdn(q, k, v, g, beta, state=None, scale=None, l2norm_qk=True, chunk_size=64) -> bool:
    if q.dim() != 4 or not _supported(q, k, v, g, beta, chunked=chunk_size is not None):
        return False
    return state is None or (state.is_cuda and state.dtype == torch.float32
                             and tuple(state.shape) == (q.shape[0], v.shape[2], q.shape[3], v.shape[3]))


def supports_gdn_recurrent(q, k, v, g, beta, state=None, scale=None, l2norm_qk=True) -> bool:
    return supports_gdn(q, k, v, g, beta, state, chunk_size=None)


def supports_gdn_slots(q, k, v, g, beta, pool, slots, scale=None, l2norm_qk=True) -> bool:
    return supports_gdn_recurrent(q, k, v, g, beta) and _pool_ok(pool, slots, v, k, q.shape[0])


def supports_gdn_varlen(q, k, v, g, beta, query_start, query_start_host, pool, slots, scale=None, l2norm_qk=True,
                        chunk_size=64) -> bool:
    return (q.dim() == 3 and _supported(q, k, v, g, beta, chunked=True) and isinstance(query_start, torch.Tensor)
            and query_start.is_cuda and _pool_ok(pool, slots, v, k, len(query_start_host) - 1)
            and query_start.shape[0] == len(query_start_host) and query_start_host[-1] == q.shape[0])


def gdn_chunk(q, k, v, g, beta, state=None, scale=None, l2norm_qk=True, chunk_size=64):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, final = chunk_gated_delta_rule(q, k, v, g.float(), beta, scale=scale, initial_state=state,
                                      output_final_state=True, use_qk_l2norm_in_kernel=l2norm_qk)
    return o.to(q.dtype), final.float()


def gdn_recurrent(q, k, v, g, beta, state=None, scale=None, l2norm_qk=True):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    o, final = fused_recurrent_gated_delta_rule(q, k, v, g.float(), beta=beta, scale=scale, initial_state=state,
                                                output_final_state=True, use_qk_l2norm_in_kernel=l2norm_qk)
    return o.to(q.dtype), final.float()


def gdn_recurrent_slots(q, k, v, g, beta, pool, slots, scale=None, l2norm_qk=True):
    """fla's decode kernel from the requests' slots; the final states written back there."""
    o, final = gdn_recurrent(q, k, v, g, beta, pool[slots], scale, l2norm_qk)
    pool[slots] = final
    return o


def gdn_chunk_varlen(q, k, v, g, beta, query_start, query_start_host, pool, slots, scale=None, l2norm_qk=True,
                     chunk_size=64):
    """fla's chunk kernel over a step's packed prompts (cu_seqlens, with the host copy so that it reads no
    device value), from and back to the requests' slots."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(), beta[None], scale=scale,
                                      initial_state=pool[slots], output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2norm_qk, cu_seqlens=query_start.long(),
                                      cu_seqlens_cpu=torch.tensor(query_start_host, dtype=torch.long))
    pool[slots] = final.float()
    return o[0].to(q.dtype)


for _name, _fn, _supports in (("gdn_chunk", gdn_chunk, supports_gdn), ("gdn_recurrent", gdn_recurrent, supports_gdn_recurrent),
                              ("gdn_recurrent_slots", gdn_recurrent_slots, supports_gdn_slots),
                              ("gdn_chunk_varlen", gdn_chunk_varlen, supports_gdn_varlen)):
    REGISTRY.register_kernel(_name, _fn, backend="fla", devices=["cuda"], priority=PRIORITY, available=fla_available,
                             supports=_supports)
