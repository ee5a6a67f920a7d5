"""Path C (moe_experts_bf16, "triton", its "gemm" kernel) against the reference op and the exact float32 layer
(tolerances as in test_moe_mxfp4)."""

import pytest
import torch

from dayzero.ops.moe import Activation, ExpertWeights, _experts_reference
from tests.kernels.conftest import cuda, interpreter
from tests.kernels.moe_inputs import as_bf16, exact, random_layer, random_routing, rel_err

GPT_OSS = Activation("swiglu_clamped", alpha=1.702, limit=7.0)


@interpreter
@pytest.mark.parametrize("tokens,act,bias", [(2, Activation("swiglu"), False), (21, GPT_OSS, True)])
def test_bf16_layer_interpreted(tokens, act, bias):
    from dayzero.kernels.moe import Plan, moe_experts_bf16
    from dayzero.kernels.moe.configs import GemmConfig

    gen = torch.Generator().manual_seed(tokens)
    experts = as_bf16(random_layer(5, 96, 64, gen, "cpu", bias))
    x = torch.randn(tokens, 96, generator=gen).bfloat16()
    ids, w = random_routing(tokens, 5, 2, gen, "cpu")
    c = GemmConfig(16, 32, 64, 4, 2)
    out = moe_experts_bf16(x, ids, w, experts, act, Plan("gemm", (c, c)))
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    assert rel_err(out, _experts_reference(x, ids, w, experts, act)) < 1.5e-2


def test_bf16_guards_name_the_tensor():
    from dayzero.kernels.moe._checks import check_bf16_call, supports_bf16

    gen = torch.Generator().manual_seed(0)
    e = as_bf16(random_layer(4, 64, 32, gen, "cpu", False))
    x = torch.randn(3, 64).bfloat16()
    ids, w = random_routing(3, 4, 2, gen, "cpu")
    for experts, name in [(ExpertWeights("bf16", e.w13.float(), e.w2), "experts.w13"),
                          (ExpertWeights("bf16", e.w13, e.w2[:, :, :16]), "experts.w2"),
                          (ExpertWeights("bf16", e.w13, e.w2.transpose(1, 2).contiguous().transpose(1, 2)), "experts.w2")]:
        with pytest.raises(ValueError, match=name):
            check_bf16_call(x, ids, w, experts, GPT_OSS)
        assert not supports_bf16(x, ids, w, experts, GPT_OSS)
    with pytest.raises(ValueError, match="topk_ids"):
        check_bf16_call(x, ids[:2], w[:2], e, GPT_OSS)


@cuda
@pytest.mark.parametrize("model,tokens", [("gpt-oss-120b", 1), ("gpt-oss-120b", 300), ("deepseek-v4", 33),
                                          ("deepseek-v4", 2048)])
def test_bf16_layer_full_shapes_cuda(model, tokens):
    from dayzero import ops
    from dayzero.ops import REGISTRY
    from tests.kernels.test_moe_mxfp4 import MODELS

    E, k, H, I, act, bias = MODELS[model]
    gen = torch.Generator().manual_seed(tokens)
    experts = as_bf16(random_layer(E, H, I, gen, "cuda", bias))
    x = torch.randn(tokens, H, generator=gen).to("cuda", torch.bfloat16)
    ids, w = random_routing(tokens, E, k, gen, "cuda")
    assert REGISTRY.get("moe_experts_bf16").select("cuda", (x, ids, w, experts, act)).backend == "triton"
    out = ops.moe_experts_bf16(x, ids, w, experts, act)
    with REGISTRY.force_backend("reference"):
        ref = ops.moe_experts_bf16(x, ids, w, experts, act)
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    assert rel_err(out, ref) < 1.5e-2
