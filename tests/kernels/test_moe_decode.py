"""Decode kernels of path A (moe_decode: int8 x E2M1 dot products, no tensor cores) against the
reference op and the exact float32 layer; exactness of the weight decode; the activation quantizer.

Under the CPU interpreter the byte permutes and dp4a are computed by their definition (the rest is
the compiled code); on CUDA the PTX runs. Tolerances as in test_moe_mxfp4.
"""

import pytest
import torch

from dayzero.ops.moe import Activation, _experts_reference
from tests.kernels.conftest import cuda, interpreter
from tests.kernels.moe_inputs import exact, random_layer, random_mxfp4, random_routing, rel_err
from tests.kernels.test_moe_mxfp4 import ACTIVATIONS, MODELS, model_layers  # noqa: F401  (fixture)


def _run(x, ids, w, experts, act, config=None):
    from dayzero.kernels.moe_mxfp4 import moe_experts_mxfp4

    return moe_experts_mxfp4(x, ids, w, experts, act, configs=config)


@interpreter
@pytest.mark.parametrize("tokens,block_m,bias,act", [(1, 1, True, a) for a in ACTIVATIONS] + [
    (3, 2, False, a) for a in ACTIVATIONS] + [(9, 4, True, "gpt_oss"), (9, 4, False, "swiglu_limit")])
def test_decode_layer_interpreted(tokens, block_m, bias, act):
    """H = 96 with BLOCK_K 64: the last K tile overlaps the one before (its repeated blocks must
    count once); 9 tokens x top-2 over 6 experts puts more than 4 rows on some experts (two blocks)."""
    from dayzero.kernels.moe_decode import DecodeConfig

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
    from dayzero.kernels.moe_decode import DecodeConfig

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


@interpreter
@pytest.mark.parametrize("tokens,block_m,bias,act,tiles", [
    (1, 1, True, a, (64, 32, 64, 32, 4, 4, 2, 2)) for a in ACTIVATIONS] + [
    (3, 2, False, "swiglu_limit", (32, 32, 32, 64, 4, 4, 3, 1)), (5, 4, True, "gpt_oss", (64, 32, 64, 32, 4, 4, 1, 3)),
    (1, 1, True, "gpt_oss", (64, 32, 32, 32, 4, 4, 2, 2, 3, 2))])  # split and pipelined
def test_decode_layer_split_k_interpreted(tokens, block_m, bias, act, tiles):
    """Split-K (partial sums per K chunk, activate_partials / combine_partials). Gate/up K = 96 in
    BLOCK_K 64 chunks: the last chunk is shorter than a tile (read overlapping the one before); 32-wide
    tiles split 3 ways: one tile per chunk; down K = 64 asked for 3 chunks gets 2 (none left empty)."""
    from dayzero.kernels.moe_decode import DecodeConfig

    gen = torch.Generator().manual_seed(200 + tokens)
    E, H, I = 6, 96, 64
    experts = random_layer(E, H, I, gen, "cpu", bias)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    ids, w = random_routing(tokens, E, 2, gen, "cpu")
    out = _run(x, ids, w, experts, ACTIVATIONS[act], DecodeConfig(block_m, *tiles))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert rel_err(out, exact(x, ids, w, experts, ACTIVATIONS[act])) < 1e-2
    assert rel_err(out, _experts_reference(x, ids, w, experts, ACTIVATIONS[act])) < 1.5e-2


def _readback(blocks, scales, device, block_m=4, block_n=32, block_k=64, normal_scales=False):
    """Every weight column read back through the down-projection kernel: x = identity rows."""
    from dayzero.kernels.moe_decode import decode_gemm, quantize_rows
    from dayzero.kernels.moe_dispatch import dispatch

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
@pytest.mark.parametrize("tokens,early,stages,split", [(1, (False, False), 0, 1), (1, (False, False), 3, 1),
                                                       (5, (True, True), 0, 1), (5, (True, False), 0, 2),
                                                       (1, (False, True), 0, 3)])
