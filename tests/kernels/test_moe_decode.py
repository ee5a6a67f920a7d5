"""The decode kernels of path A ("decode" and "decode_sm90": _decode.py, int8 x E2M1 dot products, no tensor
cores; the Gluon GEMMs of _decode_sm90.py) against the reference op and the exact float32 layer;
exactness of the weight decode; the activation quantizer; the one-launch dispatch.

Under the CPU interpreter the byte permutes and dp4a are computed by their definition (the rest is
the compiled code); on CUDA the PTX runs. Tolerances as in test_moe_mxfp4.
"""

import pytest

from tests.budget import ci_cases
import torch

from dayzero.ops.moe import Activation, _experts_reference
from tests.kernels.conftest import cuda, interpreter
from tests.kernels.moe_inputs import exact, random_layer, random_mxfp4, random_routing, rel_err
from tests.kernels.sm90_compile import register, report
from tests.kernels.test_moe_mxfp4 import ACTIVATIONS, MODELS, model_layers  # noqa: F401  (fixture)


def _run(x, ids, w, experts, act, config):
    from dayzero.kernels.moe import Plan, moe_experts_mxfp4

    return moe_experts_mxfp4(x, ids, w, experts, act, Plan("decode_sm90" if config.gluon else "decode", config))


# CI: each block_m, each activation and bias on and off once; DAYZERO_FULL_TESTS=1: every activation at 1 and 3 tokens
DECODE_LAYER_CASES = ci_cases([(1, 1, True, "swiglu"), (3, 2, False, "swiglu_limit"), (9, 4, True, "gpt_oss")] + [
    (1, 1, True, a) for a in ("swiglu_limit", "gpt_oss")] + [(3, 2, False, a) for a in ("swiglu", "gpt_oss")] + [
    (9, 4, False, "swiglu_limit")], keep=3)


@interpreter
@pytest.mark.parametrize("tokens,block_m,bias,act", DECODE_LAYER_CASES)
def test_decode_layer_interpreted(tokens, block_m, bias, act):
    """H = 96 with BLOCK_K 64: the last K tile overlaps the one before (its repeated blocks must
    count once); 9 tokens x top-2 over 6 experts puts more than 4 rows on some experts (two blocks)."""
    from dayzero.kernels.moe.configs import DecodeConfig

    gen = torch.Generator().manual_seed(100 + tokens)
    E, H, I = 6, 96, 64
    experts = random_layer(E, H, I, gen, "cpu", bias)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    ids, w = random_routing(tokens, E, 2, gen, "cpu")
    out = _run(x, ids, w, experts, ACTIVATIONS[act], DecodeConfig(block_m, 64, 32, 64, 64))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert rel_err(out, exact(x, ids, w, experts, ACTIVATIONS[act])) < 1e-2
    assert rel_err(out, _experts_reference(x, ids, w, experts, ACTIVATIONS[act])) < 1.5e-2


@interpreter
@pytest.mark.parametrize("tokens,block_m,act", [(1, 1, "gpt_oss"), (3, 2, "swiglu"), (9, 4, "swiglu_limit")])
def test_decode_layer_pipelined_interpreted(tokens, block_m, act):
    """The software-pipelined loop (stages >= 2: weight tiles through shared memory instead of the hand
    prefetch), with the overlapping last K tile of H = 96 in BLOCK_K 64."""
    from dayzero.kernels.moe.configs import DecodeConfig

    gen = torch.Generator().manual_seed(300 + tokens)
    E, H, I = 6, 96, 64
    experts = random_layer(E, H, I, gen, "cpu", True)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    ids, w = random_routing(tokens, E, 2, gen, "cpu")
    config = DecodeConfig(block_m, 64, 32, 64, 64, stages1=3, stages2=2)
    out = _run(x, ids, w, experts, ACTIVATIONS[act], config)
    assert rel_err(out, exact(x, ids, w, experts, ACTIVATIONS[act])) < 1e-2
    hand = _run(x, ids, w, experts, ACTIVATIONS[act], DecodeConfig(block_m, 64, 32, 64, 64))
    assert torch.equal(out, hand)  # the same sums in the same order


