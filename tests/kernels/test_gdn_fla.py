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
from dayzero.kernels.gdn import fla_available, supports_gdn, supports_gdn_recurrent
from dayzero.ops.registry import REGISTRY
from tests.kernels.conftest import cuda
from tests.kernels.fla_checks import assert_fla_matches_reference, assert_fla_slots_match_reference

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


NAMES = ("gdn_chunk", "gdn_recurrent", "gdn_chunk_varlen", "gdn_recurrent_slots")


def test_fla_is_registered_for_cuda_only():
    assert all([k.devices for k in REGISTRY.get(name).kernels] == [("cuda",)] for name in NAMES)
    assert {REGISTRY.get(name).select("cpu").backend for name in NAMES} == {"reference"}
    with REGISTRY.record_calls(by_backend=True) as calls:
        ops.gdn_recurrent(*_inputs(0, 1, 3, 1, 2, 8, torch.float32, "cpu", True))
    assert calls == {"gdn_recurrent@reference": 1}


@cuda
def test_what_fla_declines_runs_on_the_reference():
    """float32 (fla's float32 chunk kernels autotune for minutes); fewer than 16 channels in the chunked form
    (its tensor-core products), which the token-by-token form takes."""
    assert not supports_gdn(*_inputs(0, 1, 70, 2, 4, 16, torch.float32, "cuda", True))
    assert supports_gdn(*_inputs(0, 1, 70, 2, 4, 16, torch.bfloat16, "cuda", True))
    narrow = _inputs(0, 1, 70, 2, 4, 8, torch.bfloat16, "cuda", True)
    assert not supports_gdn(*narrow) and supports_gdn_recurrent(*narrow)


@cuda
@needs_fla
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_state", [False, True])
def test_fla_matches_the_reference(dtype, with_state):
    rng = random.Random(int(with_state) + 2 * (dtype == torch.float16))
    for name, t in (("gdn_chunk", rng.choice((65, 200, 1000))), ("gdn_recurrent", 1)):
        assert_fla_matches_reference(name, _inputs(rng.randint(0, 99), rng.choice((1, 3)), t, HK, HV, D, dtype, "cuda",
                                                   with_state))


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
    assert_fla_slots_match_reference("gdn_recurrent_slots", (q, k, v, g, beta), pool, slots)


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
    assert_fla_slots_match_reference("gdn_chunk_varlen", (q, k, v, g, beta, starts, host), pool, slots, 2e-2)
