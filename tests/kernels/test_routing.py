"""The routing kernels (dayzero/kernels/routing/) against the reference routing ops, on CPU under
Triton's interpreter (small shapes) and on CUDA (model shapes, CUDA-graph capture, registry dispatch).

Reference and kernel compute the scores with different exp/sqrt, so they can order two experts
differently only when the experts' choice values lie within float32 rounding of each other. The CPU
tests use plain random logits (a near-tie among a few dozen values is vanishingly rare); the CUDA
tests at full size (up to 8192 x 384 values) build logits whose choice values (score + bias) are a
random permutation of a Sidon set, so every two values and every two pair sums (DeepSeek's group
scores) differ by far more than rounding."""

import math

import pytest
import torch

from dayzero import ops
from dayzero.ops.registry import REGISTRY
from tests.kernels.conftest import cuda, interpreter

RTOL, ATOL = 1e-5, 1e-6  # weights: float32 with the device's fast exp (a few ulp)


@pytest.fixture(autouse=True)
def _private_rng():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield


def reference(name, *args):
    return REGISTRY.get(name).reference.fn(*args)


def kernel(name, *args):
    from dayzero.kernels.routing import _topk

    return getattr(_topk, name)(*args)


def assert_same_routing(name, *args):
    ids, weights = kernel(name, *args)
    want_ids, want_weights = reference(name, *args)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == want_ids.shape and weights.shape == want_weights.shape
    assert torch.equal(ids, want_ids), (ids != want_ids).nonzero()[:5]
    torch.testing.assert_close(weights, want_weights, rtol=RTOL, atol=ATOL)


# -- inputs without near-ties at any size ----------------------------------------------------------

def sidon(n: int) -> torch.Tensor:
    """n integers whose pairwise sums are all distinct (Erdos-Turan: 2pj + (j^2 mod p), p prime >= n)."""
    p = n
    while any(p % d == 0 for d in range(2, math.isqrt(p) + 1)):
        p += 1
    j = torch.arange(n, dtype=torch.float64)
    return 2 * p * j + (j * j) % p


def separated(tokens, experts, lo, hi, device) -> torch.Tensor:
    """float64 [tokens, experts]: each row a random permutation of a Sidon set scaled into [lo, hi]."""
    a = sidon(experts).to(device)
    a = lo + (hi - lo) * a / a.max()
    perm = torch.rand(tokens, experts, device=device).argsort(dim=1)
    return a[perm]


def sigmoid_logits(choice, bias):
    s = choice - (0 if bias is None else bias.double())
    return (s.log() - (-s).log1p()).float()


def sqrtsoftplus_logits(choice, bias):
    s = choice - (0 if bias is None else bias.double())
    return (s * s).expm1().log().float()


# -- CPU, interpreter ------------------------------------------------------------------------------

