"""KDA ops against independent formulations: loops over channels / heads / tokens in float64, the
chunked form against the token-by-token form, and transformers' torch fallbacks of Kimi Linear."""

import math

import pytest
import torch
import torch.nn.functional as F

from dayzero.ops.kda import (gated_rms_norm, kda_chunk, kda_chunk_varlen, kda_gate, kda_recurrent, kda_recurrent_slots,
                             short_conv1d, short_conv1d_varlen)


@pytest.fixture(autouse=True)
def _private_rng():
    """Deterministic draws here, and the global generator left as other test files expect it."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield


def _inputs(b, t, h, dk, dv, lower_bound=None):
    q, k = torch.randn(b, t, h, dk), torch.randn(b, t, h, dk)
    v = torch.randn(b, t, h, dv)
    a_log = (1 + 15 * torch.rand(h)).log()
    dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(h, dk))
    g = kda_gate(torch.randn(b, t, h, dk), a_log, dt + torch.log(-torch.expm1(-dt)), lower_bound)
    beta = torch.rand(b, t, h)
    return q, k, v, g, beta


# -- short_conv1d ---------------------------------------------------------------------------------


def _conv_loop(x, weight, state):
    """y[b, t, d] = silu(sum_j w[d, j] * window[b, d, t + j]) with window = [state | x^T], float64."""
    b, t, d = x.shape
    kernel = weight.shape[1]
    window = torch.cat([state, x.transpose(1, 2)], dim=2).double()
    y = torch.zeros(b, t, d, dtype=torch.float64)
    for i in range(t):
        for c in range(d):
            y[:, i, c] = (window[:, c, i:i + kernel] * weight[c].double()).sum(-1)
    return F.silu(y), window[:, :, -(kernel - 1):]


@pytest.mark.parametrize("t", (1, 2, 9))
def test_short_conv1d_matches_loop_and_continues_from_its_state(t):
    b, d, kernel = 2, 6, 4
    x, w, state = torch.randn(b, t, d), torch.randn(d, kernel), torch.randn(b, d, kernel - 1)
    y, new_state = short_conv1d(x, w, state)
    want, want_state = _conv_loop(x, w, state)
    assert torch.allclose(y.double(), want, atol=1e-6)
    assert torch.equal(new_state, want_state.float())  # the last K-1 inputs, exactly (also when T < K-1)


def test_short_conv1d_split_equals_whole_and_matches_transformers():
    from transformers.models.kimi_linear.modeling_kimi_linear import causal_conv1d_fn

    x, w = torch.randn(2, 11, 6), torch.randn(6, 4)
    whole, _ = short_conv1d(x, w)
    first, state = short_conv1d(x[:, :2], w)
    rest, _ = short_conv1d(x[:, 2:], w, state)
    assert torch.allclose(torch.cat([first, rest], 1), whole, atol=1e-6)
    theirs = causal_conv1d_fn(x.transpose(1, 2), w, activation="silu").transpose(1, 2)
    assert torch.allclose(whole, theirs, atol=1e-6)


def test_short_conv1d_rejects_bad_shapes():
    with pytest.raises(ValueError, match="state must be"):
        short_conv1d(torch.randn(1, 3, 4), torch.randn(4, 4), torch.randn(1, 4, 2))
    with pytest.raises(ValueError, match="weight"):
        short_conv1d(torch.randn(1, 3, 4), torch.randn(5, 4))


# -- kda_gate -------------------------------------------------------------------------------------


def test_kda_gate_plain_matches_per_channel_formula_and_transformers():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForgetGate

    h, d = 3, 4
    raw, a_log, dt = 4 * torch.randn(2, 5, h, d), torch.randn(h), torch.randn(h, d)
    raw[0, 0, 0, 0] = 30.0  # past softplus' linear threshold
    g = kda_gate(raw, a_log, dt)
    for i in range(h):
        for c in range(d):
            x = raw[..., i, c].double() + float(dt[i, c])
            want = -math.exp(float(a_log[i])) * torch.where(x > 20, x, torch.log1p(torch.exp(x)))
            assert torch.allclose(g[..., i, c].double(), want, rtol=1e-6, atol=1e-7)
    # transformers' module computes f_b(f_a(x)) itself: give it an identity f_a and raw-producing f_b
    cfg = type("Cfg", (), dict(linear_head_dim=d, linear_num_heads=h, hidden_size=h * d))()
    gate = KimiLinearForgetGate(cfg)
    with torch.no_grad():
        gate.f_a_proj = torch.nn.Identity()
        gate.f_b_proj = torch.nn.Identity()
        gate.dt_bias.copy_(dt.reshape(-1))
        gate.A_log.copy_(a_log.view(1, 1, h, 1))
        theirs = gate(raw.reshape(2, 5, h * d))
    assert (g - theirs).abs().max() <= 1e-6 * theirs.abs().max()  # they take log(1 + exp(x)), we log1p(exp(x))


def test_kda_gate_lower_bound_is_the_scaled_sigmoid_and_stays_in_range():
    h, d, lb = 2, 8, -5.0
    raw, a_log, dt = 10 * torch.randn(4, h, d), torch.randn(h), torch.randn(h, d)
    g = kda_gate(raw, a_log, dt, lower_bound=lb)
    want = lb * torch.sigmoid(a_log.double().exp()[:, None] * (raw.double() + dt.double()))
    assert torch.allclose(g.double(), want, rtol=1e-6)
    assert g.dtype == torch.float32 and bool(((g >= lb) & (g <= 0)).all())  # open interval, closed in float32
    with pytest.raises(ValueError, match="negative"):
        kda_gate(raw, a_log, dt, lower_bound=1.0)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(raw, torch.randn(h + 1), dt)


# -- kda_recurrent / kda_chunk --------------------------------------------------------------------


def _kda_loop(q, k, v, g, beta, state):
    """Per batch row and head, in float64 matrices: S = (I - b k k^T) Diag(exp(g)) S + b k v^T,
    o = S^T q / sqrt(dk), with q and k L2-normalised (eps 1e-6 inside the root)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    out = torch.zeros(b, t, h, dv, dtype=torch.float64)
    final = torch.zeros(b, h, dk, dv, dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    for i in range(b):
        for j in range(h):
            s = state[i, j].double()
            for n in range(t):
                qn, kn = q[i, n, j].double(), k[i, n, j].double()
                qn, kn = qn / torch.sqrt(qn @ qn + 1e-6), kn / torch.sqrt(kn @ kn + 1e-6)
                bn = float(beta[i, n, j])
                s = (eye - bn * torch.outer(kn, kn)) @ torch.diag(g[i, n, j].double().exp()) @ s \
                    + bn * torch.outer(kn, v[i, n, j].double())
                out[i, n, j] = s.T @ qn / math.sqrt(dk)
            final[i, j] = s
    return out, final


def test_kda_recurrent_matches_the_matrix_recurrence():
    q, k, v, g, beta = _inputs(2, 9, 3, 8, 6)
    state = torch.randn(2, 3, 8, 6)
    o, s = kda_recurrent(q, k, v, g, beta, state)
    want_o, want_s = _kda_loop(q, k, v, g, beta, state)
    assert torch.allclose(o.double(), want_o, atol=1e-5) and torch.allclose(s.double(), want_s, atol=1e-5)
    assert o.dtype == torch.float32 and s.dtype == torch.float32


@pytest.mark.parametrize("lower_bound", (None, -5.0))
@pytest.mark.parametrize("t, chunk", [(1, 64), (5, 64), (63, 16), (150, 64), (150, 7), (37, 1)])
def test_kda_chunk_equals_recurrent(t, chunk, lower_bound):
    q, k, v, g, beta = _inputs(2, t, 2, 16, 8, lower_bound)
    state = torch.randn(2, 2, 16, 8)
    o_c, s_c = kda_chunk(q, k, v, g, beta, state, chunk_size=chunk)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, state)
    assert (o_c - o_r).abs().max() <= 1e-5 and (s_c - s_r).abs().max() <= 1e-5
    # without an initial state: zeros
    o_0, _ = kda_chunk(q, k, v, g, beta, None, chunk_size=chunk)
    assert (o_0 - kda_recurrent(q, k, v, g, beta, torch.zeros_like(state))[0]).abs().max() <= 1e-5


