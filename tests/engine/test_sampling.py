"""Sampling transforms against independent per-token formulations, the sampled distribution against
softmax, seed reproducibility across batch compositions, validation messages, stop conditions."""

import math
import random
from collections import Counter

import pytest
import torch

from dayzero.engine import Sampler, SamplingParams, StopChecker
from dayzero.engine.sampling import apply_penalties, apply_top_k_top_p, sampling_probs

V = 64


def _states(sampler, params, prompts=None, outputs=None):
    states = []
    for i, p in enumerate(params):
        s = sampler.new_state(p, prompts[i] if prompts else [])
        s.output_token_ids.extend(outputs[i] if outputs else [])
        states.append(s)
    return states


def _rand_ids(rng, n, vocab=V):
    return [rng.randrange(vocab) for _ in range(n)]


# --- penalties ---------------------------------------------------------------------------------


def test_penalties_match_per_token_loop():
    rng = random.Random(1)
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-1.1),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.5),
        SamplingParams(),
    ]
    prompts = [_rand_ids(rng, rng.randrange(1, 30)) for _ in params]
    outputs = [_rand_ids(rng, rng.randrange(0, 40), vocab=20) for _ in params]  # repeats likely
    logits = torch.randn(len(params), V) * 3
    got = apply_penalties(logits, _states(Sampler(V), params, prompts, outputs))

    expected = logits.double().clone()
    for b, p in enumerate(params):
        for t in set(prompts[b]) | set(outputs[b]):
            x = expected[b, t].item()
            expected[b, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t, c in Counter(outputs[b]).items():
            expected[b, t] -= p.frequency_penalty * c + p.presence_penalty
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[4], logits[4])


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.randn(1, V)
    states = _states(Sampler(V), [SamplingParams(presence_penalty=2, frequency_penalty=2)], [[3, 4, 5]], [[]])
    assert torch.equal(apply_penalties(logits, states), logits)


# --- top-k / top-p / min-p ------------------------------------------------------------------------