def _readback(blocks, scales, device, block_m=4, block_n=32, block_k=64, normal_scales=False):
    """Every weight column read back through the down-projection kernel: x = identity rows."""
    from dayzero.kernels.moe._decode import decode_gemm, quantize_rows
    from dayzero.kernels.moe._dispatch import dispatch

    E, N, kb, _ = blocks.shape
    K = kb * 32
    xq, xs = quantize_rows(torch.eye(K, dtype=torch.bfloat16, device=device))
    d = dispatch(torch.zeros(K, 1, dtype=torch.int64, device=device), E, block_m)
    words = blocks.view(torch.int32).view(E, N, K // 8)
    out = decode_gemm(xq, xs, words, scales, None, d, out_features=N, gather=True, block_n=block_n, block_k=block_k,
                      normal_scales=normal_scales)
    return out[d.pair_row.long()].T  # [N, K]


def _check_readback(device, scale_range, **tiles):
    from dayzero.formats import mxfp4

    gen = torch.Generator().manual_seed(scale_range[0])
    blocks, scales = random_mxfp4((1, 32), 64, gen, device, scale_range)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8, device=device) * 17  # every code, both nibbles
    got = _readback(blocks, scales, device, **tiles)
    want = mxfp4.dequantize(blocks[0], scales[0], torch.float32)  # the down GEMM's rows are float32
    assert got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)



@interpreter
@pytest.mark.parametrize("tokens,stages,early2", [(1, 0, False), (1, 3, False), (5, 0, True), (3, 2, False)])
def test_decode_layer_pair_order_interpreted(tokens, stages, early2):
    """The pair-order dispatch of block_m 1 (block b = pair b, experts read from topk_ids) against the
    exact layer, with ids outside [0, E) dropped, whatever the stages and the early down GEMM; the same
    sums as the sorted dispatch of block_m 2 (another order of the float32 block sums at most)."""
    from dayzero.kernels.moe.configs import DecodeConfig

    gen = torch.Generator().manual_seed(500 + tokens)
    E, H, I = 6, 96, 64
    experts = random_layer(E, H, I, gen, "cpu", True)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    ids, w = random_routing(tokens, E, 2, gen, "cpu")
    ids[0, 1] = -1
    if tokens > 1:
        ids[-1, 0] = E + 3
    act = ACTIVATIONS["gpt_oss"]
    paired = _run(x, ids, w, experts, act, DecodeConfig(1, 64, 32, 64, 64, stages1=stages,
                                                        stages2=0 if early2 else stages, early2=early2))
    valid = (ids >= 0) & (ids < E)
    want = exact(x, ids.clamp(0, E - 1), w * valid, experts, act)
    assert rel_err(paired, want) < 1e-2
    sorted_out = _run(x, ids, w, experts, act, DecodeConfig(2, 64, 32, 64, 64))
    assert rel_err(paired, sorted_out) < 1e-3


def test_decode_config_checks():
    from dayzero.kernels.moe.configs import DecodeConfig

    with pytest.raises(ValueError, match="needs stages2 0"):
        DecodeConfig(1, 32, 32, stages2=3, early2=True)
    with pytest.raises(ValueError, match="block_m must be 1, 2 or 4"):
        DecodeConfig(3, 32, 32)
    with pytest.raises(ValueError, match="Gluon GEMM \\(gluon1\\) runs the pair-order dispatch"):
        DecodeConfig(2, 32, 32, stages1=3, gluon1=True)  # a sorted dispatch
    with pytest.raises(ValueError, match="gluon2"):
        DecodeConfig(1, 32, 32, stages2=0, gluon2=True)
    DecodeConfig(2, 32, 32, early2=True)  # the down GEMM's experts come from prep, two launches back


@interpreter
def test_decode_weights_are_exact_interpreted():
    _check_readback("cpu", (110, 140))


@interpreter
def test_decode_one_shift_factors_are_exact_interpreted():
    """normal_scales (every E8M0 byte in 1..254): the factor is the float32 with exponent field s, the
    same weights as the exact path, over the whole normal range."""
    _check_readback("cpu", (1, 254), normal_scales=True)


