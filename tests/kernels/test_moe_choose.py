"""kernels/moe/choose.py, the one place the routed-expert kernel is chosen: its rules (plain Python, from
shapes and device facts), the variants the registry lists, forcing each variant through DAYZERO_VARIANT
(each gives the reference op's result: under the interpreter on CPU, the Gluon ones on an sm_90 GPU),
and the workspace bytes the engine reserves, which agree with the choice by construction."""

import dataclasses

import pytest
import torch

from dayzero import settings
from dayzero.kernels.moe.choose import (KERNELS, Device, Plan, Shapes, choose, decode_config, fp8_configs,
                                        fp8_workspace_used, graph_tokens, mma_configs, wgmma_config, workspace_bytes)
from dayzero.kernels.moe.configs import DecodeConfig, MmaConfig, WgmmaConfig
from dayzero.ops.moe import _experts_reference
from tests.kernels.conftest import cuda, interpreter
from tests.kernels.moe_inputs import as_bf16, exact, random_layer, random_routing, rel_err
from tests.kernels.test_moe_mxfp4 import ACTIVATIONS, MODELS

H100 = Device("cuda", (9, 0), 132)  # a compiled sm_90 device: the Gluon kernels run
SM80 = Device("cuda", (8, 0), 132)  # CUDA without the Gluon kernels (the H200's SM count)
CPU = Device("cpu", interpreted=True)
GPT_OSS = Shapes("mxfp4", 1, 4, 128, 2880, 2880)  # gpt-oss-120b, one token
V4 = Shapes("mxfp4", 1, 6, 256, 4096, 2048)  # DeepSeek-V4


def at(shapes, tokens):
    return dataclasses.replace(shapes, tokens=tokens)


def test_the_registry_lists_the_choosers_variants():
    from dayzero.ops import REGISTRY, coverage_table

    for op, variants in KERNELS.items():
        assert REGISTRY.variants(op) == {"triton": variants}
    table = coverage_table()
    assert "DAYZERO_VARIANT=op=variant" in table and all(v in table for table_ in KERNELS.values() for v in table_)


def test_path_a_rules_by_device():
    s = settings.Settings()
    # sm_90: decode up to 2.5 rows per expert (one token: the Gluon GEMMs), then wgmma; never path B
    assert choose(GPT_OSS, H100, s).kernel == "decode_sm90"
    assert [choose(at(GPT_OSS, t), H100, s, workspace_warm=True).kernel for t in (8, 32, 64, 128, 1024, 8192)] == [
        "decode", "decode", "decode", "wgmma", "wgmma", "wgmma"]
    assert choose(at(V4, 128), H100, s).kernel == "wgmma"  # 3.2 rows
    # elsewhere: decode up to 3.5 rows, the transposed GEMM to 8, then mma; path B where the workspace is warm
    assert [choose(at(GPT_OSS, t), SM80, s).kernel for t in (1, 64, 128, 512, 8192)] == [
        "decode", "decode", "gemm", "mma", "mma"]
    assert choose(at(V4, 128), SM80, s).kernel == "decode"
    assert [choose(at(GPT_OSS, t), SM80, s, workspace_warm=True).kernel for t in (511, 512, 4095, 4096)] == [
        "mma", "fp8", "fp8", "mma"]
    assert choose(at(GPT_OSS, 512), dataclasses.replace(SM80, capturing=True), s, workspace_warm=True).kernel == "mma"
    with settings.override(moe_b_min_tokens=5, moe_b_max_tokens=7):
        got = [choose(at(GPT_OSS, t), SM80, settings.get(), workspace_warm=True).kernel for t in (4, 5, 6, 7)]
        assert got == ["decode", "fp8", "fp8", "decode"]
    # the interpreter: no Gluon, path B only on CUDA devices
    assert choose(at(GPT_OSS, 1), CPU, s).kernel == "decode"
    assert choose(at(GPT_OSS, 1024), CPU, s, workspace_warm=True).kernel == "mma"


def test_bf16_and_fp8_rules():
    s = settings.Settings()
    bf16 = dataclasses.replace(GPT_OSS, weights="bf16")
    assert [choose(at(bf16, t), H100, s).kernel for t in (1, 1024, 2048)] == ["gemm", "gemm", "mma"]  # mma above 48
    fp8 = dataclasses.replace(V4, weights="fp8")
    assert choose(at(fp8, 4096), H100, s).kernel == "fp8"
    assert choose(at(fp8, 4096), H100, s).config == fp8_configs(4096 * 6, 256)


