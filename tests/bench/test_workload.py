"""The benchmark workload: seeded, fixed or uniformly spread lengths, fresh ids per draw."""

import pytest

from dayzero.bench.workload import Workload


def test_fixed_lengths_and_ids_in_the_vocabulary():
    w = Workload(num_prompts=6, input_len=10, output_len=4, vocab_size=50, seed=3)
    requests = w.requests()
    assert [len(r.prompt_token_ids) for r in requests] == [10] * 6
    assert [r.output_len for r in requests] == [4] * 6
    ids = [t for r in requests for t in r.prompt_token_ids]
    assert all(type(t) is int and 0 <= t < 50 for t in ids)
    assert len(set(ids)) > 20  # random, not a constant fill
    assert w.max_request_len == 14
    assert w.to_dict()["total_input_tokens"] == 60


def test_the_same_seed_gives_the_same_prompts_and_another_draw_fresh_ids_of_the_same_lengths():
    w = Workload(num_prompts=8, input_len=20, output_len=8, vocab_size=1000, range_ratio=0.5, seed=1)
    a, b, again = w.requests(0), w.requests(1), Workload(8, 20, 8, 1000, 0.5, 1).requests(0)
    assert a == again
    assert [len(r.prompt_token_ids) for r in a] == [len(r.prompt_token_ids) for r in b]
    assert [r.output_len for r in a] == [r.output_len for r in b]
    assert all(x.prompt_token_ids != y.prompt_token_ids for x, y in zip(a, b))
    assert Workload(8, 20, 8, 1000, 0.5, 2).requests(0) != a


def test_range_ratio_spreads_lengths_uniformly_within_its_bounds():
    w = Workload(num_prompts=2000, input_len=100, output_len=10, vocab_size=10, range_ratio=0.25, seed=0)
    inputs = [n for n, _ in w.lengths()]
    outputs = [o for _, o in w.lengths()]
    assert min(inputs) == 75 and max(inputs) == 125  # [floor(100 * 0.75), ceil(100 * 1.25)], every value reached
    assert 95 < sum(inputs) / len(inputs) < 105
    assert min(outputs) >= 7 and max(outputs) <= 13 and len(set(outputs)) > 3


@pytest.mark.parametrize("field, kwargs", [("num_prompts", dict(num_prompts=0)), ("input_len", dict(input_len=-1)),
                                           ("output_len", dict(output_len=0)), ("range_ratio", dict(range_ratio=1.0))])
def test_bad_values_name_the_field(field, kwargs):
    args = dict(num_prompts=2, input_len=4, output_len=4, vocab_size=10) | kwargs
    with pytest.raises(ValueError, match=field):
        Workload(**args)