def test_decode_layer_pair_order_interpreted(tokens, early, stages, split):
    """The pair-order dispatch (block b = pair b, experts read from topk_ids) gives the sorted dispatch's
    result bit for bit, with ids outside [0, E) dropped, whatever the early tiles, stages and split."""
    from dayzero.kernels.moe_decode import DecodeConfig

    gen = torch.Generator().manual_seed(500 + tokens)
    E, H, I = 6, 96, 64
    experts = random_layer(E, H, I, gen, "cpu", True)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    ids, w = random_routing(tokens, E, 2, gen, "cpu")
    ids[0, 1] = -1
    if tokens > 1:
        ids[-1, 0] = E + 3
    act = ACTIVATIONS["gpt_oss"]
    tiles = (1, 64, 32, 64, 64, 4, 4, split, 1, stages, stages)
    sorted_out = _run(x, ids, w, experts, act, DecodeConfig(*tiles))
    paired = _run(x, ids, w, experts, act, DecodeConfig(*tiles, pair_order=True, early1=early[0], early2=early[1]))
    assert torch.equal(paired, sorted_out)
    valid = (ids >= 0) & (ids < E)
    want = exact(x, ids.clamp(0, E - 1), w * valid, experts, act)
    assert rel_err(paired, want) < 1e-2


def test_decode_config_rejects_unsafe_early_loads():
    from dayzero.kernels.moe_decode import DecodeConfig

    with pytest.raises(ValueError, match="early1 needs pair_order"):
        DecodeConfig(1, 32, 32, early1=True)
    with pytest.raises(ValueError, match="pair_order needs block_m 1"):
        DecodeConfig(2, 32, 32, pair_order=True)
    with pytest.raises(ValueError, match="need stages 0"):
        DecodeConfig(1, 32, 32, stages2=3, early2=True)
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
    from dayzero.kernels.moe_decode import DecodeConfig
    from dayzero.kernels.moe_mxfp4 import scale_facts

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
    """moe_mxfp4.scale_facts: normal only when no byte is 0 (2^-127) or 255 (NaN); cached per layer."""
    from dayzero.kernels.moe_mxfp4 import scale_facts
    from dayzero.ops.moe import ExpertWeights

    def facts(s13_bytes, s2_bytes):
        s13 = torch.tensor(s13_bytes, dtype=torch.uint8).view(1, 1, -1)
        s2 = torch.tensor(s2_bytes, dtype=torch.uint8).view(1, 1, -1)
        return scale_facts(ExpertWeights("mxfp4", None, None, s13, s2), s13, s2)

    assert facts([1, 127, 254], [100]) == (True, True)
    assert facts([1, 127, 128], [100]) == (False, True)
    assert facts([0, 127], [100]) == (False, False)
    assert facts([127], [255]) == (True, False)
    experts = ExpertWeights("mxfp4", None, None, None, None)
    ok = torch.full((1, 1, 2), 127, dtype=torch.uint8)
    assert scale_facts(experts, ok, ok) == (False, True)
    assert experts._dayzero_scale_facts[1] == (False, True)  # cached on the layer object
    ok[0, 0, 1] = 255  # changed in place (a weight reload): computed again
    assert scale_facts(experts, ok, ok) == (True, False)


@interpreter
def test_quantize_rows_interpreted():
    """Within 2^-14 of each 32-value block's largest |x| (exact for values within 2^6 of it); a NaN or
    infinity makes its block's factor NaN."""
    from dayzero.kernels.moe_decode import dequantize_rows, quantize_rows

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
    from dayzero.kernels.moe_decode import prep, quantize_rows
    from dayzero.kernels.moe_dispatch import dispatch_reference

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


