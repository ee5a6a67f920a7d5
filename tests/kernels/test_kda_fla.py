"""KDA's "fla" backend (dayzero/kernels/kda: fla-core's chunk_kda / fused_recurrent_kda) against the
reference ops. CPU: registered for CUDA only, the reference runs here. CUDA with fla-core installed
(skipped otherwise; `pip install fla-core einops`): Kimi Linear's heads (32 of 128) at seeded random
lengths, from zero and from a carried state, bf16 and float16, through the registry (float32 runs on the reference)."""

from __future__ import annotations

import random

import pytest
import torch

from dayzero import ops
from dayzero.kernels.kda import fla_available, supports_kda
from dayzero.ops.registry import REGISTRY
from tests.kernels.conftest import cuda
from tests.kernels.fla_checks import assert_fla_matches_reference, assert_fla_slots_match_reference


def _inputs(seed, b, t, h, dk, dv, dtype, device, with_state):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, h, dk, generator=g).to(device, dtype) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=g).to(device, dtype)
    decay = -torch.rand(b, t, h, dk, generator=g).to(device) * 2  # log decay in (-2, 0]
    beta = torch.rand(b, t, h, generator=g).to(device, dtype)
    state = torch.randn(b, h, dk, dv, generator=g).to(device) * 0.1 if with_state else None
    return q, k, v, decay, beta, state


@cuda
def test_float32_is_left_to_the_reference():
    """fla's float32 chunk kernels autotune for minutes on a first call: float32 stays on the reference."""
    args = _inputs(0, 1, 70, 2, 16, 16, torch.float32, "cuda", True)
    assert not supports_kda(*args)
    assert supports_kda(*_inputs(0, 1, 70, 2, 16, 16, torch.bfloat16, "cuda", True))


def test_registered_for_cuda_and_the_reference_runs_on_the_cpu():
    for name in ("kda_chunk", "kda_recurrent"):
        impl = next(i for i in REGISTRY.get(name).kernels if i.backend == "fla")
        assert impl.devices == ("cuda",) and impl.supports is supports_kda
        assert REGISTRY.get(name).select("cpu").backend == "reference"
    args = _inputs(0, 1, 3, 2, 8, 8, torch.float32, "cpu", True)
    assert not supports_kda(*args)
    with REGISTRY.record_calls(by_backend=True) as calls:
        ops.kda_chunk(*args)
    assert calls == {"kda_chunk@reference": 1}


@cuda
@pytest.mark.skipif(not fla_available(), reason="needs fla-core (pip install fla-core einops)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_state", [False, True])
def test_fla_matches_the_reference(dtype, with_state):
    rng = random.Random(int(with_state) + 2 * (dtype == torch.float16))
    for name, t in (("kda_chunk", rng.choice((65, 200, 1000))), ("kda_recurrent", 1)):
        args = _inputs(rng.randint(0, 99), rng.choice((1, 3)), t, 32, 128, 128, dtype, "cuda", with_state)
        assert_fla_matches_reference(name, args)


@cuda
@pytest.mark.skipif(not fla_available(), reason="needs fla-core (pip install fla-core einops)")
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_fla_decode_updates_the_pool_in_place(batch):
    """kda_recurrent_slots on fla: shuffled slots of a larger pool, bf16; the outputs and the updated slots
    as the reference's, every other slot untouched."""
    q, k, v, g, beta, _ = _inputs(batch, batch, 1, 32, 128, 128, torch.bfloat16, "cuda", False)
    gen = torch.Generator(device="cuda").manual_seed(batch)
    pool = torch.randn(2 * batch + 3, 32, 128, 128, generator=gen, device="cuda") * 0.1
    slots = torch.randperm(pool.shape[0], generator=gen, device="cuda")[:batch]
    assert_fla_slots_match_reference("kda_recurrent_slots", (q, k, v, g, beta), pool, slots)


@cuda
@pytest.mark.skipif(not fla_available(), reason="needs fla-core (pip install fla-core einops)")
@pytest.mark.parametrize("seed", range(3))
def test_fla_varlen_prompts_match_the_reference_and_their_slots(seed):
    """A step's prompt chunks of random lengths (one token, a part chunk, several chunks) packed through
    fla's cu_seqlens, each from and back to its slot, against the reference's sequence-by-sequence run."""
    rng = random.Random(seed)
    lengths = [rng.choice((1, 7, 64, 65, 300)) for _ in range(rng.randint(1, 6))]
    h, dk = 32, 128
    q, k, v, g, beta, _ = _inputs(seed, 1, sum(lengths), h, dk, dk, torch.bfloat16, "cuda", False)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))
    pool = torch.randn(len(lengths) + 3, h, dk, dk, generator=torch.Generator().manual_seed(seed)).cuda() * 0.1
    slots = torch.randperm(pool.shape[0])[:len(lengths)].cuda()
    host = tuple(torch.tensor([0] + lengths).cumsum(0).tolist())
    starts = torch.tensor(host, dtype=torch.int32, device="cuda")
    assert_fla_slots_match_reference("kda_chunk_varlen", (q, k, v, g, beta, starts, host), pool, slots, 2e-2)