def test_graph_buckets():
    s = settings.Settings()
    assert [graph_tokens(at(GPT_OSS, t), H100, s) for t in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 0]
    assert graph_tokens(at(GPT_OSS, 3), dataclasses.replace(H100, capturing=True), s) == 0  # the caller's graph
    assert graph_tokens(at(GPT_OSS, 3), CPU, s) == 0
    assert graph_tokens(at(GPT_OSS, 0), H100, s) == 0
    with settings.override(moe_graph_max_tokens=8):
        assert graph_tokens(at(GPT_OSS, 8), H100, settings.get()) == 8
        assert graph_tokens(at(GPT_OSS, 9), H100, settings.get()) == 0
    with settings.override(moe_graph_max_tokens=0):
        assert graph_tokens(at(GPT_OSS, 1), H100, settings.get()) == 0
    # the plan of a graphed call is the bucket's: 3 tokens run the plan of 4
    plan = choose(at(GPT_OSS, 3), H100, s)
    assert plan.graph_tokens == 4 and plan == choose(at(GPT_OSS, 4), H100, s)
    assert graph_tokens(at(GPT_OSS, 3), SM80, s, forced="fp8") == 0  # path B synchronises with the host
    with settings.override(moe_b_min_tokens=2):  # path B could run here: no graph
        assert graph_tokens(at(GPT_OSS, 3), SM80, settings.get()) == 0


def test_decode_tiles():
    one = decode_config(GPT_OSS, SM80, 3.5)  # 360 gate/up programs: K over 8 warps
    assert one.block_m == 1 and (one.block_n1, one.block_k1, one.num_warps1, one.stages1) == (32, 512, 8, 3)
    # the down GEMM: the hand prefetch's tiles loaded before the PDL wait; 360 programs fit 3 per SM
    assert (one.block_n2, one.block_k2, one.num_warps2, one.stages2, one.early2) == (32, 1024, 8, 0, True)
    one_v4 = decode_config(V4, SM80, 3.5)  # 768 down programs: 4 warps each
    assert (one_v4.block_n2, one_v4.block_k2, one_v4.num_warps2, one_v4.stages2, one_v4.early2) == (32, 512, 4, 0, True)
    eight = decode_config(at(GPT_OSS, 8), SM80, 3.5)  # thousands of programs: the pipelined loop
    assert (eight.block_m, eight.stages1, eight.stages2, eight.block_k1, eight.early2) == (1, 3, 3, 512, False)
    many = decode_config(at(GPT_OSS, 32), SM80, 3.5)
    assert (many.block_m, many.block_n2, many.block_k2, many.stages2, many.early2) == (2, 64, 256, 3, False)
    assert decode_config(at(GPT_OSS, 128), SM80, 3.5) is None  # ~4 rows per active expert: tensor cores
    assert decode_config(at(V4, 128), SM80, 3.5) is not None  # ~3.2
    assert decode_config(at(V4, 128), H100, 2.5) is None  # where wgmma runs, its 16-row blocks take over
    g = decode_config(GPT_OSS, H100, 2.5)  # sm_90, one token: both GEMMs in Gluon
    assert g.gluon1 and (g.block_n1, g.block_k1, g.num_warps1, g.stages1) == (32, 256, 8, 3)
    assert g.gluon2 and (g.block_n2, g.block_k2, g.num_warps2, g.stages2, g.early2) == (32, 512, 8, 3, False)
    assert not decode_config(at(GPT_OSS, 8), H100, 2.5).gluon  # from 8 tokens: Triton
    tiny = decode_config(Shapes("mxfp4", 1, 2, 8, 64, 32), H100, 2.5)  # K = 64: the Gluon tiles do not fit
    assert not tiny.gluon


def test_tensor_core_tiles():
    assert mma_configs(at(GPT_OSS, 512))[0].block_n == 64  # 2880 = 45 x 64
    assert mma_configs(at(V4, 8192))[0].block_m == 256  # 192 rows per expert: one block each
    for shapes in (at(GPT_OSS, 8192), at(dataclasses.replace(GPT_OSS, weights="bf16"), 2048)):
        c1, c2 = mma_configs(shapes)
        assert c1.block_m == c2.block_m >= 64 and isinstance(c1, MmaConfig)
    assert wgmma_config(128 * 4, 128).block_t == 16  # 4 rows per expert
    assert wgmma_config(512 * 6, 256).block_t == 32  # 12 rows: a tenth of the experts above 16
    assert wgmma_config(1024 * 4, 128).block_t == 64  # 32 rows
    # 256 rows: half the experts overflow a 256-row block, a third by at most 16 rows: one 16-row tail pays
    assert wgmma_config(8192 * 4, 128) == WgmmaConfig(256, 3, pipeline=True, tail_blocks=1, tail_rows=16)
    assert wgmma_config(8192 * 6, 256) == WgmmaConfig(256, 3, pipeline=True, tail_blocks=1, tail_rows=16)
    assert wgmma_config(4096 * 4, 128) == WgmmaConfig(128)  # 128 rows