@interpreter
def test_choose_decode_config():
    from dayzero.kernels.moe_decode import DECODE_MAX_ROWS_WGMMA, DecodeConfig, choose_decode_config

    assert choose_decode_config(1, 4, 128, 2880, 2880).block_m == 1
    assert choose_decode_config(32, 128, 128, 2880, 2880) is not None
    assert choose_decode_config(128, 512, 128, 2880, 2880) is None  # ~4 rows per active expert: tensor cores
    assert choose_decode_config(128, 768, 256, 4096, 2048) is not None  # ~3.2
    # where moe_wgmma runs, its 16-row blocks take over above 2.5 rows
    assert choose_decode_config(128, 768, 256, 4096, 2048, max_rows=DECODE_MAX_ROWS_WGMMA) is None
    assert choose_decode_config(32, 128, 128, 2880, 2880, max_rows=DECODE_MAX_ROWS_WGMMA) is not None  # ~1.6
    assert choose_decode_config(64, 256, 128, 2880, 2880, max_rows=DECODE_MAX_ROWS_WGMMA) is not None  # ~2.3
    one = choose_decode_config(1, 4, 128, 2880, 2880)  # 360 gate/up programs: K over 8 warps
    assert (one.block_n1, one.block_k1, one.num_warps1, one.stages1) == (32, 512, 8, 3)
    # the down GEMM: the hand prefetch's tiles loaded before the PDL wait; 360 programs fit 3 per SM
    assert (one.block_n2, one.block_k2, one.num_warps2, one.stages2, one.early2) == (32, 1024, 8, 0, True)
    assert one.pair_order and not one.early1
    one_v4 = choose_decode_config(1, 6, 256, 4096, 2048)  # 768 down programs: 4 warps each
    assert (one_v4.block_n2, one_v4.block_k2, one_v4.num_warps2, one_v4.stages2, one_v4.early2) == (32, 512, 4, 0, True)
    eight = choose_decode_config(8, 32, 128, 2880, 2880)  # thousands of programs: the pipelined loop
    assert (eight.block_m, eight.stages1, eight.stages2, eight.block_k1, eight.early2) == (1, 3, 3, 512, False)
    assert eight.pair_order
    many = choose_decode_config(32, 128, 128, 2880, 2880)
    assert (many.block_m, many.block_n2, many.block_k2, many.stages2) == (2, 64, 256, 3)
    assert not many.pair_order and not many.early2
    g = choose_decode_config(1, 4, 128, 2880, 2880, gluon=True)  # sm_90, one token: both GEMMs in Gluon
    assert g.gluon1 and (g.block_n1, g.block_k1, g.num_warps1, g.stages1, g.smem1) == (32, 256, 8, 3, True)
    assert g.gluon2 and (g.block_n2, g.block_k2, g.num_warps2, g.stages2, g.smem2, g.early2) == (32, 512, 8, 3, True,
                                                                                                 False)
    assert not choose_decode_config(8, 32, 128, 2880, 2880, gluon=True).gluon1  # from 8 tokens: Triton
    tiny = choose_decode_config(1, 2, 8, 64, 32, gluon=True)  # K = 64: the Gluon tiles do not fit
    assert not tiny.gluon1 and not tiny.gluon2
    with pytest.raises(ValueError, match="Gluon"):
        DecodeConfig(2, 32, 32, gluon1=True, stages1=3)  # sorted dispatch
    with pytest.raises(ValueError, match="Gluon"):
        DecodeConfig(1, 32, 32, pair_order=True, gluon2=True, stages2=0)


@interpreter
def test_choose_decode_config_split_k(monkeypatch):
    from dayzero.kernels.moe_decode import SPLITK_ENV, SPLITK_GATE_UP, choose_decode_config

    monkeypatch.setenv(SPLITK_ENV, "0")
    assert choose_decode_config(1, 4, 128, 2880, 2880).split_k1 == 1
    monkeypatch.setenv(SPLITK_ENV, "1")
    assert choose_decode_config(1, 4, 128, 2880, 2880).split_k1 == SPLITK_GATE_UP  # 360 programs unsplit
    assert choose_decode_config(1, 6, 256, 4096, 2048).split_k1 == SPLITK_GATE_UP
    assert choose_decode_config(8, 32, 128, 2880, 2880).split_k1 == 1  # 2610 programs
    assert choose_decode_config(1, 4, 128, 2880, 2880).split_k2 == 1
    monkeypatch.setenv(SPLITK_ENV, "8")
    assert choose_decode_config(1, 4, 128, 2880, 2880).split_k1 == 8
    monkeypatch.setenv(SPLITK_ENV, "yes")
    with pytest.raises(ValueError, match=SPLITK_ENV):
        choose_decode_config(1, 4, 128, 2880, 2880)


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
@pytest.mark.parametrize("tokens,block_m,tiles", [(1, 1, (32, 16, 256, 256)), (1, 1, (64, 16, 256, 1024, 8, 8)),
                                                  (5, 2, (64, 64, 128, 128, 8, 8)),
                                                  (17, 4, (32, 32, 256, 128)), (32, 4, (64, 64, 256, 256, 8, 4)),
                                                  (100, 4, (32, 32, 256, 256)),  # 100: dispatch(), not prep
                                                  (1, 1, (64, 16, 256, 1024, 8, 8, 4)),  # split K
                                                  (8, 1, (32, 32, 256, 512, 4, 4, 3, 3)),
                                                  (1, 1, (32, 16, 256, 512, 4, 4, 1, 1, 4, 3)),  # pipelined
                                                  (32, 2, (32, 64, 256, 256, 4, 4, 1, 1, 3, 3)),
                                                  # pair order, weights requested before the PDL waits
                                                  (1, 1, (32, 32, 512, 1024, 8, 8, 1, 1, 0, 0, True, True, True)),
                                                  (8, 1, (32, 32, 512, 512, 4, 4, 1, 1, 3, 0, True, False, True)),
                                                  (32, 2, (32, 64, 256, 256, 4, 4, 1, 1, 3, 0, False, False, True))])
