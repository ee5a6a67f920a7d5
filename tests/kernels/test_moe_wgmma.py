"""The Gluon prefill kernel ("wgmma", _wgmma.py): its column permutation and activation gather on CPU (the gather
under the interpreter), its sm_90 compilation on CPU (the upcast lands in the wgmma operand layout
without data movement, nothing spills), and on CUDA the whole layer at both model shapes against the
exact float32 layer and the reference op."""

import pytest

from tests.budget import ci_cases
import torch

from dayzero.ops.moe import Activation, ExpertWeights, _experts_reference
from tests.kernels.conftest import cuda, interpreter
from tests.kernels.moe_inputs import exact, random_layer, random_mxfp4, random_routing, rel_err
from tests.kernels.sm90_compile import register, report

GPT_OSS = Activation("swiglu_clamped", alpha=1.702, limit=7.0)


def _store_column(n: torch.Tensor) -> torch.Tensor:
    """The kernel's PERMUTE_OUT formula (logical column of physical column n), written out again."""
    nl = n % 64
    return (n - nl) + (nl >> 2) % 2 + 2 * ((nl >> 4) % 2) + 4 * (nl >> 5) + 8 * (nl % 2) + 16 * ((nl >> 1) % 2) \
        + 32 * ((nl >> 3) % 2)