def test_forcing_a_variant():
    for variant in KERNELS["moe_experts_mxfp4"]:
        with settings.override(variants={"moe_experts_mxfp4": variant}):
            assert choose(at(GPT_OSS, 1), H100, settings.get()).kernel == variant
    with settings.override(variants={"moe_experts_mxfp4": "mma"}):
        plan = choose(at(GPT_OSS, 1), SM80, settings.get())  # mma at one token: its smallest tiles
        assert plan == Plan("mma", mma_configs(at(GPT_OSS, 1)), graph_tokens=1)
    with settings.override(variants={"moe_experts_mxfp4": "wgmma"}):
        with pytest.raises(ValueError, match="DAYZERO_VARIANT: wgmma is a Gluon kernel, compiled for sm_90 only"):
            choose(GPT_OSS, SM80, settings.get())
    with settings.override(variants={"moe_experts_mxfp4": "decode_sm90"}):
        with pytest.raises(ValueError, match="decode_sm90 needs one token's pair-order dispatch"):
            choose(at(GPT_OSS, 512), H100, settings.get())
    with settings.override(variants={"moe_experts_mxfp4": "fast"}):
        with pytest.raises(ValueError, match="moe_experts_mxfp4 has no variant 'fast'; its variants: decode"):
            choose(GPT_OSS, H100, settings.get())
    with settings.override(variants={"moe_experts_bf16": "mma"}):  # another op's setting
        assert choose(GPT_OSS, H100, settings.get()).kernel == "decode_sm90"


def test_the_registry_checks_every_forced_variant():
    from dayzero.ops import REGISTRY

    with settings.override(variants={"moe_experts_mxfp4": "decode", "moe_experts_bf16": "mma"}):
        REGISTRY.check_variants()
    with settings.override(variants={"moe_experts_mxfp5": "decode"}):
        with pytest.raises(ValueError, match="names op 'moe_experts_mxfp5', which is not defined; ops with variants"):
            REGISTRY.check_variants()
    with settings.override(variants={"rms_norm": "fast"}):
        with pytest.raises(ValueError, match="rms_norm has no variants"):
            REGISTRY.check_variants()


def test_workspace_bytes_agree_with_the_choice():
    """workspace_bytes is 0 exactly where choose() can never pick path B, whatever the call; elsewhere it
    holds every expert a step of max_tokens can activate (or the size set)."""
    from dayzero.kernels.moe import expert_slot_bytes

    E, k, H, I = 128, 4, 2880, 2880
    slot = expert_slot_bytes(I, H)
    cases = [(H100, {}), (SM80, {}), (CPU, {}), (Device("cpu"), {}), (H100, {"variants": {"moe_experts_mxfp4": "fp8"}}),
             (SM80, {"variants": {"moe_experts_mxfp4": "mma"}}), (SM80, {"fp8_workspace_gib": 0.5}),
             (SM80, {"moe_b_min_tokens": 8, "moe_b_max_tokens": 8})]
    for device, changes in cases:
        with settings.override(**changes):
            s = settings.get()
            nbytes = workspace_bytes("mxfp4", E, k, H, I, 2048, device, s)
            chosen = {choose(Shapes("mxfp4", t, k, E, H, I), device, s, workspace_warm=True).kernel
                      for t in (1, 7, 64, 512, 1024, 4095, 8192)}
            assert (nbytes > 0) == fp8_workspace_used(device, s) == ("fp8" in chosen), (device, changes)
            if nbytes and "fp8_workspace_gib" not in changes:
                assert nbytes == E * slot
    with settings.override(fp8_workspace_gib=0.5):
        assert workspace_bytes("mxfp4", E, k, H, I, 2048, SM80, settings.get()) == 2**29
    assert workspace_bytes("mxfp4", E, k, H, I, 2048, SM80, settings.Settings(), gib=1) == 2**30  # the argument wins
    assert workspace_bytes("mxfp4", E, k, H, I, 4, SM80, settings.Settings()) == 16 * slot  # 4 tokens x top-4
    assert workspace_bytes("fp8", E, k, H, I, 2048, SM80, settings.Settings()) == 0


# -- every variant, forced, against the reference op ---------------------------------------------------

def _forced(op_name, variant, x, ids, w, experts, act):
    from dayzero.kernels import moe

    op = getattr(moe, op_name)
    with settings.override(variants={op_name: variant}):
        assert moe.plan_for(x, ids, experts).kernel == variant
        return op(x, ids, w, experts, act)


