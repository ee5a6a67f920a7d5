"""The prefill grouped GEMM (the "mma" kernel, _mma.py) through the routed-expert layer: MXFP4 and bf16
weights, against the reference op and the exact float32 layer. Tolerances as test_moe_mxfp4.py (bf16
activations and intermediate)."""

import pytest

from tests.budget import ci_cases
import torch

from dayzero.ops.moe import Activation, _experts_reference
from tests.kernels.conftest import cuda, interpreter
from tests.kernels.moe_inputs import as_bf16, exact, random_layer, random_routing, rel_err
from tests.kernels.sm90_compile import register, report
from tests.kernels.test_moe_mxfp4 import _tiles_id

GPT_OSS = Activation("swiglu_clamped", alpha=1.702, limit=7.0)
ACTIVATIONS = {"swiglu": Activation("swiglu"), "swiglu_limit": Activation("swiglu", limit=1.5), "gpt_oss": GPT_OSS}


def _layer(x, ids, w, experts, act, configs):
    from dayzero.kernels import moe

    op = moe.moe_experts_mxfp4 if experts.format == "mxfp4" else moe.moe_experts_bf16
    return op(x, ids, w, experts, act, moe.Plan("mma", configs))


def _check(x, ids, w, experts, act, configs):
    out = _layer(x, ids, w, experts, act, configs)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape and torch.isfinite(out).all()
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    assert rel_err(out, _experts_reference(x, ids, w, experts, act)) < 1.5e-2


MMA_SHAPES = [
    (40, 2, True, (16, 32, 64, 2)),     # H = 96: masked K tail in gate/up, N tail (96 of 2 x 64) in down
    (23, 3, False, (32, 64, 32, 4)),    # blocks past the last used one; GROUP_M 4 over an uneven count
]
# CI: each format with every activation and both shapes; DAYZERO_FULL_TESTS=1: every format x activation x shape
_MMA_CI = [("mxfp4", "gpt_oss", 0), ("mxfp4", "swiglu", 1), ("mxfp4", "swiglu_limit", 1),
           ("bf16", "swiglu", 0), ("bf16", "swiglu_limit", 1), ("bf16", "gpt_oss", 1)]
MMA_CASES = ci_cases([(f, a, *MMA_SHAPES[i]) for f, a, i in _MMA_CI + [
    (f, a, i) for f in ("mxfp4", "bf16") for a in ACTIVATIONS for i in range(2) if (f, a, i) not in _MMA_CI]],
    keep=len(_MMA_CI))


@interpreter
@pytest.mark.parametrize("fmt,act,tokens,top_k,bias,tiles", MMA_CASES, ids=_tiles_id)
def test_mma_layer_interpreted(fmt, act, tokens, top_k, bias, tiles):
    from dayzero.kernels.moe.configs import MmaConfig

    gen = torch.Generator().manual_seed(tokens * 5 + top_k)
    E, H, I = 5, 96, 64
    experts = random_layer(E, H, I, gen, "cpu", bias)
    if fmt == "bf16":
        experts = as_bf16(experts)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    ids, w = random_routing(tokens, E, top_k, gen, "cpu")
    bm, bn, bk, group = tiles
    c = MmaConfig(bm, bn, bk, num_warps=4, num_stages=2, group_m=group)
    _check(x, ids, w, experts, ACTIVATIONS[act], (c, c))


@interpreter
def test_mma_rejects_mixed_configs_interpreted():
    from dayzero.kernels.moe.configs import GemmConfig, MmaConfig

    gen = torch.Generator().manual_seed(3)
    experts = random_layer(4, 64, 64, gen, "cpu", False)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    ids, w = random_routing(5, 4, 2, gen, "cpu")
    with pytest.raises(ValueError, match="takes a \\(MmaConfig, MmaConfig\\) config"):
        _layer(x, ids, w, experts, GPT_OSS, (MmaConfig(16, 32, 64, 4, 2), GemmConfig(16, 32, 64, 4, 2)))
    with pytest.raises(ValueError, match="both GEMMs"):
        _layer(x, ids, w, experts, GPT_OSS, (MmaConfig(16, 32, 64, 4, 2), MmaConfig(32, 32, 64, 4, 2)))


MODELS = {  # experts, top_k, hidden, intermediate, activation, biases
    "gpt-oss-120b": (128, 4, 2880, 2880, GPT_OSS, True),
    "deepseek-v4": (256, 6, 4096, 2048, Activation("swiglu", limit=10.0), False),
}


@cuda
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("tokens,variant", [(300, "mxfp4"), (2048, "mxfp4"), (8192, "mxfp4"), (2048, "bf16"),
                                            (8192, "bf16")])
def test_mma_layer_full_shapes_cuda(model, tokens, variant):
    from dayzero.kernels.moe.choose import Shapes, mma_configs

    E, k, H, I, act, bias = MODELS[model]
    gen = torch.Generator().manual_seed(tokens + len(model))
    experts = random_layer(E, H, I, gen, "cuda", bias)
    if variant == "bf16":
        experts = as_bf16(experts)
    x = torch.randn(tokens, H, generator=gen).bfloat16().cuda()
    ids, w = random_routing(tokens, E, k, gen, "cuda")
    # 300 tokens: few rows per expert (the rule picks another kernel there): tiles mostly padding
    out = _layer(x, ids, w, experts, act, mma_configs(Shapes(variant, tokens, k, E, H, I)))
    assert torch.isfinite(out).all()
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2


@pytest.mark.parametrize("args", register("sass_moe_mma", ci_cases([
    ["--k", "2880", "--mxfp4", "--gated", "--tile", "128x64x64x4x4"], ["--k", "2048", "--tile", "128x128x64x8x4"]])))
def test_prefill_kernel_compiles_to_wgmma_for_sm90(args):
    """Compiled for sm_90 here (Triton's bundled ptxas, no GPU): the main loop issues wgmma (HGMMA)
    and nothing spills, for the MXFP4 gate/up and the bf16 down GEMM tiles the rule picks."""
    code, out, err, _ = report("sass_moe_mma", args)
    assert code == 0, err[-2000:]
    assert "stack (spills) 0 B" in out and "HGMMA" in out, out