def test_decode_layer_full_shapes_cuda(model, tokens, block_m, tiles, model_layers):  # noqa: F811
    """Forced decode tiles (the PTX byte permutes and dp4a) at full model shapes."""
    from dayzero import ops
    from dayzero.kernels.moe_decode import DecodeConfig
    from dayzero.ops import REGISTRY

    E, k, H, I, act, _ = MODELS[model]
    experts = model_layers(model)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen).to("cuda", torch.bfloat16)
    ids, w = random_routing(tokens, E, k, gen, "cuda")
    out = _run(x, ids, w, experts, act, DecodeConfig(block_m, *tiles))
    with REGISTRY.force_backend("reference"):
        ref = ops.moe_experts_mxfp4(x, ids, w, experts, act)
    assert out.isfinite().all()
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    assert rel_err(out, ref) < 1.5e-2


@cuda
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("tokens,gluon,tiles,smem", [
    (1, (True, True), (32, 16, 512, 1024, 8, 8, 2, 3), (False, False)),
    (1, (True, False), (32, 32, 256, 1024, 8, 8, 3, 0), (False, False)),
    (8, (False, True), (32, 32, 512, 512, 4, 4, 3, 2), (False, False)),
    (3, (True, True), (32, 32, 512, 512, 8, 4, 3, 3), (False, False)),
    (1, (True, True), (32, 32, 256, 512, 8, 8, 3, 3), (True, True)),  # the one-token default on sm_90
    (8, (True, True), (32, 16, 256, 1024, 8, 8, 4, 4), (True, True)),
    (5, (True, True), (32, 16, 512, 1024, 8, 8, 3, 4), (True, True))])
def test_decode_layer_gluon_cuda(model, tokens, gluon, tiles, smem, model_layers):  # noqa: F811
    """moe_decode_sm90's Gluon GEMMs (sm_90) at full model shapes, pair order: against the exact layer, the
    reference op and the Triton decode kernels on the same inputs (the same integer sums; only the float32
    order of the block sums may differ), with an invalid expert id in the routing."""
    from dayzero import ops
    from dayzero.kernels.moe_decode import DecodeConfig
    from dayzero.kernels.moe_decode_sm90 import available
    from dayzero.ops import REGISTRY

    if not available(torch.device("cuda")):
        pytest.skip("the Gluon decode kernels need an sm_90 device")
    E, k, H, I, act, _ = MODELS[model]
    experts = model_layers(model)
    gen = torch.Generator().manual_seed(tokens + 7)
    x = torch.randn(tokens, H, generator=gen).to("cuda", torch.bfloat16)
    ids, w = random_routing(tokens, E, k, gen, "cuda")
    n1, n2, k1, k2, w1, w2, s1, s2 = tiles
    early2 = s2 == 0
    cfg = DecodeConfig(1, n1, n2, k1, k2, w1, w2, stages1=s1, stages2=s2, pair_order=True, early2=early2,
                       gluon1=gluon[0], gluon2=gluon[1], smem1=smem[0], smem2=smem[1])
    out = _run(x, ids, w, experts, act, cfg)
    triton_cfg = DecodeConfig(1, 32, 32, 512, 512, 4, 4, stages1=3, stages2=3, pair_order=True)
    assert rel_err(out, _run(x, ids, w, experts, act, triton_cfg)) < 2e-3
    with REGISTRY.force_backend("reference"):
        ref = ops.moe_experts_mxfp4(x, ids, w, experts, act)
    assert out.isfinite().all()
    assert rel_err(out, exact(x, ids, w, experts, act)) < 1e-2
    assert rel_err(out, ref) < 1.5e-2
    bad = ids.clone()
    bad[0, 1] = -1  # no expert: the pair is skipped by both GEMMs and the combine
    assert rel_err(_run(x, bad, w, experts, act, cfg), _run(x, bad, w, experts, act, triton_cfg)) < 2e-3


