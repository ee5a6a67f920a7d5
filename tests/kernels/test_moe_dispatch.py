import pytest
import torch

from tests.kernels.conftest import cuda, interpreter


def _check(d, ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    from dayzero.kernels.moe._dispatch import dispatch_reference

    ref = dispatch_reference(ids, num_experts, block_m)
    flat = ids.reshape(-1).long().cpu()
    S = flat.numel()
    assert torch.equal(d.counts.cpu(), ref.counts.cpu())
    assert torch.equal(d.expert_block.cpu(), ref.expert_block.cpu())
    assert torch.equal(d.block_expert.cpu(), ref.block_expert.cpu())
    pair_row, row_pair, block_expert = d.pair_row.long().cpu(), d.row_pair.long().cpu(), d.block_expert.long().cpu()
    valid = (flat >= 0) & (flat < num_experts)
    assert torch.equal(pair_row[~valid], torch.full_like(pair_row[~valid], -1))
    rows = pair_row[valid]
    assert torch.equal(row_pair[rows], torch.arange(S)[valid])  # scatter and gather are inverse
    assert torch.equal(block_expert[rows // block_m], flat[valid])  # each pair sits in its expert's blocks
    assert int((row_pair < S).sum()) == int(valid.sum())  # every other row is padding
    assert row_pair.numel() == d.max_blocks * block_m


@interpreter
@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 4, 16, 16), (7, 3, 8, 16), (40, 2, 5, 32), (33, 6, 64, 16)])
def test_dispatch_matches_reference_interpreted(tokens, top_k, experts, block_m):
    from dayzero.kernels.moe._dispatch import dispatch

    ids = torch.rand(tokens, experts).argsort(dim=1)[:, :top_k]
    _check(dispatch(ids, experts, block_m), ids, experts, block_m)


@interpreter
def test_dispatch_drops_out_of_range_ids_interpreted():
    from dayzero.kernels.moe._dispatch import combine, dispatch

    ids = torch.tensor([[0, 5], [-1, 2], [7, 3]], dtype=torch.int32)
    d = dispatch(ids, 6, 16)
    _check(d, ids, 6, 16)
    y = torch.randn(d.max_rows, 8).bfloat16()
    out = combine(y, d, 3, torch.float32)
    rows = d.pair_row.long()
    expect = torch.stack([y[rows[2 * t:2 * t + 2][rows[2 * t:2 * t + 2] >= 0]].float().sum(0) for t in range(3)])
    torch.testing.assert_close(out, expect)


@interpreter
def test_dispatch_rejects_bad_arguments():
    from dayzero.kernels.moe._dispatch import dispatch

    with pytest.raises(ValueError, match="topk_ids"):
        dispatch(torch.zeros(4, dtype=torch.int64), 8, 16)
    with pytest.raises(ValueError, match="power of two"):
        dispatch(torch.zeros(4, 2, dtype=torch.int64), 8, 24)


@cuda
@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 4, 128, 16), (32, 4, 128, 16), (8192, 6, 256, 128),
                                                           (2048, 4, 128, 64)])
def test_dispatch_matches_reference_cuda(tokens, top_k, experts, block_m):
    from dayzero.kernels.moe._dispatch import dispatch

    ids = torch.rand(tokens, experts, device="cuda").argsort(dim=1)[:, :top_k]
    _check(dispatch(ids, experts, block_m), ids, experts, block_m)


@interpreter
@pytest.mark.parametrize("tokens,experts,top_k,big,tail_max", [(300, 8, 2, 4, 2), (1000, 16, 4, 4, 2), (50, 128, 4, 4, 2),
                                                               (700, 6, 2, 2, 1), (0, 4, 2, 4, 2), (513, 32, 4, 4, 0)])
def test_split_blocks_matches_a_loop_over_experts(tokens, experts, top_k, big, tail_max):
    """split_blocks against a plain loop: each expert's 64-row blocks as big blocks of big * 64 rows,
    then its last blocks as tail blocks (at most tail_max) or one more big block; unused entries E."""
    from dayzero.kernels.moe._dispatch import dispatch, split_blocks

    gen = torch.Generator().manual_seed(tokens + experts)
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
    d = dispatch(ids, experts, 64)
    main, tail = split_blocks(d, big, tail_max)
    want_main, want_tail = [], []
    for e, (count, first) in enumerate(zip(d.counts.tolist(), d.expert_block.tolist())):
        nb = -(-count // 64)
        full, rem = divmod(nb, big)
        end = (first + nb) * 64
        want_main += [((first + g * big) * 64, e, end) for g in range(full + (rem > tail_max))]
        want_tail += [((first + full * big + t) * 64, e, end) for t in range(rem if rem <= tail_max else 0)]
    for got, want in ((main, want_main), (tail, want_tail)):
        rows = list(zip(got.row0.tolist(), got.expert.tolist(), got.end.tolist()))
        assert rows[:len(want)] == want
        assert all(e == experts for _, e, _ in rows[len(want):])
    with pytest.raises(ValueError, match="split_blocks"):
        split_blocks(d, 4, 4)