@interpreter
@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("experts, top_k", [(8, 2), (12, 4), (32, 4), (40, 7)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_interpreted(tokens, experts, top_k, renormalize):
    assert_same_routing("route_softmax_topk", torch.randn(tokens, experts) * 3, top_k, renormalize)


@interpreter
def test_softmax_bf16_and_strided_logits_interpreted():
    grid = torch.rand(9, 16).argsort(dim=1).float() / 16 - 0.5  # distinct bf16 values per row
    assert_same_routing("route_softmax_topk", grid.bfloat16(), 3)
    wide = torch.randn(9, 40)
    assert_same_routing("route_softmax_topk", wide[:, 3:27], 5)  # row stride 40
    assert_same_routing("route_softmax_topk", torch.randn(24, 9).t(), 4)  # expert stride 9


SIGMOID_CASES = [  # experts, top_k, n_group, topk_group, normalize, scaling, bias
    (16, 4, 4, 2, True, 2.5, True),    # DeepSeek-V3, scaled down
    (12, 3, 1, 1, True, 2.827, True),  # Kimi-K2: one group
    (16, 2, 8, 3, False, 1.0, True),
    (12, 3, 3, 2, True, 1.0, False),   # no bias: a group scores its best expert
    (24, 5, 4, 2, True, 1.5, True),    # 6 experts per group (not a power of two)
    (40, 6, 5, 5, True, 1.0, True),    # every group kept: no group pass
    (48, 8, 8, 4, False, 2.0, False),
    (20, 4, 1, 1, False, 1.0, False),
]


@interpreter
@pytest.mark.parametrize("tokens", [1, 9, 33])
@pytest.mark.parametrize("experts, top_k, n_group, topk_group, normalize, scaling, bias", SIGMOID_CASES)
def test_sigmoid_grouped_interpreted(tokens, experts, top_k, n_group, topk_group, normalize, scaling, bias):
    logits = torch.randn(tokens, experts) * 2
    correction = torch.rand(experts) * 0.3 if bias else None
    assert_same_routing("route_sigmoid_grouped", logits, correction, top_k, n_group, topk_group, normalize, scaling)


@interpreter
def test_sigmoid_grouped_bf16_bias_and_separated_inputs_interpreted():
    bias = torch.rand(32) * 0.1
    logits = sigmoid_logits(separated(21, 32, 0.15, 0.9, "cpu"), bias)
    assert_same_routing("route_sigmoid_grouped", logits, bias, 6, 8, 3, True, 2.5)
    assert_same_routing("route_sigmoid_grouped", logits.bfloat16(), bias.bfloat16(), 4, 4, 2, True, 1.0)


@interpreter
@pytest.mark.parametrize("tokens", [1, 6, 33])
@pytest.mark.parametrize("experts, top_k, bias, scaling", [(8, 3, True, 1.5), (16, 6, False, 1.0), (40, 5, True, 2.5)])
def test_sqrtsoftplus_interpreted(tokens, experts, top_k, bias, scaling):
    logits = torch.randn(tokens, experts) * 3
    correction = torch.randn(experts) * 0.5 if bias else None
    assert_same_routing("route_sqrtsoftplus", logits, correction, top_k, scaling)


@interpreter
def test_sqrtsoftplus_keeps_relative_precision_for_very_negative_logits_interpreted():
    """sqrt(softplus(-40)) ~ 2e-9: a naive log(1 + exp(x)) rounds it to 0 and the weights to nan or 0."""
    logits = -30 - 15 * torch.rand(7, 16)
    assert_same_routing("route_sqrtsoftplus", logits, None, 4, 1.0)
    assert_same_routing("route_sqrtsoftplus", torch.randn(7, 16) * 20, torch.rand(16), 4, 1.0)  # both tails


@interpreter
@pytest.mark.parametrize("score_function", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32])
def test_hash_interpreted(score_function, table_dtype):
    vocab, experts, top_k, tokens = 50, 24, 3, 17
    table = torch.rand(vocab, experts).argsort(dim=1)[:, :top_k].to(table_dtype)  # strided view of the sort
    token_ids = torch.randint(0, vocab, (tokens,))
    logits = torch.randn(tokens, experts) * 2
    assert_same_routing("route_hash", logits, token_ids, table, 1.7, score_function)
    assert_same_routing("route_hash", logits, token_ids.int(), table.contiguous(), 1.0, score_function)


@interpreter
def test_hash_drops_out_of_range_tokens_and_experts_interpreted():
    """The reference raises here; the kernel cannot check without a host sync: id -1, weight 0."""
    table = torch.tensor([[0, 1], [2, 9], [3, 4]])  # expert 9 is outside E = 6
    logits = torch.randn(4, 6)
    ids, weights = kernel("route_hash", logits, torch.tensor([0, 1, 3, -1]), table, 2.0)
    assert ids.tolist() == [[0, 1], [2, -1], [-1, -1], [-1, -1]]
    assert weights[1, 0].item() == pytest.approx(2.0, rel=1e-6)  # alone in its row's sum
    assert torch.equal(weights[1:, 1], torch.zeros(3)) and torch.equal(weights[2:], torch.zeros(2, 2))
    want_ids, want_weights = reference("route_hash", logits[:1], torch.tensor([0]), table, 2.0)
    assert torch.equal(ids[:1], want_ids)
    torch.testing.assert_close(weights[:1], want_weights, rtol=RTOL, atol=ATOL)


@interpreter
def test_ties_pick_the_lowest_index_and_nan_ranks_first_interpreted():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.5], [2.0, float("nan"), 0.0, 2.0, float("nan"), -1.0]])
    ids, _ = kernel("route_softmax_topk", logits, 5)
    assert ids.tolist() == [[1, 2, 4, 3, 5], [1, 4, 0, 3, 2]]
    scores = torch.full((3, 8), 0.25)
    ids, weights = kernel("route_sigmoid_grouped", scores, None, 3, 4, 2, True, 1.0)
    assert ids.tolist() == [[0, 1, 2]] * 3  # groups 0 and 1 tie with the rest: the lowest two stay
    torch.testing.assert_close(weights, torch.full((3, 3), 1 / 3))