def _ref_top_k(logits, k):
    """Keep a token iff fewer than k tokens have a strictly larger logit (ties with the k-th kept)."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            keep[b, t] = k[b] <= 0 or (logits[b] > logits[b, t]).sum() < k[b]
    return keep


def _ref_top_p(probs, p):
    """Keep a token iff the tokens strictly more probable than it hold less than p: the smallest set
    with mass >= p, plus any tokens tied with its least probable member."""
    keep = torch.zeros_like(probs, dtype=torch.bool)
    for b in range(probs.shape[0]):
        for t in range(probs.shape[1]):
            keep[b, t] = p[b] >= 1 or probs[b][probs[b] > probs[b, t]].sum() < p[b]
    return keep


def test_top_k_keeps_the_k_largest_with_ties():
    logits = (torch.randn(8, V) * 2).round(decimals=1)  # rounding makes ties
    k = [1, 3, 7, 20, V, V + 5, -1, 0]
    got = apply_top_k_top_p(logits, k, [1.0] * 8)
    assert torch.equal(got > -math.inf, _ref_top_k(logits, k))
    assert torch.equal(got[got > -math.inf], logits[got > -math.inf])


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.randn(12, V) * 2
    logits[0] = torch.randn(V) * 0.5
    logits[0, :5] = 3.0  # five tied tokens of ~0.12 each: the smallest set reaching 0.3 takes three
    p = [0.3] + [0.05 + 0.9 * i / 10 for i in range(10)] + [1.0]
    got = apply_top_k_top_p(logits, [-1] * 12, p)
    probs = torch.softmax(logits.double(), -1)
    keep = _ref_top_p(probs, p)
    assert torch.equal(got > -math.inf, keep)
    assert keep[0, :5].all()
    for b in range(1, 11):  # no ties: minimal, and reaching p
        kept = probs[b][keep[b]]
        assert kept.sum() >= p[b] and kept.sum() - kept.min() < p[b]


def test_top_p_renormalises_after_top_k():
    logits = torch.randn(6, V) * 2
    k, p = [2, 5, 10, 30, -1, 3], [0.3, 0.6, 0.9, 0.5, 0.7, 1.0]
    got = apply_top_k_top_p(logits, k, p)
    after_k = logits.double().masked_fill(~_ref_top_k(logits, k), -math.inf)
    keep = _ref_top_p(torch.softmax(after_k, -1), p) & _ref_top_k(logits, k)
    assert torch.equal(got > -math.inf, keep)


def test_min_p_keeps_tokens_above_fraction_of_max():
    logits = torch.randn(5, V) * 2
    min_p = [0.0, 0.01, 0.1, 0.5, 1.0]
    got = sampling_probs(logits, [SamplingParams(min_p=m) for m in min_p])
    probs = torch.softmax(logits.double(), -1)
    for b, m in enumerate(min_p):
        keep = probs[b] >= m * probs[b].max()
        assert torch.equal(got[b] > 0, keep)
        torch.testing.assert_close(got[b].double(), torch.where(keep, probs[b], 0) / probs[b][keep].sum())


def test_pipeline_order_temperature_top_k_top_p_min_p():
    logits = torch.randn(4, V) * 2
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t, k, p, m in [(0.5, 10, 0.8, 0.1), (1.5, -1, 0.6, 0.2), (1.0, 20, 0.95, 0.0), (2.0, 5, 1.0, 0.3)]]
    got = sampling_probs(logits, params)
    for b, sp in enumerate(params):
        x = logits[b:b + 1].double() / sp.temperature
        x = x.masked_fill(~_ref_top_k(x, [sp.top_k]), -math.inf)
        x = x.masked_fill(~_ref_top_p(torch.softmax(x, -1), [sp.top_p]), -math.inf)
        q = torch.softmax(x, -1)[0]
        q = torch.where(q >= sp.min_p * q.max(), q, 0)
        torch.testing.assert_close(got[b].double(), q / q.sum(), rtol=1e-5, atol=1e-7)


# --- sampling -----------------------------------------------------------------------------------


def test_greedy_is_argmax_of_penalised_logits():
    rng = random.Random(2)
    params = [SamplingParams(temperature=0, top_k=3, top_p=0.1, min_p=0.9),
              SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=1.0),
              SamplingParams(temperature=1e-6)]
    prompts = [_rand_ids(rng, 10) for _ in params]
    outputs = [_rand_ids(rng, 10) for _ in params]
    for _ in range(10):
        logits = torch.randn(3, V)
        states = _states(Sampler(V), params, prompts, outputs)
        want = apply_penalties(logits, states).argmax(-1)  # before: sampling counts its token in the states
        out = Sampler(V)(logits, states)
        assert torch.equal(out.token_ids, want)
        assert out.token_ids[0] == logits[0].argmax()


CHI2_999 = {7: 24.32}  # chi-square 0.999 quantile by degrees of freedom


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=6, min_p=0.05)])
def test_sampled_distribution_matches_softmax(params):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.3, 2.0, 0.1, -1.0, 0.8])
    rows, steps = 1000, 20
    sampler = Sampler(8, seed=7)
    states = [sampler.new_state(params, []) for _ in range(rows)]
    counts = torch.zeros(8)
    for _ in range(steps):
        counts += torch.bincount(sampler(logits.expand(rows, 8), states).token_ids, minlength=8)
    q = torch.softmax(logits.double() / params.temperature, -1)  # independent of sampling_probs
    q = torch.where(_ref_top_k(q[None], [params.top_k])[0] & (q >= params.min_p * q.max()), q, 0)
    expected = q / q.sum() * rows * steps
    support = expected > 0
    assert counts[~support].sum() == 0
    chi2 = ((counts.double()[support] - expected[support]) ** 2 / expected[support]).sum().item()
    dof = int(support.sum()) - 1
    assert chi2 < CHI2_999.get(dof, dof + 4 * math.sqrt(2 * dof)), (chi2, counts, expected)


def _run(sampler, params_list, logits_per_step, prompts):
    states = [sampler.new_state(p, prompts[i]) for i, p in enumerate(params_list)]
    tokens = []
    for logits in logits_per_step:
        out = sampler(logits, states).token_ids.tolist()
        for s, t in zip(states, out):
            s.output_token_ids.append(t)
        tokens.append(out)
    return [list(col) for col in zip(*tokens)]


def test_seeded_request_is_independent_of_batch():
    rng = random.Random(3)
    mine = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=1234)
    others = [SamplingParams(temperature=rng.choice([0, 0.5, 1.0, 1.7]), top_k=rng.choice([-1, 5, 30]),
                             presence_penalty=rng.uniform(-1, 1), seed=rng.choice([None, 1234, 99]))
              for _ in range(5)]
    prompt = _rand_ids(rng, 12)
    mine_logits = [torch.randn(V) for _ in range(30)]
    alone = _run(Sampler(V, seed=0), [mine], [x[None] for x in mine_logits], [prompt])[0]

    batch = others[:2] + [mine] + others[2:]
    batch_logits = [torch.cat([torch.randn(2, V), x[None], torch.randn(3, V)]) for x in mine_logits]
    prompts = [_rand_ids(rng, 7) for _ in range(2)] + [prompt] + [_rand_ids(rng, 7) for _ in range(3)]
    in_batch = _run(Sampler(V, seed=555), batch, batch_logits, prompts)[2]
    assert alone == in_batch
    assert len(set(alone)) > 3  # actually random


def test_unseeded_requests_follow_the_global_seed():
    logits = [torch.zeros(4, V) for _ in range(10)]
    params = [SamplingParams()] * 4
    a = _run(Sampler(V, seed=1), params, logits, [[]] * 4)
    assert a == _run(Sampler(V, seed=1), params, logits, [[]] * 4)
    assert a != _run(Sampler(V, seed=2), params, logits, [[]] * 4)
    assert a[0] != a[1]


def test_n_completions_of_a_seeded_request_differ():
    sampler = Sampler(V)
    p = SamplingParams(seed=5, n=2)
    states = [sampler.new_state(p, [], sample_index=i) for i in range(2)]
    tokens = [sampler(torch.zeros(2, V), states).token_ids.tolist() for _ in range(10)]
    assert [t[0] for t in tokens] != [t[1] for t in tokens]


# --- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(4, V) * 3
    params = [SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5, top_k=3),
              SamplingParams(logprobs=0, temperature=0),
              SamplingParams(),
              SamplingParams(logprobs=20, frequency_penalty=1)]
    states = _states(Sampler(V), params, [[1, 2, 3]] * 4, [[4, 4]] * 4)
    out = Sampler(V)(logits, states)
    ref = torch.log_softmax(logits.double(), -1)
    assert out.logprobs[2] is None
    for b in (0, 1, 3):
        lp = out.logprobs[b]
        t = out.token_ids[b].item()
        assert lp.token_id == t
        assert lp.logprob == pytest.approx(ref[b, t].item(), abs=1e-5)
        assert lp.rank == 1 + int((ref[b] > ref[b, t]).sum())
        order = ref[b].argsort(descending=True)[:params[b].logprobs].tolist()
        assert [i for i, _ in lp.top] == order
        assert [x for _, x in lp.top] == pytest.approx(ref[b, order].tolist(), abs=1e-5)


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", float("nan")), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", "1"),
    ("top_k", -2), ("top_k", 2.0),
    ("min_p", -0.1), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", 3), ("frequency_penalty", -2.5),
    ("seed", 1.5), ("seed", "7"), ("seed", 2**64),
    ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [V]), ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]),
    ("ignore_eos", "yes"),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0),
    ("n", 0), ("n", "2"),
    ("skip_special_tokens", 1),
])
def test_validation_names_field_value_and_range(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError) as err:
        params.validate(vocab_size=V)
    message = str(err.value)
    assert f"{field}={value!r}" in message and "expected" in message
    assert "; " not in message  # one problem: this field's


def test_validation_reports_every_problem_and_sampler_validates():
    with pytest.raises(ValueError, match=r"temperature=-1.*top_p=0.*n=0"):
        SamplingParams(temperature=-1, top_p=0, n=0).validate()
    with pytest.raises(ValueError, match=r"stop_token_ids=\[64\].*\[0, 64\)"):
        Sampler(V).new_state(SamplingParams(stop_token_ids=[V]), [])
    for ok in [SamplingParams(), SamplingParams(temperature=0, top_k=0, top_p=1, min_p=1, max_tokens=None,
                                                seed=-5, stop="x", logprobs=20, presence_penalty=-2)]:
        ok.validate(vocab_size=V)
    assert SamplingParams(stop="x").stop == ["x"]


# --- stop conditions ------------------------------------------------------------------------------

EOS = 0
PIECES = {1: "Hello", 2: " wor", 3: "ld", 4: "E", 5: "N", 6: "D", 7: "x", 8: "fooSTOPbar", 9: "<|stop|>", 10: "ST"}


def _generate(params, tokens, eos=EOS):
    """Feed tokens one at a time as an engine would (each with the text it made final); return
    (finish_reason, stop_reason, text, count)."""
    checker, text = StopChecker(params, eos), ""
    for n, t in enumerate(tokens, 1):
        text += PIECES.get(t, "")
        d = checker.check(PIECES.get(t, ""), t, n)
        assert checker.length == len(text)
        if d.finish_reason:
            return d.finish_reason, d.stop_reason, text[:d.length], n
    return None, None, text, len(tokens)


def test_stop_string_across_token_boundaries_is_trimmed():
    assert _generate(SamplingParams(stop=["END"], max_tokens=50), [1, 7, 4, 5, 6, 7]) == ("stop", "END", "Hellox", 5)
    assert _generate(SamplingParams(stop=["world"]), [1, 2, 3, 7]) == ("stop", "world", "Hello ", 3)


def test_stop_string_inside_one_token_and_earliest_match_wins():
    assert _generate(SamplingParams(stop=["bar", "STOP"]), [7, 8]) == ("stop", "STOP", "xfoo", 2)


def test_stop_string_wins_over_length_at_the_same_token():
    assert _generate(SamplingParams(stop=["ND"], max_tokens=3), [4, 5, 6]) == ("stop", "ND", "E", 3)
    assert _generate(SamplingParams(stop=["zzz"], max_tokens=3), [4, 5, 6, 7]) == ("length", None, "END", 3)


def test_eos_and_stop_token_ids():
    assert _generate(SamplingParams(), [1, EOS, 7]) == ("stop", None, "Hello", 2)
    assert _generate(SamplingParams(stop_token_ids=[9]), [1, 9]) == ("stop", 9, "Hello", 2)
    assert _generate(SamplingParams(ignore_eos=True, max_tokens=3), [1, EOS, 7, 7]) == ("length", None, "Hellox", 3)
    assert _generate(SamplingParams(ignore_eos=True, stop_token_ids=[EOS]), [1, EOS]) == ("stop", EOS, "Hello", 2)
    assert _generate(SamplingParams(), [1, 2], eos=[2, 3]) == ("stop", None, "Hello", 2)
    assert _generate(SamplingParams(max_tokens=None), [7] * 100) == (None, None, "x" * 100, 100)


def _checker_after(params, text):
    checker = StopChecker(params, EOS)
    for ch in text:
        checker.check(ch, 7, 1)
    return checker


def test_streamable_length_holds_back_a_possible_stop_prefix():
    params = SamplingParams(stop=["STOP", "xyz"], max_tokens=None)
    assert _checker_after(params, "Hello ST").streamable_length() == len("Hello ")
    assert _checker_after(params, "Hello x").streamable_length() == len("Hello ")
    assert _checker_after(params, "Hello S T").streamable_length() == len("Hello S T")
    assert _checker_after(SamplingParams(max_tokens=None), "abc").streamable_length() == 3


def test_a_stop_string_split_over_many_small_pieces_is_found_with_bounded_work():
    """The checker keeps only the last len(longest stop) - 1 characters: a stop string arriving one
    character (or nothing) per token is still found, at the right place, after 10,000 characters."""
    checker = StopChecker(SamplingParams(stop=["<end>", "zz"], max_tokens=None), EOS)
    pieces = ["ab"] * 5000 + ["<", "", "e", "nd", ">tail"]
    for n, piece in enumerate(pieces, 1):
        d = checker.check(piece, 7, n)
        assert len(checker.tail) <= 4
    assert (d.finish_reason, d.stop_reason, d.length) == ("stop", "<end>", 10000)


def test_penalty_counts_follow_sampled_and_appended_tokens_incrementally():
    """The device counts: built once, then the sampled token added on the device and appended tokens
    the sampler did not sample added at the next call; equal to counting the whole output afresh."""
    rng = random.Random(5)
    params = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    sampler = Sampler(V)
    state = sampler.new_state(params, _rand_ids(rng, 12))
    for step in range(12):
        logits = torch.randn(1, V)
        if step % 3 == 2:
            state.output_token_ids.append(rng.randrange(V))  # a token from elsewhere (e.g. a forced one)
        fresh = sampler.new_state(params, state.prompt_token_ids)
        fresh.output_token_ids.extend(state.output_token_ids)
        assert torch.equal(apply_penalties(logits, [state]), apply_penalties(logits, [fresh]))
        token = int(sampler(logits, [state]).token_ids[0])
        state.output_token_ids.append(token)  # what the engine does once the id is on the host
    assert state.counted == len(state.output_token_ids) and int(state.counts.sum()) == len(state.output_token_ids)