@interpreter
@pytest.mark.parametrize("byte", [0, 255])
def test_decode_layer_exact_path_for_special_scale_bytes_interpreted(byte):
    """A layer with an E8M0 byte of 0 (2^-127) or 255 (NaN) runs the exact factors (scale_facts): with
    0xFF in the gate rows of token 0's first expert, token 0's output is NaN and the others' are not;
    with 0 the layer still matches the exact float32 layer."""
    from dayzero.kernels.moe._layer import scale_facts
    from dayzero.kernels.moe.configs import DecodeConfig

    gen = torch.Generator().manual_seed(11)
    E, H, I = 6, 96, 64
    experts = random_layer(E, H, I, gen, "cpu", False)
    x = torch.randn(3, H, generator=gen).bfloat16()
    _, w = random_routing(3, E, 2, gen, "cpu")
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])  # expert 0 serves token 0 alone
    experts.w13_scale[0, 5, 1] = byte  # gate row 5, K block 1
    act = ACTIVATIONS["swiglu"]
    out = _run(x, ids, w, experts, act, DecodeConfig(1, 64, 32, 64, 64))
    assert scale_facts(experts, experts.w13_scale, experts.w2_scale)[1] is False
    if byte == 255:  # h's block 0 of (token 0, expert 0) is NaN, so is every column of its down projection
        assert out[0].isnan().all() and out[1:].isfinite().all()
    else:
        assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2


def test_scale_facts_flag_subnormal_and_nan_bytes():
    """_layer.scale_facts: normal only when no byte is 0 (2^-127) or 255 (NaN); kept with the layer (its w13
    tensor, so an ExpertWeights built anew finds it) and recomputed when the scales change in place."""
    from dayzero.kernels.moe._layer import scale_facts
    from dayzero.ops.moe import ExpertWeights

    def facts(s13_bytes, s2_bytes):
        s13 = torch.tensor(s13_bytes, dtype=torch.uint8).view(1, 1, -1)
        s2 = torch.tensor(s2_bytes, dtype=torch.uint8).view(1, 1, -1)
        return scale_facts(ExpertWeights("mxfp4", torch.zeros(1, 64, 1, 16, dtype=torch.uint8), None, s13, s2), s13, s2)

    assert facts([1, 127, 254], [100]) == (True, True)
    assert facts([1, 127, 128], [100]) == (False, True)
    assert facts([0, 127], [100]) == (False, False)
    assert facts([127], [255]) == (True, False)
    w13 = torch.zeros(1, 64, 1, 16, dtype=torch.uint8)
    ok = torch.full((1, 1, 2), 127, dtype=torch.uint8)
    assert scale_facts(ExpertWeights("mxfp4", w13, None, ok, ok), ok, ok) == (False, True)
    assert scale_facts(ExpertWeights("mxfp4", w13, None, ok, ok), ok, ok) == (False, True)  # a new object: cached
    ok[0, 0, 1] = 255  # changed in place (a weight reload): computed again
    assert scale_facts(ExpertWeights("mxfp4", w13, None, ok, ok), ok, ok) == (True, False)


@interpreter
def test_quantize_rows_interpreted():
    """Within 2^-14 of each 32-value block's largest |x| (exact for values within 2^6 of it); a NaN or
    infinity makes its block's factor NaN."""
    from dayzero.kernels.moe._decode import dequantize_rows, quantize_rows

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 160, generator=gen) * torch.logspace(-6, 6, 160).view(1, 160)
    x = x.bfloat16()
    x[2, 40] = float("nan")
    x[1, 100] = float("inf")
    xq, xs = quantize_rows(x)
    back = dequantize_rows(xq, xs)
    blocks = x.float().view(3, 5, 32)
    bound = blocks.abs().nan_to_num(0, 0, 0).amax(-1, keepdim=True) * 2.0**-14
    finite = torch.ones(3, 5, dtype=torch.bool)
    finite[2, 1] = finite[1, 3] = False
    assert xs.shape == (3, 2, 5)
    assert (xs[:, 0].isnan() == ~finite).all()
    err = (back.view(3, 5, 32) - blocks).abs()
    assert (err[finite] <= bound.expand_as(blocks)[finite]).all()
    # plane 1: the int32 -24 x each block's integer sum (as bits), read here from the bytes (little-endian) of xq
    b = xq.view(torch.uint8).view(3, 4, 20, 4).long()
    q = torch.where(b[:, :2] >= 128, b[:, :2] - 256, b[:, :2]) * 256 + b[:, 2:]
    assert torch.equal(xs[:, 1].view(torch.int32), -24 * q.sum(dim=(1, 3)).view(3, 5, 4).sum(-1).int())


