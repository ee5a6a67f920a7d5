"""Per-layer CUDA graphs of eager routed-expert calls (kernels/moe/_graphs.py; MXFP4 path A, bf16 and FP8
experts) on the GPU: replays against plain eager calls of the same layer (bitwise where the call fills its
bucket), across buckets, two layers, in-place weight changes and an enclosing graph capture. The bucket
rule is choose.graph_tokens (test_moe_choose.py)."""

import pytest
import torch

from tests.kernels.conftest import cuda
from tests.kernels.moe_inputs import exact, random_layer, random_routing, rel_err
from tests.kernels.test_moe_mxfp4 import ACTIVATIONS


def _op(experts):
    """The kernel entry point of the layer's format."""
    from dayzero.kernels.moe import moe_experts_bf16, moe_experts_fp8, moe_experts_mxfp4

    return {"mxfp4": moe_experts_mxfp4, "bf16": moe_experts_bf16, "fp8": moe_experts_fp8}[experts.format]


def _eager(x, ids, w, experts, act):
    from dayzero import settings

    with settings.override(moe_graph_max_tokens=0):
        return _op(experts)(x, ids, w, experts, act)


def _layer(fmt, E, H, I, gen):
    from tests.kernels.moe_inputs import as_bf16
    from tests.kernels.test_moe_fp8 import _fp8_layer

    if fmt == "fp8":
        return _fp8_layer(E, H, I, gen, "cuda", True)
    layer = random_layer(E, H, I, gen, "cuda", True)
    return as_bf16(layer) if fmt == "bf16" else layer


@cuda
@pytest.mark.parametrize("fmt,act", [("mxfp4", "gpt_oss"), ("mxfp4", "swiglu"), ("bf16", "gpt_oss"),
                                     ("fp8", "swiglu_limit")])
def test_layer_graphs_match_eager_cuda(fmt, act):
    from dayzero.kernels.moe._state import layer_state
    from dayzero.ops.moe import ExpertWeights

    gen = torch.Generator().manual_seed(7)
    E, k, H, I = 32, 4, 1024, 512
    act = ACTIVATIONS[act]
    layers = [_layer(fmt, E, H, I, gen) for _ in range(2)]
    moe_experts_mxfp4 = _op(layers[0])
    # 1, 2, 4, 8 fill their buckets (the same plan as an eager call: bitwise); 3, 5, 6, 7 pad to 4, 8 (the
    # bucket's plan, which may differ from the call's own), and
    # a call after a larger one of its bucket puts expert E back in the rows that one left behind
    for tokens in (1, 2, 8, 3, 5, 7, 6, 4, 3, 1):
        for step in range(3):  # eager, capture, replay; new inputs every call
            for experts in layers:
                x = torch.randn(tokens, H, generator=gen).to("cuda", torch.bfloat16)
                ids, w = random_routing(tokens, E, k, gen, "cuda")
                # a fresh ExpertWeights per call, as the models build them: the graphs live with the tensors
                out = moe_experts_mxfp4(x, ids, w, ExpertWeights(**vars(experts)), act)
                want = _eager(x, ids, w, experts, act)
                assert out.shape == x.shape and out.dtype == x.dtype
                if tokens in (1, 2, 4, 8):
                    assert torch.equal(out, want), (tokens, step)
                else:
                    assert rel_err(out.float(), want.float()) < 1e-2
                assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    graphs = layer_state(layers[0])["graphs"][1]
    assert sorted(key[0].graph_tokens for key, g in graphs.items() if g) == [1, 2, 4, 8]  # one graph per bucket

    # an in-place change of a layer's weights drops its graphs: the next calls see the new weights
    experts = layers[0]
    if experts.w2_scale is not None:
        experts.w2_scale.add_(1) if experts.format == "mxfp4" else experts.w2_scale.mul_(2)
    else:
        experts.w2.mul_(2)
    x = torch.randn(1, H, generator=gen).to("cuda", torch.bfloat16)
    ids, w = random_routing(1, E, k, gen, "cuda")
    for _ in range(3):
        assert torch.equal(moe_experts_mxfp4(x, ids, w, experts, act), _eager(x, ids, w, experts, act))
    assert rel_err(moe_experts_mxfp4(x, ids, w, experts, act), exact(x, ids, w, experts, act)) < 1e-2


@cuda
def test_layer_graphs_inside_a_capture_cuda():
    """Under an enclosing capture the call records its kernels into the caller's graph (no nested graph)."""
    from dayzero.kernels.moe import moe_experts_mxfp4

    gen = torch.Generator().manual_seed(8)
    E, k, H, I = 16, 2, 512, 256
    act = ACTIVATIONS["swiglu"]
    experts = random_layer(E, H, I, gen, "cuda", False)
    x = torch.randn(2, H, generator=gen).to("cuda", torch.bfloat16)
    ids, w = random_routing(2, E, k, gen, "cuda")
    want = _eager(x, ids, w, experts, act)
    for _ in range(2):  # the key's eager call and its capture happen before the enclosing capture
        moe_experts_mxfp4(x, ids, w, experts, act)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_experts_mxfp4(x, ids, w, experts, act)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe_experts_mxfp4(x, ids, w, experts, act)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
