"""Gated DeltaNet ops (dayzero/ops/gdn.py) against transformers' torch fallbacks of Qwen3.5 (an independent
formulation: its own chunked UT transform and token loop, grouped value heads by repeat_interleave), the
chunked form against the token-by-token form, and the packed varlen / state-slot forms against per-sequence
runs; gated_rms_norm's silu gate against transformers' Qwen3_5MoeRMSNormGated."""

import math

import pytest
import torch

from dayzero.ops.gdn import gdn_chunk, gdn_chunk_varlen, gdn_recurrent, gdn_recurrent_slots
from dayzero.ops.kda import gated_rms_norm, kda_gate


@pytest.fixture(autouse=True)
def _private_rng():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield


def _inputs(b, t, hk, hv, dk, dv):
    """q, k [B, T, HK, dk], v [B, T, HV, dv], g [B, T, HV] from kda_gate as Qwen3.5 computes it, beta [B, T, HV]."""
    q, k, v = torch.randn(b, t, hk, dk), torch.randn(b, t, hk, dk), torch.randn(b, t, hv, dv)
    a_log = (1 + 15 * torch.rand(hv)).log()
    dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(hv))
    g = kda_gate(torch.randn(b, t, hv, 1), a_log, dt + torch.log(-torch.expm1(-dt)))[..., 0]
    return q, k, v, g, torch.rand(b, t, hv)


@pytest.mark.parametrize("t, hk, hv, chunk", [(1, 1, 1, 64), (70, 2, 6, 64), (33, 2, 2, 16), (130, 1, 3, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_gdn_matches_transformers_chunked_and_recurrent(t, hk, hv, chunk, with_state):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (torch_chunk_gated_delta_rule,
                                                                      torch_recurrent_gated_delta_rule)

    q, k, v, g, beta = _inputs(2, t, hk, hv, 16, 8)
    state = torch.randn(2, hv, 16, 8) * 0.3 if with_state else None
    o, s = gdn_chunk(q, k, v, g, beta, state, chunk_size=chunk)
    o_rec, s_rec = gdn_recurrent(q, k, v, g, beta, state)
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_o, want_s = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, **kwargs)
    rec_o, rec_s = torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    assert o.shape == (2, t, hv, 8) and s.shape == (2, hv, 16, 8) and s.dtype == torch.float32
    for got, want in ((o, want_o), (s, want_s), (o_rec, rec_o), (s_rec, rec_s), (o, o_rec), (s, s_rec)):
        assert (got - want).abs().max() <= 2e-5 * want.abs().max()


def test_packed_prompts_and_decodes_update_their_slots_in_place():
    """gdn_chunk_varlen over three prompts of different lengths (one token, inside a chunk, across chunks) and
    gdn_recurrent_slots over their next tokens equal per-sequence gdn_chunk runs; the slots not named stay."""
    lengths, hk, hv, dk, dv = (1, 40, 90), 2, 4, 8, 8
    pool = torch.randn(6, hv, dk, dv) * 0.2
    slots = torch.tensor([4, 0, 2])
    start = pool.clone()
    q, k, v, g, beta = (x[0] for x in _inputs(1, sum(lengths), hk, hv, dk, dv))
    host = (0, 1, 41, 131)
    o = gdn_chunk_varlen(q, k, v, g, beta, torch.tensor(host), host, pool, slots, chunk_size=32)
    step = _inputs(3, 1, hk, hv, dk, dv)
    o_step = gdn_recurrent_slots(*step, pool, slots)
    for i, (a, e) in enumerate(zip(host, host[1:])):
        part = [x[a:e][None] for x in (q, k, v, g, beta)]
        want_o, final = gdn_chunk(*part, start[slots[i:i + 1]])
        assert (o[a:e] - want_o[0]).abs().max() <= 1e-5 * want_o.abs().max()
        want_step, final = gdn_recurrent(*(x[i:i + 1] for x in step), final)
        assert (o_step[i] - want_step[0]).abs().max() <= 1e-5 * want_step.abs().max()
        assert (pool[slots[i]] - final[0]).abs().max() <= 1e-5 * final.abs().max()
    assert torch.equal(pool[[1, 3, 5]], start[[1, 3, 5]])


def test_bad_shapes_are_named():
    q, k, v, g, beta = _inputs(1, 5, 2, 3, 8, 8)  # 3 value heads over 2 key heads
    with pytest.raises(ValueError, match="HV a multiple of HK"):
        gdn_chunk(q, k, v, g, beta)
    q, k, v, g, beta = _inputs(1, 5, 2, 4, 8, 8)
    with pytest.raises(ValueError, match=r"g and beta must be \[\.\.\., HV\]"):
        gdn_recurrent(q, k, v, g[..., :2], beta)


def test_gated_rms_norm_silu_matches_qwen3_5():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNormGated

    x, z = torch.randn(7, 4, 16), torch.randn(7, 4, 16)
    norm = Qwen3_5MoeRMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(16))
        want = norm(x.reshape(-1, 16), z.reshape(-1, 16)).view(7, 4, 16)
    got = gated_rms_norm(x, z, norm.weight.detach(), 1e-6, "silu")
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    with pytest.raises(ValueError, match="activation must be one of sigmoid, silu"):
        gated_rms_norm(x, z, norm.weight.detach(), 1e-6, "gelu")