@interpreter
@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 4, 128, 1), (9, 2, 6, 4), (40, 8, 16, 2),
                                                          (32, 6, 256, 2), (64, 8, 256, 4), (50, 2, 3, 4)])
def test_prep_matches_dispatch_and_quantize_interpreted(tokens, top_k, experts, block_m):
    """The one-launch dispatch + quantization of the decode path: the reference dispatch (also stable
    within an expert), ids outside [0, E) dropped; the same bits as quantize_rows. Up to the 512 pairs
    prep takes, experts with many pairs (3 experts for 100) and with one."""
    from dayzero.kernels.moe._decode import prep, quantize_rows
    from dayzero.kernels.moe._dispatch import dispatch_reference

    gen = torch.Generator().manual_seed(tokens)
    ids, _ = random_routing(tokens, experts, top_k, gen, "cpu")
    if tokens > 9:
        ids[3, 1], ids[7, 0] = experts + 5, -1
    x = torch.randn(tokens, 96, generator=gen).bfloat16()
    d, xq, xs = prep(x, ids, experts, block_m)
    ref = dispatch_reference(ids, experts, block_m)
    for field in ("block_expert", "row_pair", "pair_row"):
        assert torch.equal(getattr(d, field), getattr(ref, field)), field
    want_q, want_s = quantize_rows(x)
    assert torch.equal(xq, want_q) and torch.equal(xs.view(torch.int32), want_s.view(torch.int32))  # bitwise


# -- CUDA, full model shapes --------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("scale_range", [(0, 128), (100, 140), (1, 252)])
@pytest.mark.parametrize("block_k", [128, 256])
def test_decode_weights_are_exact_cuda(scale_range, block_k):
    """Every code and scale byte, including subnormal results (small scales)."""
    blocks_k = 256
    from dayzero.formats import mxfp4

    gen = torch.Generator().manual_seed(scale_range[0])
    blocks, scales = random_mxfp4((1, 64), blocks_k, gen, "cuda", scale_range)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8, device="cuda") * 17
    got = _readback(blocks, scales, "cuda", block_k=block_k)
    want = mxfp4.dequantize(blocks[0], scales[0], torch.float32)  # the down GEMM's rows are float32
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@cuda
@pytest.mark.parametrize("block_k", [128, 256])
def test_decode_one_shift_factors_are_exact_cuda(block_k):
    """normal_scales: every scale byte of 1..254 and every code, exactly the exact path's weights."""
    from dayzero.formats import mxfp4

    gen = torch.Generator().manual_seed(7)
    blocks, scales = random_mxfp4((1, 64), 256, gen, "cuda", (1, 254))
    scales[0, :, 0] = torch.arange(64, dtype=torch.uint8, device="cuda") * 4 + 1  # 1 .. 253
    scales[0, :2, 1] = torch.tensor([2, 254], dtype=torch.uint8, device="cuda")
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8, device="cuda") * 17
    got = _readback(blocks, scales, "cuda", block_k=block_k, normal_scales=True)
    want = mxfp4.dequantize(blocks[0], scales[0], torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@cuda
def test_decode_nan_scale_gives_nan_cuda():
    gen = torch.Generator().manual_seed(1)
    blocks, scales = random_mxfp4((1, 64), 256, gen, "cuda")
    scales[0, 3, 1] = 255
    got = _readback(blocks, scales, "cuda", block_k=256)  # [N, K]
    assert got[3].isnan().all()
    assert torch.cat([got[:3], got[4:]]).isfinite().all()


@cuda
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("tokens,config", [
    (1, (1, 32, 16, 256, 256)), (1, (1, 64, 16, 256, 1024, 8, 8)), (5, (2, 64, 64, 128, 128, 8, 8)),
    (17, (4, 32, 32, 256, 128)), (32, (4, 64, 64, 256, 256, 8, 4)),
    (100, (4, 32, 32, 256, 256)),  # 100 x top-6 pairs: dispatch() and a quantize launch, not prep
    (8, (1, 32, 32, 256, 512, 4, 4, 3, 3)), (1, (1, 32, 16, 256, 512, 4, 4, 4, 3)),  # pipelined
    (32, (2, 32, 64, 256, 256, 4, 4, 3, 3)),
    (1, (1, 32, 32, 512, 1024, 8, 8, 3, 0, True)),  # the down GEMM's tiles requested before its PDL wait
    (8, (1, 32, 32, 512, 512, 4, 4, 3, 0, True)), (32, (2, 32, 64, 256, 256, 4, 4, 3, 0, True))])
def test_decode_layer_full_shapes_cuda(model, tokens, config, model_layers):  # noqa: F811
    """Pinned decode tiles (the PTX byte permutes and dp4a) at full model shapes."""
    from dayzero import ops
    from dayzero.kernels.moe.configs import DecodeConfig
    from dayzero.ops import REGISTRY

    E, k, H, I, act, _ = MODELS[model]
    experts = model_layers(model)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen).to("cuda", torch.bfloat16)
    ids, w = random_routing(tokens, E, k, gen, "cuda")
    out = _run(x, ids, w, experts, act, DecodeConfig(*config))
    with REGISTRY.force_backend("reference"):
        ref = ops.moe_experts_mxfp4(x, ids, w, experts, act)
    assert out.isfinite().all()
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    assert rel_err(out, ref) < 1.5e-2