@interpreter
def test_no_tokens_interpreted():
    ids, weights = kernel("route_sigmoid_grouped", torch.randn(0, 16), torch.rand(16), 4, 4, 2, True, 1.0)
    assert ids.shape == weights.shape == (0, 4) and ids.dtype == torch.int64


def test_guards_name_the_argument():
    from dayzero.kernels.routing import _checks as routing

    x = torch.randn(4, 16)
    cases = [
        (routing.check_softmax_call, (torch.randn(16), 2), r"logits must be"),
        (routing.check_softmax_call, (x.int(), 2), r"logits must be"),
        (routing.check_softmax_call, (torch.randn(2, 600), 2), r"600 experts"),
        (routing.check_softmax_call, (x, 0), r"top_k=0"),
        (routing.check_softmax_call, (torch.randn(2, 64), 33), r"top_k=33"),
        (routing.check_sigmoid_grouped_call, (x, torch.zeros(15), 2), r"correction_bias must be"),
        (routing.check_sigmoid_grouped_call, (x, None, 2, 5, 1), r"n_group=5"),
        (routing.check_sigmoid_grouped_call, (x, None, 2, 4, 5), r"topk_group=5"),
        (routing.check_sigmoid_grouped_call, (x, None, 9, 4, 2), r"top_k=9"),
        (routing.check_sigmoid_grouped_call, (x, torch.zeros(16), 1, 16, 2), r"two best experts"),
        (routing.check_sigmoid_grouped_call, (x, None, 2, 1, 1, True, torch.tensor(2.5)), r"scaling_factor"),
        (routing.check_sqrtsoftplus_call, (x, torch.zeros(16, dtype=torch.int32), 2), r"correction_bias must be"),
        (routing.check_sqrtsoftplus_call, (x, None, 17), r"top_k=17"),
        (routing.check_hash_call, (x, torch.zeros(3, dtype=torch.int64), torch.zeros(8, 2, dtype=torch.int64)),
         r"token_ids must be \[4\]"),
        (routing.check_hash_call, (x, torch.zeros(4, dtype=torch.int64), torch.zeros(8, 2)), r"tid2eid must be an int"),
        (routing.check_hash_call, (x, torch.zeros(4), torch.zeros(8, 2, dtype=torch.int64)), r"token_ids must be an int"),
        (routing.check_hash_call, (x, torch.zeros(4, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)),
         r"tid2eid must be \[vocab"),
        (routing.check_hash_call, (x, torch.zeros(4, dtype=torch.int64), torch.zeros(8, 2, dtype=torch.int64), 1.0,
                                   "relu"), r"score_function"),
    ]
    for check, args, match in cases:
        with pytest.raises(ValueError, match=match):
            check(*args)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="correction_bias is on"):
            routing.check_sqrtsoftplus_call(x.cuda(), torch.zeros(16), 2)
    assert not routing.SUPPORTS["route_sqrtsoftplus"](x, None, 2)  # CPU tensors: the reference runs


def test_registered_beside_every_routing_op():
    for name in ("route_softmax_topk", "route_sigmoid_grouped", "route_sqrtsoftplus", "route_hash"):
        assert REGISTRY.backends_for(name) == ["reference", "triton"]
        assert REGISTRY.selected_backend(name, "cpu") == "reference"


# -- CUDA, model shapes ----------------------------------------------------------------------------

