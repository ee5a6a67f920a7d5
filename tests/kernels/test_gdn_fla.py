"""Gated DeltaNet's "fla" backend (dayzero/kernels/gdn: fla-core's chunk_gated_delta_rule /
fused_recurrent_gated_delta_rule) against the reference ops. CPU: registered for CUDA only, the reference
runs here. CUDA with fla-core installed (skipped otherwise; `pip install "dayzero[fla]"`): Qwen3.5-35B-A3B's
heads (16 query/key heads, 32 value heads, 128 channels) at seeded random lengths, from zero and from a
carried state, bf16 and float16, through the registry (float32 runs on the reference)."""

from __future__ import annotations

import random

import pytest
import torch

from dayzero import ops
from dayzero.kernels.gdn import fla_available, supports_gdn
from dayzero.ops.registry import REGISTRY
from tests.kernels.conftest import cuda

HK, HV, D = 16, 32, 128
needs_fla = pytest.mark.skipif(not fla_available(), reason="needs fla-core (pip install fla-core einops)")


def _inputs(seed, b, t, hk, hv, d, dtype, device, with_state):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, d, generator=g).to(device, dtype) for _ in range(2))
    v = torch.randn(b, t, hv, d, generator=g).to(device, dtype)
    decay = (-torch.rand(b, t, hv, generator=g) * 2).to(device)  # log decay in (-2, 0]
    beta = torch.rand(b, t, hv, generator=g).to(device, dtype)
    state = torch.randn(b, hv, d, d, generator=g).to(device) * 0.1 if with_state else None
    return q, k, v, decay, beta, state


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_registered_for_cuda_and_the_reference_runs_on_the_cpu():
    for name in ("gdn_chunk", "gdn_recurrent", "gdn_chunk_varlen", "gdn_recurrent_slots"):
        impl = next(i for i in REGISTRY.get(name).kernels if i.backend == "fla")
        assert impl.devices == ("cuda",)
        assert REGISTRY.get(name).select("cpu").backend == "reference"
    args = _inputs(0, 1, 3, 1, 2, 8, torch.float32, "cpu", True)
    assert not supports_gdn(*args)
    with REGISTRY.record_calls(by_backend=True) as calls:
        ops.gdn_chunk(*args)
    assert calls == {"gdn_chunk@reference": 1}


@cuda
def test_float32_is_left_to_the_reference():
    assert not supports_gdn(*_inputs(0, 1, 70, 2, 4, 16, torch.float32, "cuda", True))
    assert supports_gdn(*_inputs(0, 1, 70, 2, 4, 16, torch.bfloat16, "cuda", True))


@cuda
@needs_fla
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_state", [False, True])
def test_fla_matches_the_reference(dtype, with_state):
    rng = random.Random(int(with_state) + 2 * (dtype == torch.float16))
    for name, t in (("gdn_chunk", rng.choice((65, 200, 1000))), ("gdn_recurrent", 1)):
        args = _inputs(rng.randint(0, 99), rng.choice((1, 3)), t, HK, HV, D, dtype, "cuda", with_state)
        with REGISTRY.force_backend("reference"):
            o_ref, s_ref = getattr(ops, name)(*args)
        with REGISTRY.record_calls(by_backend=True) as calls:
            o, s = getattr(ops, name)(*args)
        assert calls == {f"{name}@fla": 1}
        assert o.dtype == dtype and s.dtype == torch.float32 and s.shape == s_ref.shape
        assert _rel(o, o_ref) < 3e-2 and _rel(s, s_ref) < 3e-2, name


@cuda
@needs_fla
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_fla_decode_updates_its_slots(batch):
    """gdn_recurrent_slots on fla: shuffled slots of a larger pool, bf16; the outputs and the updated slots
    as the reference's, every other slot untouched."""
    q, k, v, g, beta, _ = _inputs(batch, batch, 1, HK, HV, D, torch.bfloat16, "cuda", False)
    gen = torch.Generator(device="cuda").manual_seed(batch)
    pool = torch.randn(2 * batch + 3, HV, D, D, generator=gen, device="cuda") * 0.1
    slots = torch.randperm(pool.shape[0], generator=gen, device="cuda")[:batch]
    want_pool = pool.clone()
    with REGISTRY.force_backend("reference"):
        want = ops.gdn_recurrent_slots(q, k, v, g, beta, want_pool, slots)
    with REGISTRY.record_calls(by_backend=True) as calls:
        got = ops.gdn_recurrent_slots(q, k, v, g, beta, pool, slots)
    assert calls == {"gdn_recurrent_slots@fla": 1}
    assert _rel(got, want) < 3e-2 and _rel(pool[slots], want_pool[slots]) < 3e-2
    others = torch.ones(pool.shape[0], dtype=torch.bool, device="cuda")
    others[slots] = False
    assert torch.equal(pool[others], want_pool[others])


@cuda
@needs_fla
@pytest.mark.parametrize("seed", range(3))
def test_fla_varlen_prompts_match_the_reference_and_their_slots(seed):
    """A step's prompt chunks of random lengths (one token, part of a chunk, several chunks) packed through
    fla's cu_seqlens, each from and back to its slot, against the reference's sequence-by-sequence run."""
    rng = random.Random(seed)
    lengths = [rng.choice((1, 7, 64, 65, 300)) for _ in range(rng.randint(1, 6))]
    q, k, v, g, beta, _ = (x[0] if x is not None else None
                           for x in _inputs(seed, 1, sum(lengths), HK, HV, D, torch.bfloat16, "cuda", False))
    pool = torch.randn(len(lengths) + 3, HV, D, D, generator=torch.Generator().manual_seed(seed)).cuda() * 0.1
    slots = torch.randperm(pool.shape[0])[:len(lengths)].cuda()
    host = tuple(torch.tensor([0] + lengths).cumsum(0).tolist())
    starts = torch.tensor(host, dtype=torch.int32, device="cuda")
    want_pool = pool.clone()
    with REGISTRY.force_backend("reference"):
        want = ops.gdn_chunk_varlen(q, k, v, g, beta, starts, host, want_pool, slots)
    with REGISTRY.record_calls(by_backend=True) as calls:
        got = ops.gdn_chunk_varlen(q, k, v, g, beta, starts, host, pool, slots)
    assert calls == {"gdn_chunk_varlen@fla": 1}
    assert (got.float() - want.float()).abs().max() / want.float().abs().max() <= 2e-2
    assert (pool - want_pool).abs().max() / want_pool.abs().max() <= 2e-2