@cuda
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("tokens,gluon,tiles", [
    (1, (True, False), (32, 32, 256, 1024, 8, 8, 3, 0)),
    (8, (False, True), (32, 32, 512, 512, 4, 4, 3, 2)),
    (3, (True, True), (32, 32, 512, 512, 8, 4, 3, 3)),
    (1, (True, True), (32, 32, 256, 512, 8, 8, 3, 3)),  # the one-token default on sm_90
    (8, (True, True), (32, 16, 256, 1024, 8, 8, 4, 4)),
    (5, (True, True), (32, 16, 512, 1024, 8, 8, 3, 4))])
def test_decode_layer_gluon_cuda(model, tokens, gluon, tiles, model_layers):  # noqa: F811
    """_decode_sm90's Gluon GEMMs (sm_90) at full model shapes, pair order: against the exact layer, the
    reference op and the Triton decode kernels on the same inputs (the same integer sums; only the float32
    order of the block sums may differ), with an invalid expert id in the routing."""
    from dayzero import ops
    from dayzero.kernels.moe._layer import device_of
    from dayzero.kernels.moe.configs import DecodeConfig
    from dayzero.ops import REGISTRY

    E, k, H, I, act, _ = MODELS[model]
    experts = model_layers(model)
    gen = torch.Generator().manual_seed(tokens + 7)
    x = torch.randn(tokens, H, generator=gen).to("cuda", torch.bfloat16)
    if not device_of(x).sm90:
        pytest.skip("the Gluon decode kernels need an sm_90 device")
    ids, w = random_routing(tokens, E, k, gen, "cuda")
    n1, n2, k1, k2, w1, w2, s1, s2 = tiles
    cfg = DecodeConfig(1, n1, n2, k1, k2, w1, w2, stages1=s1, stages2=s2, early2=s2 == 0, gluon1=gluon[0],
                       gluon2=gluon[1])
    out = _run(x, ids, w, experts, act, cfg)
    triton_cfg = DecodeConfig(1, 32, 32, 512, 512, 4, 4, stages1=3, stages2=3)
    assert rel_err(out, _run(x, ids, w, experts, act, triton_cfg)) < 2e-3
    with REGISTRY.force_backend("reference"):
        ref = ops.moe_experts_mxfp4(x, ids, w, experts, act)
    assert out.isfinite().all()
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    assert rel_err(out, ref) < 1.5e-2
    bad = ids.clone()
    bad[0, 1] = -1  # no expert: the pair is skipped by both GEMMs and the combine
    assert rel_err(_run(x, bad, w, experts, act, cfg), _run(x, bad, w, experts, act, triton_cfg)) < 2e-3