INTERPRETED = [("moe_experts_mxfp4", v) for v in KERNELS["moe_experts_mxfp4"] if v not in ("decode_sm90", "wgmma")]
INTERPRETED += [("moe_experts_bf16", v) for v in KERNELS["moe_experts_bf16"]]


@interpreter
@pytest.mark.parametrize("op,variant", INTERPRETED)
def test_each_variant_forced_gives_the_reference_result_interpreted(op, variant):
    from dayzero.kernels.moe import Fp8Workspace

    gen = torch.Generator().manual_seed(len(op) + len(variant))
    E, H, I, T = 5, 96, 64, 6
    experts = random_layer(E, H, I, gen, "cpu", True)
    if op == "moe_experts_bf16":
        experts = as_bf16(experts)
    if variant == "fp8":
        experts = dataclasses.replace(experts, workspace=Fp8Workspace(2**24, "cpu"))
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids, w = random_routing(T, E, 2, gen, "cpu")
    act = ACTIVATIONS["gpt_oss"]
    out = _forced(op, variant, x, ids, w, experts, act)
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    assert rel_err(out, _experts_reference(x, ids, w, experts, act)) < 1.5e-2


@interpreter
def test_the_fp8_experts_variant_forced_interpreted():
    from tests.kernels.test_moe_fp8 import _fp8_layer

    gen = torch.Generator().manual_seed(9)
    experts = _fp8_layer(4, 144, 192, gen, "cpu", True)
    x = torch.randn(5, 144, generator=gen).bfloat16()
    ids, w = random_routing(5, 4, 2, gen, "cpu")
    act = ACTIVATIONS["swiglu_limit"]
    out = _forced("moe_experts_fp8", "fp8", x, ids, w, experts, act)
    assert rel_err(out, _experts_reference(x, ids, w, experts, act)) < 1.5e-2


@interpreter
def test_pinned_plans_are_checked_interpreted():
    from dayzero.kernels.moe import moe_experts_mxfp4

    gen = torch.Generator().manual_seed(4)
    experts = random_layer(4, 64, 32, gen, "cpu", False)
    x = torch.randn(2, 64, generator=gen).bfloat16()
    ids, w = random_routing(2, 4, 2, gen, "cpu")
    act = ACTIVATIONS["swiglu"]
    with pytest.raises(ValueError, match="no kernel 'dense'"):
        moe_experts_mxfp4(x, ids, w, experts, act, Plan("dense", None))
    with pytest.raises(ValueError, match="kernel 'decode' takes a DecodeConfig config"):
        moe_experts_mxfp4(x, ids, w, experts, act, Plan("decode", WgmmaConfig(64)))
    with pytest.raises(ValueError, match="runs Gluon code, compiled for sm_90 only"):
        moe_experts_mxfp4(x, ids, w, experts, act, Plan("wgmma", WgmmaConfig(64)))
    with pytest.raises(ValueError, match="runs Gluon code"):
        moe_experts_mxfp4(x, ids, w, experts, act, Plan("decode_sm90", DecodeConfig(1, 32, 32, stages1=3, gluon1=True)))


@cuda
@pytest.mark.parametrize("variant,tokens", [("decode_sm90", 1), ("wgmma", 300), ("decode", 1), ("gemm", 40),
                                            ("mma", 300), ("fp8", 64)])
def test_each_variant_forced_gives_the_reference_result_cuda(variant, tokens):
    """At gpt-oss-120b's shapes; the Gluon variants where the device is sm_90."""
    from dayzero import ops
    from dayzero.kernels.moe import Fp8Workspace
    from dayzero.kernels.moe._layer import device_of
    from dayzero.ops import REGISTRY

    E, k, H, I, act, bias = MODELS["gpt-oss-120b"]
    gen = torch.Generator().manual_seed(tokens)
    experts = random_layer(E, H, I, gen, "cuda", bias)
    x = torch.randn(tokens, H, generator=gen).to("cuda", torch.bfloat16)
    if variant in ("decode_sm90", "wgmma") and not device_of(x).sm90:
        pytest.skip("a Gluon kernel: sm_90 only")
    if variant == "fp8":
        experts = dataclasses.replace(experts, workspace=Fp8Workspace(E * 27 * 2**20, "cuda"))
    ids, w = random_routing(tokens, E, k, gen, "cuda")
    with settings.override(variants={"moe_experts_mxfp4": variant}):
        out = ops.moe_experts_mxfp4(x, ids, w, experts, act)
        out = ops.moe_experts_mxfp4(x, ids, w, experts, act)  # again: a layer graph where one applies
    with REGISTRY.force_backend("reference"):
        ref = ops.moe_experts_mxfp4(x, ids, w, experts, act)
    assert out.isfinite().all()
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    assert rel_err(out, ref) < 1.5e-2