def test_kda_recurrent_slots_updates_only_its_slots_in_place():
    q, k, v, g, beta = _inputs(3, 1, 2, 8, 6)
    state = torch.randn(3, 2, 8, 6)
    pool = torch.randn(7, 2, 8, 6, generator=torch.Generator().manual_seed(5))
    slots = torch.tensor([5, 0, 3])
    pool[slots] = state
    before = pool.clone()
    o = kda_recurrent_slots(q, k, v, g, beta, pool, slots)
    want_o, want_s = _kda_loop(q, k, v, g, beta, state)
    assert (o.double() - want_o).abs().max() <= 1e-5 and (pool[slots].double() - want_s).abs().max() <= 1e-5
    rest = torch.tensor([1, 2, 4, 6])
    assert torch.equal(pool[rest], before[rest])
    with pytest.raises(ValueError, match="pool must be float32"):
        kda_recurrent_slots(q, k, v, g, beta, pool[:, :1], slots)
    with pytest.raises(ValueError, match="slots must be int"):
        kda_recurrent_slots(q, k, v, g, beta, pool, slots[:2])


@pytest.mark.parametrize("seed", range(4))
def test_short_conv1d_varlen_equals_each_sequence_alone(seed):
    """Packed sequences of random lengths (shorter and longer than the kernel's K - 1 = 3, one token too),
    each continuing from its own state (or zeros): the loop's outputs and last inputs, sequence by sequence."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
    d, kernel = 6, 4
    weight = torch.randn(d, kernel, generator=g)
    x = torch.randn(sum(lengths), d, generator=g)
    state = None if seed % 2 else torch.randn(len(lengths), d, kernel - 1, generator=g)
    starts = torch.tensor([0] + lengths).cumsum(0)
    y, new = short_conv1d_varlen(x, weight, starts, state)
    assert y.shape == x.shape and new.shape == (len(lengths), d, kernel - 1)
    for i, (a, e) in enumerate(zip(starts.tolist(), starts[1:].tolist())):
        st = torch.zeros(1, d, kernel - 1) if state is None else state[i:i + 1]
        want_y, want_s = _conv_loop(x[None, a:e], weight, st)
        assert (y[a:e].double() - want_y[0]).abs().max() <= 1e-5
        assert torch.allclose(new[i].double(), want_s[0])


def test_kda_chunk_varlen_gives_each_sequence_its_kda_chunk_and_state():
    lengths, h, dk, dv = [5, 1, 70, 33], 2, 16, 8
    parts = [_inputs(1, t, h, dk, dv) for t in lengths]
    q, k, v, g, beta = (torch.cat([p[i][0] for p in parts]) for i in range(5))
    pool = torch.randn(9, h, dk, dv)
    slots = torch.tensor([7, 2, 0, 5])
    before = pool.clone()
    host = tuple(torch.tensor([0] + lengths).cumsum(0).tolist())
    o = kda_chunk_varlen(q, k, v, g, beta, torch.tensor(host), host, pool, slots, chunk_size=16)
    for i, (a, e) in enumerate(zip(host, host[1:])):
        want_o, want_s = kda_recurrent(*(x[None] for x in (q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e])),
                                       before[slots[i]][None])
        assert (o[a:e] - want_o[0]).abs().max() <= 1e-5 and (pool[slots[i]] - want_s[0]).abs().max() <= 1e-5
    untouched = torch.tensor([1, 3, 4, 6, 8])
    assert torch.equal(pool[untouched], before[untouched])


def test_kda_chunk_continues_from_its_state():
    q, k, v, g, beta = _inputs(1, 100, 2, 16, 16)
    whole, s_whole = kda_chunk(q, k, v, g, beta, chunk_size=32)
    first, s = kda_chunk(q[:, :45], k[:, :45], v[:, :45], g[:, :45], beta[:, :45], chunk_size=32)
    rest, s = kda_chunk(q[:, 45:], k[:, 45:], v[:, 45:], g[:, 45:], beta[:, 45:], s, chunk_size=32)
    assert (torch.cat([first, rest], 1) - whole).abs().max() <= 1e-5 and (s - s_whole).abs().max() <= 1e-5


def test_kda_chunk_matches_transformers_fallback():
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    q, k, v, g, beta = _inputs(2, 150, 2, 16, 16)
    state = torch.randn(2, 2, 16, 16)
    ours, s_ours = kda_chunk(q, k, v, g, beta, state)
    theirs, s_theirs = chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=state.clone(), output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    assert (ours - theirs).abs().max() <= 1e-5 and (s_ours - s_theirs).abs().max() <= 1e-5


def test_kda_bfloat16_inputs_return_bfloat16_with_float32_state():
    q, k, v, g, beta = _inputs(1, 20, 2, 16, 16)
    o, s = kda_chunk(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16())
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_kda_rejects_bad_shapes():
    q, k, v, g, beta = _inputs(1, 4, 2, 8, 8)
    with pytest.raises(ValueError, match="beta must be"):
        kda_chunk(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="state must be float32"):
        kda_recurrent(q, k, v, g, beta, torch.zeros(1, 2, 8, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="g must be"):
        kda_recurrent(q, k, v, g[..., :4], beta)
    with pytest.raises(ValueError, match="chunk_size"):
        kda_chunk(q, k, v, g, beta, chunk_size=0)


# -- gated_rms_norm -------------------------------------------------------------------------------


def test_gated_rms_norm_matches_loop_and_transformers():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated

    x, gate, w = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 4, 16), 1 + 0.1 * torch.randn(16)
    got = gated_rms_norm(x, gate, w, 1e-5)
    xd = x.double()
    want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double() * torch.sigmoid(gate.double())
    assert torch.allclose(got.double(), want, atol=1e-6)
    norm = KimiLinearRMSNormGated(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(w)
        assert torch.allclose(got, norm(x, gate), atol=1e-6)
    assert gated_rms_norm(x.bfloat16(), gate.bfloat16(), w.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, gate[..., :8], w)
