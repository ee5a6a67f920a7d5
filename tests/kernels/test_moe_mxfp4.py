"""moe_experts_mxfp4 "triton" through its "gemm" kernel (_gemm.py, the transposed tensor-core GEMM) against
the reference op and the exact float32 layer; the upcast's exactness; the argument checks.

Tolerance: bf16 activations and a bf16 intermediate give ~4e-3 relative error (Frobenius) against the
exact layer; the reference itself, computed in bf16 throughout, lands at ~5e-3. Kernels must stay
within 1e-2 of the exact layer and 1.5e-2 of the reference. (Under the CPU interpreter, casts to bf16
truncate instead of rounding, which roughly doubles the error; the same bounds hold.)
"""

import pytest
import torch

from dayzero.ops.moe import Activation, ExpertWeights, _experts_reference
from tests.budget import ci_cases
from tests.kernels.conftest import cuda, interpreter
from tests.kernels.moe_inputs import exact, random_layer, random_mxfp4, random_routing, rel_err

GPT_OSS = Activation("swiglu_clamped", alpha=1.702, limit=7.0)
ACTIVATIONS = {"swiglu": Activation("swiglu"), "swiglu_limit": Activation("swiglu", limit=1.5), "gpt_oss": GPT_OSS}


def _run(x, ids, w, experts, act, plan=None):
    from dayzero.kernels.moe import moe_experts_mxfp4

    return moe_experts_mxfp4(x, ids, w, experts, act, plan)


def _small_plan(block_m, block_n, block_k):
    from dayzero.kernels.moe import Plan
    from dayzero.kernels.moe.configs import GemmConfig

    c = GemmConfig(block_m, block_n, block_k, num_warps=4, num_stages=2)
    return Plan("gemm", (c, c))


MXFP4_SHAPES = [(1, 2, True, (16, 32, 64)), (9, 3, False, (16, 32, 128)), (37, 2, True, (32, 64, 64))]
# CI: each shape once, each with another activation; DAYZERO_FULL_TESTS=1: every activation x shape
_MXFP4_CI = [("swiglu", 0), ("swiglu_limit", 1), ("gpt_oss", 2)]
MXFP4_CASES = ci_cases([(a, *MXFP4_SHAPES[i]) for a, i in _MXFP4_CI + [
    (a, i) for a in ACTIVATIONS for i in range(3) if (a, i) not in _MXFP4_CI]], keep=len(_MXFP4_CI))


def _tiles_id(value):
    """A case's tiles in its test id as 16x32x64 (the rest as pytest names them)."""
    return "x".join(map(str, value)) if isinstance(value, tuple) else None


@interpreter
@pytest.mark.parametrize("act,tokens,top_k,bias,tiles", MXFP4_CASES, ids=_tiles_id)
def test_mxfp4_layer_interpreted(act, tokens, top_k, bias, tiles):
    gen = torch.Generator().manual_seed(tokens * 7 + top_k)
    E, H, I = 6, 96, 64  # H = 96 is not a multiple of BLOCK_K 64/128: the masked K tail runs too
    experts = random_layer(E, H, I, gen, "cpu", bias)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    ids, w = random_routing(tokens, E, top_k, gen, "cpu")
    out = _run(x, ids, w, experts, ACTIVATIONS[act], _small_plan(*tiles))
    ref = _experts_reference(x, ids, w, experts, ACTIVATIONS[act])
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert rel_err(out, exact(x, ids, w, experts, ACTIVATIONS[act])) < 1e-2
    assert rel_err(out, ref) < 1.5e-2