@pytest.mark.parametrize("args", [["--k", "2880", "--gated", "--tile", "1x32x256x8"],
                                  ["--k", "2880", "--gated", "--tile", "1x32x512x4", "--stages", "3"],
                                  ["--k", "2048", "--tile", "2x64x256x4", "--stages", "3"]])
def test_decode_kernel_sass_for_sm90(args):
    """Compiled for sm_90 here (Triton's bundled ptxas, no GPU; tools/sass_moe_decode.py): nothing
    spills, the weight decode costs at most 4.5 PRMT and 4 dp4a per weight word per row (the offset
    bytes: two permutes per four codes), and the pipelined loop copies its tiles asynchronously
    (LDGSTS) into shared memory."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "tools" / "sass_moe_decode.py"), *args], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "stack (spills) 0 B" in out, out
    rows = int(args[args.index("--tile") + 1].split("x")[0])
    per_word = {op: float(v) for op, v in re.findall(r"([A-Z0-9]+) ([0-9.]+)", out.split("per word:")[1])}
    assert per_word["PRMT"] <= 4.5 and per_word["IDP"] == 4 * rows, out
    assert ("LDGSTS" in per_word) == ("--stages" in args), out


@pytest.mark.parametrize("args", [["--k", "2880", "--gated", "--tile", "32x256x8", "--stages", "3", "--smem"],
                                  ["--k", "2880", "--tile", "32x512x8", "--stages", "3", "--smem", "--normal"],
                                  ["--k", "4096", "--out", "2048", "--gated", "--tile", "32x512x8", "--stages", "2"]])
def test_gluon_decode_kernel_sass_for_sm90(args):
    """moe_decode_sm90's GEMMs compiled for sm_90 here (tools/sass_moe_decode_sm90.py, no GPU): nothing
    spills, 4 dp4a and at most 4.1 PRMT per weight word (prologue and epilogue included), the shared-memory
    ring filled by cp.async (LDGSTS) exactly when asked for, and the register variant free of CTA barriers
    in its K steps (one in the epilogue's reduction at most)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "tools" / "sass_moe_decode_sm90.py"), *args],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "stack (spills) 0 B" in out, out
    per_word = {op: float(v) for op, v in re.findall(r"([A-Z0-9]+) ([0-9.]+)", out.split("per word:")[1])}
    assert per_word["IDP"] == 4 and per_word["PRMT"] <= 4.1, out
    assert ("LDGSTS" in per_word) == ("--smem" in args), out
    barriers = int(re.search(r"CTA barriers (\d+)", out).group(1))
    if "--smem" not in args:
        assert barriers <= 1, out


@pytest.mark.parametrize("early", [False, True])
def test_decode_kernel_early_loads_precede_the_pdl_wait(early, tmp_path):
    """Compiled for sm_90 with the PDL wait (ACQBULK): with early, the weight tiles' 16-byte loads are
    issued before the wait; without it, no global load precedes the wait (tools/sass_moe_decode.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    dump = tmp_path / "kernel.sass"
    args = ["--k", "2880", "--tile", "1x32x1024x8", "--pdl", "--dump", str(dump)] + (["--early"] if early else [])
    run = subprocess.run([sys.executable, str(root / "tools" / "sass_moe_decode.py"), *args], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = dump.read_text().splitlines()
    wait = next(i for i, line in enumerate(lines) if "ACQBULK" in line)
    before = [line for line in lines[:wait] if "LDG.E.128" in line]
    if early:
        assert len(before) == 8, before  # two tiles: 32 rows x 1024 codes over 256 threads, 2 x 4 x 16 B each
    else:
        assert not [line for line in lines[:wait] if "LDG" in line]