@pytest.mark.parametrize("args", register("sass_moe_decode", ci_cases([
    ["--k", "2880", "--gated", "--tile", "1x32x256x8"],
    ["--k", "2880", "--gated", "--tile", "1x32x512x4", "--stages", "3"],
    ["--k", "2048", "--tile", "2x64x256x4", "--stages", "3"]])))
def test_decode_kernel_sass_for_sm90(args):
    """Compiled for sm_90 here (Triton's bundled ptxas, no GPU; tools/sass_moe_decode.py): nothing
    spills, the weight decode costs at most 4.5 PRMT and 4 dp4a per weight word per row (the offset
    bytes: two permutes per four codes), and the pipelined loop copies its tiles asynchronously
    (LDGSTS) into shared memory."""
    import re

    code, out, err, _ = report("sass_moe_decode", args)
    assert code == 0, err[-2000:]
    assert "stack (spills) 0 B" in out, out
    rows = int(args[args.index("--tile") + 1].split("x")[0])
    per_word = {op: float(v) for op, v in re.findall(r"([A-Z0-9]+) ([0-9.]+)", out.split("per word:")[1])}
    assert per_word["PRMT"] <= 4.5 and per_word["IDP"] == 4 * rows, out
    assert ("LDGSTS" in per_word) == ("--stages" in args), out


@pytest.mark.parametrize("args", register("sass_moe_decode_sm90", ci_cases([
    ["--k", "2880", "--gated", "--tile", "32x256x8", "--stages", "3"],
    ["--k", "2880", "--tile", "32x512x8", "--stages", "3", "--normal"],
    ["--k", "4096", "--out", "2048", "--gated", "--tile", "32x512x8", "--stages", "2"]])))
def test_gluon_decode_kernel_sass_for_sm90(args):
    """_decode_sm90's GEMMs compiled for sm_90 here (tools/sass_moe_decode_sm90.py, no GPU): nothing
    spills, 4 dp4a and at most 4.1 PRMT per weight word (prologue and epilogue included), the shared-memory
    ring filled by cp.async (LDGSTS)."""
    import re

    code, out, err, _ = report("sass_moe_decode_sm90", args)
    assert code == 0, err[-2000:]
    assert "stack (spills) 0 B" in out, out
    per_word = {op: float(v) for op, v in re.findall(r"([A-Z0-9]+) ([0-9.]+)", out.split("per word:")[1])}
    assert per_word["IDP"] == 4 and per_word["PRMT"] <= 4.1 and "LDGSTS" in per_word, out


PDL_CASES = register("sass_moe_decode", [["--k", "2880", "--tile", "1x32x1024x8", "--pdl", "--dump", "DUMP"] + early
                                         for early in ([], ["--early"])])


@pytest.mark.parametrize("early", [False, True])
def test_decode_kernel_early_loads_precede_the_pdl_wait(early):
    """Compiled for sm_90 with the PDL wait (ACQBULK): with early, the weight tiles' 16-byte loads are
    issued before the wait; without it, no global load precedes the wait (tools/sass_moe_decode.py)."""
    code, _, err, dump = report("sass_moe_decode", PDL_CASES[early])
    assert code == 0, err[-2000:]
    lines = dump.splitlines()
    wait = next(i for i, line in enumerate(lines) if "ACQBULK" in line)
    before = [line for line in lines[:wait] if "LDG.E.128" in line]
    if early:
        assert len(before) == 8, before  # two tiles: 32 rows x 1024 codes over 256 threads, 2 x 4 x 16 B each
    else:
        assert not [line for line in lines[:wait] if "LDG" in line]