def v3_args(tokens, experts=256, top_k=8, n_group=8, topk_group=4, scaling=2.5):
    bias = torch.rand(experts, device="cuda") * 0.1
    logits = sigmoid_logits(separated(tokens, experts, 0.15, 0.9, "cuda"), bias)
    return logits, bias, top_k, n_group, topk_group, True, scaling


def v4_args(tokens, experts=256, top_k=6):
    bias = torch.rand(experts, device="cuda") * 0.1
    return sqrtsoftplus_logits(separated(tokens, experts, 0.3, 2.0, "cuda"), bias), bias, top_k, 1.5


def hash_args(tokens, experts=256, top_k=6, vocab=4096):
    table = torch.rand(vocab, experts, device="cuda").argsort(dim=1)[:, :top_k].contiguous()
    return torch.randn(tokens, experts, device="cuda") * 2, torch.randint(0, vocab, (tokens,), device="cuda"), table, 1.5


def softmax_args(tokens, experts, top_k, renormalize=True):
    logits = separated(tokens, experts, -4, 4, "cuda").float()
    return logits.bfloat16() if experts <= 128 else logits, top_k, renormalize


MODEL_CASES = {  # name -> (op, args(tokens))
    "deepseek-v3 256/8, 8 groups top-4": ("route_sigmoid_grouped", v3_args),
    "deepseek-v3 no bias": ("route_sigmoid_grouped", lambda t: (v3_args(t)[0], None, 8, 8, 4, False, 1.0)),
    "kimi-k2 384/8, one group": ("route_sigmoid_grouped", lambda t: v3_args(t, 384, 8, 1, 1, 2.827)),
    "deepseek-v4 256/6 sqrtsoftplus": ("route_sqrtsoftplus", v4_args),
    "deepseek-v4 hash 256/6": ("route_hash", hash_args),
    "gpt-oss 128/4 softmax": ("route_softmax_topk", lambda t: softmax_args(t, 128, 4)),
    "32/4 softmax, all-E weights": ("route_softmax_topk", lambda t: softmax_args(t, 32, 4, False)),
    "32/4 sigmoid": ("route_sigmoid_grouped", lambda t: v3_args(t, 32, 4, 1, 1, 1.0)),
}


@cuda
@pytest.mark.parametrize("tokens", [1, 7, 8192])
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_shapes_cuda(case, tokens):
    op, make = MODEL_CASES[case]
    assert_same_routing(op, *make(tokens))


@cuda
def test_models_dispatch_to_the_kernels_on_cuda():
    calls_for = {op: make(5) for op, make in MODEL_CASES.values()}
    with REGISTRY.record_calls(by_backend=True) as calls:
        for op, args in calls_for.items():
            getattr(ops, op)(*args)
    assert calls == {f"{op}@triton": 1 for op in calls_for}
    with REGISTRY.record_calls(by_backend=True) as calls:  # 600 experts: declined, the reference runs
        ops.route_sqrtsoftplus(torch.randn(3, 600, device="cuda"), None, 4, 1.0)
    assert calls == {"route_sqrtsoftplus@reference": 1}


@cuda
def test_cuda_graph_capture():
    """All four ops, through the registry, in one CUDA graph: replays route new inputs correctly."""
    tokens = 64
    v3, v4, hashed, soft = v3_args(tokens), v4_args(tokens), hash_args(tokens), softmax_args(tokens, 128, 4)
    static = [("route_sigmoid_grouped", v3), ("route_sqrtsoftplus", v4), ("route_hash", hashed),
              ("route_softmax_topk", soft)]
    for op, args in static:  # compile outside the capture
        getattr(ops, op)(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [getattr(ops, op)(*args) for op, args in static]
    fresh = [v3_args(tokens), v4_args(tokens), hash_args(tokens), softmax_args(tokens, 128, 4)]
    for (_, args), new in zip(static, fresh):
        for dst, src in zip(args, new):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    for (op, args), (ids, weights) in zip(static, outs):
        want_ids, want_weights = reference(op, *args)
        assert torch.equal(ids, want_ids), op
        torch.testing.assert_close(weights, want_weights, rtol=RTOL, atol=ATOL)