def test_physical_columns_is_a_permutation_inverted_by_the_store():
    from dayzero.kernels.moe._wgmma import physical_columns

    phys = physical_columns()
    assert sorted(phys.tolist()) == list(range(64))
    assert torch.equal(_store_column(phys), torch.arange(64))  # h stored at the column its value is read from
    # the 32-block of a logical column is bit 2 of it, its word bits 1 and 5: a thread (lane % 4 = bits 1, 2)
    # reads one E8M0 byte per row and two consecutive words
    kl = torch.arange(64)
    assert torch.equal(phys // 32, (kl >> 2) & 1)
    # the epilogue's reorder of h (the kernel's reshape and permute of the index bits, written out again):
    # position p of the reordered outputs holds the output stored at physical column p
    order = torch.arange(64).reshape([2] * 6).permute(2, 4, 5, 0, 1, 3).reshape(64)
    assert torch.equal(order[_store_column(kl)], kl)


@interpreter
@pytest.mark.parametrize("K,block_m,gather", [(96, 16, True), (64, 32, False), (160, 16, True)])
def test_gather_permute_interpreted(K, block_m, gather):
    from dayzero.kernels.moe._dispatch import dispatch
    from dayzero.kernels.moe._wgmma import gather_permute, physical_columns

    gen = torch.Generator().manual_seed(K + block_m)
    T, E, k = 13, 5, 2
    ids, _ = random_routing(T, E, k, gen, "cpu")
    d = dispatch(ids, E, block_m)
    x = torch.randn(T if gather else d.max_rows, K, generator=gen).bfloat16()
    out = gather_permute(x, d, gather=gather)
    kp = (K + 63) // 64 * 64
    assert out.shape == (d.max_rows, kp)
    src = torch.cat([x.float(), torch.zeros(x.shape[0], kp - K)], 1)
    cols = torch.cat([b * 64 + physical_columns() for b in range(kp // 64)])
    valid = d.row_pair < d.pair_row.shape[0]  # padding rows are left unwritten
    rows = (d.row_pair[valid] // k) if gather else torch.nonzero(valid).flatten()
    assert torch.equal(out[valid].float(), src[rows][:, cols])  # zeros past K (they meet zero weights)


def test_wgmma_config_checks():
    from dayzero.kernels.moe.configs import WgmmaConfig

    for bad in (dict(block_t=96), dict(block_t=512), dict(block_t=128, num_stages=1), dict(block_t=128, tail_blocks=2),
                dict(block_t=64, tail_blocks=1), dict(block_t=256, tail_blocks=1, tail_rows=48),
                dict(block_t=64, tail_blocks=2, tail_rows=32)):
        with pytest.raises(ValueError, match="WgmmaConfig"):
            WgmmaConfig(**bad)


@pytest.mark.parametrize("args", register("sass_moe_wgmma", ci_cases([
    ["--k", "2880", "--gated", "--bt", "128"], ["--k", "2048", "--bt", "128"],
    ["--k", "4096", "--gated", "--bt", "64", "--low"], ["--k", "2880", "--gated", "--bt", "128", "--pipeline"],
    ["--k", "2048", "--bt", "128", "--low", "--pipeline"]], keep=2)))
def test_wgmma_kernel_compiles_for_sm90(args):
    """Compiled for sm_90 on this machine (no GPU): the upcast's layout conversion is trivial (the
    kernel asserts it at compile time), the main loop issues HGMMA with its A operand from registers
    and reads no shared memory by hand, nothing spills."""
    code, out, err, _ = report("sass_moe_wgmma", args)
    assert code == 0, err[-3000:]
    assert "stack (spills) 0 B" in out and "HGMMA" in out, out
    assert "LDS" not in out.split("main loop", 1)[1], out
    if "--pipeline" in args:  # one wgmma in flight: one WARPGROUP.ARRIVE and one DEPBAR per K tile, not per HGMMA
        loop = out.split("main loop", 1)[1]
        assert "WARPGROUP 4," in loop and "HGMMA 8," in loop, out


MODES = {"reg": {}, "pipe": dict(pipeline=True), "split": dict(pipeline=True, tail_blocks=2),
         "split1": dict(pipeline=True, tail_blocks=1), "split32": dict(pipeline=True, tail_blocks=1, tail_rows=32),
         "split16": dict(pipeline=True, tail_blocks=3, tail_rows=16)}


def _wgmma_layer(x, ids, w, experts, act, block_t, stages=4, high=True, mode="reg"):
    from dayzero.kernels.moe._wgmma import moe_layer_wgmma
    from dayzero.kernels.moe.configs import WgmmaConfig

    E, n13, H = experts.w13.shape[0], experts.w13.shape[1], x.shape[1]
    w13 = experts.w13.view(torch.int32).view(E, n13, H // 8)
    w2 = experts.w2.view(torch.int32).view(E, H, n13 // 16)
    return moe_layer_wgmma(x, ids, w, w13, experts.w13_scale, w2, experts.w2_scale, experts.b13, experts.b2, act,
                           inter=n13 // 2, config=WgmmaConfig(block_t, stages, **MODES[mode]), high_scales=high)


MODELS = {  # experts, top_k, hidden, intermediate, activation, biases
    "gpt-oss-120b": (128, 4, 2880, 2880, GPT_OSS, True),
    "deepseek-v4": (256, 6, 4096, 2048, Activation("swiglu", limit=10.0), False),
}


@cuda
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("tokens,block_t,stages,mode", [
    (128, 16, 4, "reg"), (512, 32, 4, "reg"), (300, 64, 4, "reg"), (2048, 128, 4, "reg"), (8192, 128, 3, "reg"),
    (8192, 256, 3, "reg"), (300, 64, 4, "pipe"), (2048, 128, 4, "pipe"), (8192, 128, 4, "pipe"),
    (8192, 256, 3, "pipe"), (8192, 256, 4, "split"),
    (2048, 256, 4, "split"), (4096, 128, 4, "split1"), (8192, 256, 3, "split32")])
def test_wgmma_layer_full_shapes_cuda(model, tokens, block_t, stages, mode):
    E, k, H, I, act, bias = MODELS[model]
    gen = torch.Generator().manual_seed(tokens + block_t + len(model))
    experts = random_layer(E, H, I, gen, "cuda", bias)
    x = torch.randn(tokens, H, generator=gen).bfloat16().cuda()
    ids, w = random_routing(tokens, E, k, gen, "cuda")
    out = _wgmma_layer(x, ids, w, experts, act, block_t, stages, mode=mode)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape and torch.isfinite(out).all()
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    low = _wgmma_layer(x, ids, w, experts, act, block_t, stages, high=False, mode=mode)  # one multiply
    assert torch.equal(low, out)
    if mode.startswith("pipe"):  # the same wgmmas in the same order as one at a time: the same bits
        assert torch.equal(out, _wgmma_layer(x, ids, w, experts, act, block_t, stages))


@cuda
@pytest.mark.parametrize("mode", ["reg", "pipe"])
@pytest.mark.parametrize("act", [Activation("swiglu"), Activation("swiglu", limit=1.5), GPT_OSS])
def test_wgmma_layer_small_shapes_cuda(act, mode):
    """Masked K tails (H = 96, I = 160: neither a multiple of 64), an N tail in both GEMMs, scale bytes
    above 128 (the second multiply), a few rows per expert; against the reference op too."""
    gen = torch.Generator().manual_seed(7)
    E, H, I, T, k = 6, 96, 160, 70, 2
    w13, s13 = random_mxfp4((E, 2 * I), H, gen, "cuda", scale_range=(110, 135))
    w2, s2 = random_mxfp4((E, H), I, gen, "cuda", scale_range=(100, 130))
    b13 = (torch.randn(E, 2 * I, generator=gen) * 0.5).cuda().bfloat16()
    b2 = (torch.randn(E, H, generator=gen) * 0.5).cuda().bfloat16()
    experts = ExpertWeights("mxfp4", w13, w2, s13, s2, b13, b2)
    x = (torch.randn(T, H, generator=gen) * 2 ** -6).bfloat16().cuda()
    ids, w = random_routing(T, E, k, gen, "cuda")
    out = _wgmma_layer(x, ids, w, experts, act, 64, mode=mode)
    assert torch.isfinite(out).all()
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    assert rel_err(out, _experts_reference(x, ids, w, experts, act)) < 1.5e-2


@cuda
@pytest.mark.parametrize("tokens,block_t,mode", [(500, 256, "split"), (900, 256, "split"), (700, 128, "split1"),
                                                 (40, 256, "split"), (800, 256, "split32"), (600, 128, "split16")])
def test_wgmma_layer_split_blocks_cuda(tokens, block_t, mode):
    """Big blocks that reach past their expert's rows (stores masked), tail blocks in a second launch,
    experts with no big block; K and N tails as in the small-shape test."""
    gen = torch.Generator().manual_seed(tokens)
    E, H, I, k = 6, 96, 160, 2
    w13, s13 = random_mxfp4((E, 2 * I), H, gen, "cuda", scale_range=(110, 135))
    w2, s2 = random_mxfp4((E, H), I, gen, "cuda", scale_range=(100, 130))
    experts = ExpertWeights("mxfp4", w13, w2, s13, s2, (torch.randn(E, 2 * I, generator=gen) * 0.5).cuda().bfloat16(),
                            (torch.randn(E, H, generator=gen) * 0.5).cuda().bfloat16())
    x = (torch.randn(tokens, H, generator=gen) * 2 ** -6).bfloat16().cuda()
    ids, w = random_routing(tokens, E, k, gen, "cuda")
    out = _wgmma_layer(x, ids, w, experts, GPT_OSS, block_t, mode=mode)
    assert torch.isfinite(out).all()
    assert rel_err(out, exact(x, ids, w, experts, GPT_OSS)) < 1e-2


@cuda
def test_moe_layer_picks_wgmma_on_hopper_cuda():
    """moe_experts_mxfp4 at prefill sizes runs this kernel on sm_90 and agrees with the mma kernel."""
    from dayzero.kernels.moe import Plan, moe_experts_mxfp4, plan_for
    from dayzero.kernels.moe.choose import Shapes, mma_configs

    E, k, H, I, act, bias = MODELS["gpt-oss-120b"]
    gen = torch.Generator().manual_seed(3)
    experts = random_layer(E, H, I, gen, "cuda", bias)
    x = torch.randn(1024, H, generator=gen).bfloat16().cuda()
    ids, w = random_routing(1024, E, k, gen, "cuda")
    if plan_for(x, ids, experts).kernel != "wgmma":
        pytest.skip("not an sm_90 device")
    out = moe_experts_mxfp4(x, ids, w, experts, act)
    old = moe_experts_mxfp4(x, ids, w, experts, act, Plan("mma", mma_configs(Shapes("mxfp4", 1024, k, E, H, I))))
    ref = exact(x, ids, w, experts, act)
    assert rel_err(out, ref) < 1e-2 and rel_err(out, old) < 1e-2
