"""DeepSeek-V4's paged decode kernels (dayzero/kernels/v4/_paged.py) against their reference ops
(dayzero/ops/attention_v4_paged.py): under Triton's interpreter on seeded random steps (rows at different
positions, shuffled block tables, pages no row owns filled with NaN, window pages before the window
reclaimed, rates below and above the block size, k above and below what a row sees), and on CUDA at
DeepSeek-V4-Flash's shapes through the registry."""

import random

import pytest
import torch

from dayzero import ops
from dayzero.ops.paged import FP8_GROUP, PagedStream
from dayzero.ops.registry import REGISTRY
from tests.kernels.conftest import cuda, interpreter


def _stream(g, positions, dim, rate, block, dtype, device, window=None, fp8=False):
    """A stream holding entries 0 .. (p + 1) // rate - 1 of every row (p its position), on pages handed out in a
    random order from a pool whose other pages hold NaN; with `window`, blocks wholly before the row's window
    are reclaimed (-1 in the table) and NaN too."""
    per_block = block // rate if rate <= block else 1
    blocks = [max(1, -(-(p + 1) // block)) for p in positions]
    pages = sum(blocks) + 3
    order = torch.randperm(pages, generator=g).tolist()
    width = max(blocks) + 1
    table = torch.full((len(positions), width), -1, dtype=torch.int32)
    buf = torch.full((pages, per_block * dim + 8), float("nan"))  # a page holds other streams' bytes too
    data = buf[:, :per_block * dim].view(pages, per_block, dim)
    for b, p in enumerate(positions):
        for j in range(blocks[b]):
            page = order.pop()
            table[b, j] = page
            first_token = j * block
            if window is not None and first_token + block <= p - window + 1:
                table[b, j] = -1  # reclaimed: before the window
                continue
            for s in range(per_block):  # entry e lives in the block of its last token e * rate + rate - 1
                if rate <= block:
                    entry = first_token // rate + s
                elif (first_token + block) % rate == 0:
                    entry = (first_token + block) // rate - 1
                else:
                    continue
                if entry < (p + 1) // rate or (rate == 1 and entry <= p):
                    data[page, s] = torch.randn(dim, generator=g)
    stream = PagedStream(data.to(dtype).to(device), table.to(device), block, rate)
    return _fp8(stream) if fp8 else stream


def _fp8(stream: PagedStream) -> PagedStream:
    """The stream's entries as FP8 with scales, read back in its dtype (NaN pages keep NaN scales)."""
    from dayzero.formats.fp8 import quantize_activation_groups

    data = stream.data.float()
    written = ~data.isnan().any(-1)
    q8, scales = quantize_activation_groups(data.nan_to_num(0.0), FP8_GROUP, check_finite=False)
    return PagedStream(q8, stream.block_table, stream.block_size, stream.rate,
                       scales.masked_fill(~written[..., None], float("nan")), stream.data.dtype)


def _rel(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def _case(seed, device="cpu"):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    b = rng.randint(1, 4)
    block = rng.choice((4, 8, 16))
    ratio = rng.choice((2, 4, 8, 32))
    positions = [rng.randint(0, 150) for _ in range(b)]
    return rng, g, b, block, ratio, positions


@interpreter
@pytest.mark.parametrize("seed", range(10))
def test_paged_v4_index_topk_interpreted(seed):
    from dayzero.kernels.v4 import _paged

    rng, g, b, block, ratio, positions = _case(seed)
    h, d = rng.choice((2, 4, 8)), rng.choice((16, 32))
    k = rng.choice((1, 3, 8, 40))
    fp8 = rng.random() < 0.5
    keys = _stream(g, positions, d, ratio, block, torch.float32, "cpu")
    q = torch.randn(b, h, d, generator=g)
    if rng.random() < 0.5:
        q = q.relu()  # with keys of one sign: many heads' ReLUs vanish together, exact ties at 0
        keys.data.abs_()
    if fp8:
        keys = _fp8(keys)
    weights = torch.randn(b, h, generator=g)
    pos = torch.tensor(positions, dtype=torch.int64)
    want = REGISTRY.get("paged_v4_index_topk").reference.fn(q, keys, weights, pos, ratio, k)
    got = _paged.paged_v4_index_topk(q, keys, weights, pos, ratio, k)
    assert got.dtype == torch.int64 and got.shape == (b, k)
    assert torch.equal(got, want)


@interpreter
@pytest.mark.parametrize("seed", range(10))
def test_paged_v4_attention_interpreted(seed):
    from dayzero.kernels.v4 import _paged

    rng, g, b, block, ratio, positions = _case(seed)
    h, d = rng.choice((3, 16, 20)), rng.choice((16, 40))
    window_len = rng.choice((1, 5, 16, 40))
    mode = rng.choice(("swa", "csa", "hca"))
    dtype = rng.choice((torch.float32, torch.bfloat16))
    fp8 = rng.random() < 0.5
    window = _stream(g, positions, d, 1, block, dtype, "cpu", window=window_len, fp8=fp8)
    compressed = indices = None
    if mode != "swa":
        compressed = _stream(g, positions, d, ratio, block, dtype, "cpu", fp8=fp8)
    if mode == "csa":
        k = rng.choice((1, 4, 17))
        indices = torch.full((b, k), -1, dtype=torch.int64)
        for r, p in enumerate(positions):
            seen = (p + 1) // ratio
            pick = torch.randperm(seen, generator=g)[:k] if seen else torch.zeros(0, dtype=torch.int64)
            indices[r, :len(pick)] = pick
    q = torch.randn(b, h, d, generator=g).to(dtype)
    sinks = torch.randn(h, generator=g)
    pos = torch.tensor(positions, dtype=torch.int64)
    args = (q, window, sinks, d ** -0.5, window_len, pos, compressed, indices, ratio if mode != "swa" else None)
    want = REGISTRY.get("paged_v4_attention").reference.fn(*args)
    for splits in (1, rng.choice((2, 3, 7))):  # one program a row, and the tiles split over several (merged)
        got = _paged.paged_v4_attention(*args, splits=splits)
        assert got.dtype == dtype and got.shape == q.shape
        assert _rel(got, want) <= (1e-5 if dtype == torch.float32 else 2e-2), splits


@cuda
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", ["swa", "csa", "hca"])
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_v4_kernels_on_cuda(seed, mode, fp8):
    """V4-Flash shapes: 64 heads of 512, window 128, CSA ratio 4 top-512 (indexer 64 x 128), HCA ratio 128."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    b, block, ratio = rng.choice((1, 5, 16)), 64, 4 if mode == "csa" else 128
    positions = [rng.randint(0, 6000) for _ in range(b)]
    bf16 = torch.bfloat16
    window = _stream(g, positions, 512, 1, block, bf16, "cuda", window=128, fp8=fp8)
    pos = torch.tensor(positions, dtype=torch.int64, device="cuda")
    compressed = indices = None
    with REGISTRY.record_calls(by_backend=True) as calls:
        if mode != "swa":
            compressed = _stream(g, positions, 512, ratio, block, bf16, "cuda", fp8=fp8)
        if mode == "csa":
            keys = _stream(g, positions, 128, ratio, block, bf16, "cuda", fp8=fp8)
            iq = torch.randn(b, 64, 128, generator=g).to("cuda", bf16)
            w = torch.randn(b, 64, generator=g).to("cuda", bf16)
            indices = ops.paged_v4_index_topk(iq, keys, w, pos, ratio, 512)
            with REGISTRY.force_backend("reference"):
                want_idx = ops.paged_v4_index_topk(iq, keys, w, pos, ratio, 512)
            assert torch.equal((indices >= 0).sum(1), (want_idx >= 0).sum(1))
        q = torch.randn(b, 64, 512, generator=g).to("cuda", bf16)
        sinks = torch.randn(64, generator=g).to("cuda")
        args = (q, window, sinks, 512 ** -0.5, 128, pos, compressed, indices, ratio if mode != "swa" else None)
        got = ops.paged_v4_attention(*args)
    assert "paged_v4_attention@triton" in calls
    with REGISTRY.force_backend("reference"):
        want = ops.paged_v4_attention(*args)
    assert _rel(got, want) <= 2e-2


@interpreter
@pytest.mark.parametrize("seed", range(4))
def test_paged_v4_kernels_on_prompt_chunk_rows_interpreted(seed):
    """Rows of prompt chunks: several consecutive tokens of each sequence (rows_seq), with the streams
    holding what their last rows see; both kernels against the references."""
    from dayzero.kernels.v4 import _paged

    rng, g, b, block, ratio, positions = _case(seed)
    h, d = rng.choice((2, 16)), rng.choice((16, 32))
    fp8 = rng.random() < 0.5
    lens = [rng.randint(1, min(p + 1, 9)) for p in positions]
    rows_seq = torch.tensor([s for s, t in enumerate(lens) for _ in range(t)])
    pos = torch.tensor([p - t + 1 + i for p, t in zip(positions, lens) for i in range(t)], dtype=torch.int64)
    n = len(pos)
    keys = _stream(g, positions, d, ratio, block, torch.float32, "cpu", fp8=fp8)
    iq, iw = torch.randn(n, h, d, generator=g), torch.randn(n, h, generator=g)
    k = rng.choice((3, 40))
    want_idx = REGISTRY.get("paged_v4_index_topk").reference.fn(iq, keys, iw, pos, ratio, k, rows_seq)
    assert torch.equal(_paged.paged_v4_index_topk(iq, keys, iw, pos, ratio, k, rows_seq), want_idx)
    window_len = rng.choice((5, 16))
    window = _stream(g, positions, d, 1, block, torch.float32, "cpu", window=window_len + max(lens), fp8=fp8)
    compressed = _stream(g, positions, d, ratio, block, torch.float32, "cpu", fp8=fp8)
    q, sinks = torch.randn(n, h, d, generator=g), torch.randn(h, generator=g)
    for indices in (want_idx, None):  # CSA, HCA
        args = (q, window, sinks, d ** -0.5, window_len, pos, compressed, indices, ratio, rows_seq)
        want = REGISTRY.get("paged_v4_attention").reference.fn(*args)
        assert _rel(_paged.paged_v4_attention(*args, splits=rng.choice((1, 3))), want) <= 1e-5