def _readback(experts_blocks, experts_scales, device, configs):
    """Each weight row read back through the GEMM: x = identity rows, one expert, no activation."""
    from dayzero.kernels.moe._dispatch import dispatch
    from dayzero.kernels.moe._gemm import grouped_gemm

    E, N, kb, _ = experts_blocks.shape
    K = kb * 32
    x = torch.eye(K, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(K, 1, dtype=torch.int64, device=device)
    d = dispatch(ids, E, configs.block_m)
    words = experts_blocks.view(torch.int32).view(E, N, K // 8)
    out = grouped_gemm(x, words, experts_scales, None, d, out_features=N, gather=True, config=configs)
    return out[d.pair_row.long()]  # [K, N]: row k holds column k of the weights


def _check_readback(device, scale_range, block_k):
    from dayzero.formats import mxfp4
    from dayzero.kernels.moe.configs import GemmConfig

    gen = torch.Generator().manual_seed(scale_range[0])
    blocks, scales = random_mxfp4((1, 64), 128, gen, device, scale_range)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8, device=device) * 17  # every code, both nibbles
    got = _readback(blocks, scales, device, GemmConfig(16, 32, block_k, 4, 2)).T
    want = mxfp4.dequantize(blocks[0], scales[0], torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@interpreter
def test_mxfp4_upcast_is_exact_interpreted():
    _check_readback("cpu", (110, 140), 128)


@cuda
@pytest.mark.parametrize("scale_range", [(0, 128), (100, 140), (1, 252)])
@pytest.mark.parametrize("block_k", [64, 128])
def test_mxfp4_upcast_is_exact_cuda(scale_range, block_k):
    """Every code and scale byte, including bf16-subnormal results (small scales) and the two-multiply
    branch for scale bytes above 128."""
    _check_readback("cuda", scale_range, block_k)


@cuda
def test_mxfp4_nan_scale_gives_nan_cuda():
    """Scale byte 0xFF (E8M0 NaN) makes its block NaN; in a product every output of that weight row
    is then NaN (NaN * 0 is NaN), and nothing else."""
    from dayzero.kernels.moe.configs import GemmConfig

    gen = torch.Generator().manual_seed(1)
    blocks, scales = random_mxfp4((1, 64), 128, gen, "cuda")
    scales[0, 3, 1] = 255
    got = _readback(blocks, scales, "cuda", GemmConfig(16, 32, 128, 4, 2)).T  # [N, K]
    assert got[3].isnan().all()
    assert torch.cat([got[:3], got[4:]]).isfinite().all()


def _guard_layer(device):
    gen = torch.Generator().manual_seed(3)
    experts = random_layer(4, 64, 32, gen, device, True)
    x = torch.randn(3, 64, generator=gen).to(device, torch.bfloat16)
    ids, w = random_routing(3, 4, 2, gen, device)
    return x, ids, w, experts


@pytest.mark.parametrize("change,name", [
    (lambda x, e: (x.float(), e), "x"),
    (lambda x, e: (x, ExpertWeights("mxfp4", e.w13[:, :, :1], e.w2, e.w13_scale, e.w2_scale)), "w13"),
    (lambda x, e: (x, ExpertWeights("mxfp4", e.w13, e.w2, e.w13_scale, e.w2_scale[:, :-1])), "experts.w2_scale"),
    (lambda x, e: (x, ExpertWeights("mxfp4", e.w13, torch.cat([e.w2, e.w2], -1)[..., :16], e.w13_scale,
                                    e.w2_scale)), "experts.w2 .* must be contiguous"),
    (lambda x, e: (x, ExpertWeights("mxfp4", e.w13, e.w2, e.w13_scale.float(), e.w2_scale)), "experts.w13_scale"),
    (lambda x, e: (x, ExpertWeights("mxfp4", e.w13, e.w2, e.w13_scale, e.w2_scale, e.b13[:, :3], e.b2)), "experts.b13"),
    (lambda x, e: (x, ExpertWeights("bf16", e.w13, e.w2)), "format"),
])
def test_mxfp4_guards_name_the_tensor(change, name):
    from dayzero.kernels.moe._checks import check_mxfp4_call, supports_mxfp4

    x, ids, w, experts = _guard_layer("cpu")
    x, experts = change(x, experts)
    with pytest.raises(ValueError, match=name):
        check_mxfp4_call(x, ids, w, experts, GPT_OSS)
    assert not supports_mxfp4(x, ids, w, experts, GPT_OSS)


def test_mxfp4_guards_alignment_and_activation():
    from dayzero.kernels.moe._checks import check_mxfp4_call

    x, ids, w, experts = _guard_layer("cpu")
    buf = torch.empty(experts.w13.numel() + 1, dtype=torch.uint8)
    shifted = buf[1:].view(experts.w13.shape)
    shifted.copy_(experts.w13)
    with pytest.raises(ValueError, match="experts.w13 must start on a 16-byte boundary"):
        check_mxfp4_call(x, ids, w, ExpertWeights("mxfp4", shifted, experts.w2, experts.w13_scale, experts.w2_scale), GPT_OSS)
    with pytest.raises(ValueError, match="alpha and limit"):
        check_mxfp4_call(x, ids, w, experts, Activation("swiglu_clamped"))
    with pytest.raises(ValueError, match="topk_weights"):
        check_mxfp4_call(x, ids, w[:, :1], experts, GPT_OSS)


def test_registry_keeps_the_reference_off_cuda():
    from dayzero.ops import REGISTRY

    assert "triton" in REGISTRY.backends_for("moe_experts_mxfp4")
    x, ids, w, experts = _guard_layer("cpu")
    assert REGISTRY.get("moe_experts_mxfp4").select("cpu", (x, ids, w, experts, GPT_OSS)).backend == "reference"


# -- CUDA, full model shapes --------------------------------------------------------------------

MODELS = {  # experts, top_k, hidden, intermediate, activation, biases
    "gpt-oss-120b": (128, 4, 2880, 2880, GPT_OSS, True),
    "deepseek-v4": (256, 6, 4096, 2048, Activation("swiglu", limit=10.0), False),
}


@pytest.fixture(scope="module")
def model_layers():
    cache = {}

    def get(name):
        if name not in cache:
            E, k, H, I, act, bias = MODELS[name]
            cache[name] = random_layer(E, H, I, torch.Generator().manual_seed(len(name)), "cuda", bias)
        return cache[name]

    return get


@cuda
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("tokens", [1, 7, 32, 300, 2048])
def test_mxfp4_layer_full_shapes_cuda(model, tokens, model_layers):
    from dayzero import ops
    from dayzero.ops import REGISTRY

    E, k, H, I, act, _ = MODELS[model]
    experts = model_layers(model)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen).to("cuda", torch.bfloat16)
    ids, w = random_routing(tokens, E, k, gen, "cuda")
    assert REGISTRY.get("moe_experts_mxfp4").select("cuda", (x, ids, w, experts, act)).backend == "triton"
    out = ops.moe_experts_mxfp4(x, ids, w, experts, act)
    with REGISTRY.force_backend("reference"):
        ref = ops.moe_experts_mxfp4(x, ids, w, experts, act)
    assert out.isfinite().all()
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    assert rel_err(out, ref) < 1.5e-2
