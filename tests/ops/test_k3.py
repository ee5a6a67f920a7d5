"""Kimi K3 mechanisms against their defining equations (there is no reference implementation in
transformers): Block Attention Residuals, SiTU, the latent MoE, the gated MLA output, the
compressed-tensors MXFP4 experts as loaded from a tiny K3-layout checkpoint, and its spec."""

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from dayzero import ops
from dayzero.formats import mxfp4
from dayzero.models.base import collect_weight_targets
from dayzero.models.k3_parts import (AttentionResidual, AttentionResidualState, CompressedTensorsMxfp4Experts,
                                     LatentMoE, MLAOutputGate)
from dayzero.ops.k3 import SituActivation
from dayzero.spec import load_spec
from tests.formats.oracles import mxfp4_values
from tests.models.kimi_k3_checkpoints import TEXT_PREFIX, build_kimi_k3_checkpoint

EPS = 1e-5


# -- attention_residual -----------------------------------------------------------------------


def attn_res_loop(candidates, query, norm, eps):
    """Per token, per candidate, float64: alpha = softmax_i(sum_d RMSNorm(v_i)[d] norm[d] w[d]), sum_i alpha_i v_i."""
    v = candidates.double().reshape(candidates.shape[0], -1, candidates.shape[-1])
    w = (norm.double() * query.double().reshape(-1)).tolist()
    out = torch.empty(v.shape[1:], dtype=torch.float64)
    for t in range(v.shape[1]):
        scores = []
        for i in range(v.shape[0]):
            row = v[i, t].tolist()
            rms = (sum(x * x for x in row) / len(row) + eps) ** 0.5
            scores.append(sum(x / rms * wd for x, wd in zip(row, w)))
        m = max(scores)
        e = [np.exp(s - m) for s in scores]
        alpha = [x / sum(e) for x in e]
        out[t] = sum(a * v[i, t] for i, a in enumerate(alpha))
    return out.reshape(candidates.shape[1:])


def attn_res_inputs(gen, n=4, shape=(3, 5), d=32, dtype=torch.float32):
    candidates = (torch.randn(n, *shape, d, generator=gen) * torch.rand(n, *shape, 1, generator=gen) * 3).to(dtype)
    query = (1.5 * torch.randn(1, d, generator=gen) / d ** 0.5).to(dtype)
    norm = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype)
    return candidates, query, norm


def test_attention_residual_matches_float64_loop():
    gen = torch.Generator().manual_seed(0)
    candidates, query, norm = attn_res_inputs(gen)
    out = ops.attention_residual(candidates, query, norm, EPS)
    assert out.shape == candidates.shape[1:] and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), attn_res_loop(candidates, query, norm, EPS), rtol=1e-5, atol=1e-5)
    # the mix is not trivial: neither uniform nor one-hot
    assert not torch.allclose(out, candidates.mean(0), atol=1e-2)


def test_attention_residual_bf16_rounds_the_float32_result():
    gen = torch.Generator().manual_seed(1)
    candidates, query, norm = attn_res_inputs(gen, dtype=torch.bfloat16)
    out = ops.attention_residual(candidates, query, norm, EPS)
    assert out.dtype == torch.bfloat16
    exact = attn_res_loop(candidates, query, norm, EPS)
    torch.testing.assert_close(out.double(), exact, rtol=8e-3, atol=1e-2)


def test_attention_residual_limiting_cases():
    gen = torch.Generator().manual_seed(2)
    candidates, query, norm = attn_res_inputs(gen, n=5)
    for dtype in (torch.float32, torch.bfloat16):  # one candidate: exactly that candidate
        one = candidates[:1].to(dtype)
        assert torch.equal(ops.attention_residual(one, query.to(dtype), norm.to(dtype), EPS), one[0])
    same = candidates[2].expand(5, *candidates.shape[1:])  # all equal: that candidate
    torch.testing.assert_close(ops.attention_residual(same, query, norm, EPS), candidates[2], rtol=1e-6, atol=1e-6)
    zero = torch.zeros_like(query)  # no preference: the plain mean
    torch.testing.assert_close(ops.attention_residual(candidates, zero, norm, EPS), candidates.mean(0), rtol=1e-6, atol=1e-6)
    perm = torch.randperm(5, generator=gen)  # a set, not a sequence
    torch.testing.assert_close(ops.attention_residual(candidates[perm], query, norm, EPS),
                               ops.attention_residual(candidates, query, norm, EPS), rtol=1e-6, atol=1e-6)
    # the fused vector w * g is what counts, and [D] equals [1, D]
    torch.testing.assert_close(ops.attention_residual(candidates, (query * norm)[0], torch.ones_like(norm), EPS),
                               ops.attention_residual(candidates, query, norm, EPS), rtol=1e-6, atol=1e-6)


def test_attention_residual_rejects_bad_shapes():
    c = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="query_weight"):
        ops.attention_residual(c, torch.randn(2, 8), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="norm_weight"):
        ops.attention_residual(c, torch.randn(8), torch.ones(7), EPS)
    with pytest.raises(ValueError, match="candidates"):
        ops.attention_residual(torch.randn(8), torch.randn(8), torch.ones(8), EPS)


# -- situ ---------------------------------------------------------------------------------------


def test_situ_matches_its_definition():
    gen = torch.Generator().manual_seed(3)
    g, u = torch.randn(4, 64, generator=gen) * 8, torch.randn(4, 64, generator=gen) * 40
    gd, ud = g.double(), u.double()
    expected = 4 * torch.tanh(gd / 4) / (1 + torch.exp(-gd)) * 25 * torch.tanh(ud / 25)
    torch.testing.assert_close(ops.situ(g, u, 4.0, 25.0).double(), expected, rtol=1e-5, atol=1e-5)
    no_up_cap = 4 * torch.tanh(gd / 4) / (1 + torch.exp(-gd)) * ud
    torch.testing.assert_close(ops.situ(g, u, 4.0, None).double(), no_up_cap, rtol=1e-5, atol=1e-4)
    out = ops.situ(g.bfloat16(), u.bfloat16(), 4.0, 25.0)
    assert out.dtype == torch.bfloat16


def test_situ_is_swiglu_for_small_inputs_and_bounded_for_large():
    gen = torch.Generator().manual_seed(4)
    g, u = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    errors = []
    for scale in (1e-1, 1e-2):  # tanh(z) = z - z^3/3: relative error ~ (g / beta)^2 / 3
        ref = torch.nn.functional.silu(scale * g.double()) * (scale * u.double())
        got = ops.situ((scale * g).double(), (scale * u).double(), 4.0, 25.0)
        errors.append(((got - ref).abs() / ref.abs().clamp(min=1e-30)).max().item())
    assert errors[1] < 5e-5 and errors[1] < errors[0] / 50  # quadratic in the input scale
    big = torch.tensor([1e4, -1e4, 1e4, 50.0])
    out = ops.situ(big, torch.tensor([1e4, 1e4, -1e4, 1e6]), 4.0, 25.0)
    assert out.abs().max() <= 4.0 * 25.0
    torch.testing.assert_close(out[:3], torch.tensor([100.0, -0.0, -100.0]))  # sigmoid kills large negative gates


def test_situ_rejects_bad_arguments():
    with pytest.raises(ValueError, match="same shape"):
        ops.situ(torch.randn(3), torch.randn(4), 4.0, 25.0)
    with pytest.raises(ValueError, match="beta"):
        ops.situ(torch.randn(3), torch.randn(3), 0.0, 25.0)


def test_situ_activation_drives_the_expert_ops():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 32, generator=gen)
    w13, w2 = torch.randn(3, 16, 32, generator=gen) / 4, torch.randn(3, 32, 8, generator=gen) / 3
    ids = torch.tensor([[0, 2]] * 6)
    weights = torch.rand(6, 2, generator=gen)
    out = ops.moe_experts_bf16(x, ids, weights, ops.ExpertWeights("bf16", w13, w2), SituActivation(beta=4.0, linear_beta=25.0))
    expected = torch.zeros(6, 32, dtype=torch.float64)
    for t in range(6):
        for k in range(2):
            e = int(ids[t, k])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            act = 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * 25 * torch.tanh(up / 25)
            expected[t] += weights[t, k].double() * (w2[e].double() @ act)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


# -- module parts --------------------------------------------------------------------------------


def random_mxfp4_experts(gen, num, inter, k):
    experts = CompressedTensorsMxfp4Experts(num, inter, k)
    for name, (n, kk) in {"w13": (2 * inter, k), "w2": (k, inter)}.items():
        blocks, scales = mxfp4.quantize(torch.randn(num, n, kk, generator=gen) / kk ** 0.5 * 2)
        getattr(experts, name).data.copy_(blocks)
        getattr(experts, name + "_scale").data.copy_(scales)
    return experts


def fill_linear(linear, value):
    linear.weight.data.copy_(value)


def test_latent_moe_with_identity_projections_is_a_plain_moe():
    gen = torch.Generator().manual_seed(6)
    experts = random_mxfp4_experts(gen, 4, 32, 64)
    act = SituActivation()
    moe = LatentMoE(64, 64, experts, act, use_norm=False, eps=EPS)
    fill_linear(moe.routed_expert_down_proj, torch.eye(64))
    fill_linear(moe.routed_expert_up_proj, torch.eye(64))
    x = torch.randn(5, 64, generator=gen)
    ids = torch.randint(0, 4, (5, 2), generator=gen)
    weights = torch.rand(5, 2, generator=gen)
    torch.testing.assert_close(moe(x, ids, weights), ops.moe_experts_mxfp4(x, ids, weights, experts.experts(), act),
                               rtol=1e-6, atol=1e-6)


def test_latent_moe_matches_float64_formulation():
    gen = torch.Generator().manual_seed(7)
    hidden, latent, inter = 64, 32, 32
    experts = random_mxfp4_experts(gen, 4, inter, latent)
    moe = LatentMoE(hidden, latent, experts, SituActivation(), use_norm=True, eps=EPS)
    down, up = torch.randn(latent, hidden, generator=gen) / 8, torch.randn(hidden, latent, generator=gen) / 6
    norm = 1 + 0.2 * torch.randn(latent, generator=gen)
    fill_linear(moe.routed_expert_down_proj, down)
    fill_linear(moe.routed_expert_up_proj, up)
    moe.routed_expert_norm.weight.data.copy_(norm)
    x = torch.randn(5, hidden, generator=gen)
    ids = torch.randint(0, 4, (5, 2), generator=gen)
    weights = torch.rand(5, 2, generator=gen)

    w13 = torch.from_numpy(mxfp4_values(experts.w13.numpy(), experts.w13_scale.numpy()))
    w2 = torch.from_numpy(mxfp4_values(experts.w2.numpy(), experts.w2_scale.numpy()))
    expected = torch.empty(5, hidden, dtype=torch.float64)
    for t in range(5):
        z = down.double() @ x[t].double()
        y = torch.zeros(latent, dtype=torch.float64)
        for k in range(2):
            e = int(ids[t, k])
            gate, upv = (w13[e] @ z).chunk(2)
            act = 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * 25 * torch.tanh(upv / 25)
            y += weights[t, k].double() * (w2[e] @ act)
        y = y / torch.sqrt((y * y).mean() + EPS) * norm.double()  # norm after the expert sum
        expected[t] = up.double() @ y
    torch.testing.assert_close(moe(x, ids, weights).double(), expected, rtol=1e-4, atol=1e-5)


def test_mla_output_gate():
    gen = torch.Generator().manual_seed(8)
    gate = MLAOutputGate(32, 48, bias=True)
    gate.weight.data.copy_(torch.randn(48, 32, generator=gen) / 6)
    gate.bias.data.fill_(1e4)  # sigmoid(+huge) = 1: the identity
    o, x = torch.randn(2, 3, 48, generator=gen), torch.randn(2, 3, 32, generator=gen)
    assert torch.equal(gate(o, x), o)
    gate.bias.data.normal_(generator=gen)
    expected = o.double() / (1 + torch.exp(-(x.double() @ gate.weight.double().T + gate.bias.double())))
    torch.testing.assert_close(gate(o, x).double(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="attention output"):
        gate(torch.randn(2, 3, 47), x)


def test_attention_residual_module_loads_the_checkpoint_stems():
    layer = nn.Module()
    layer.self_attention_res = AttentionResidual(16, EPS)
    layer.mlp_res = AttentionResidual(16, EPS)
    targets = collect_weight_targets(layer, "model.layers.3.")
    assert sorted(targets) == [f"model.layers.3.{s}_{p}.weight" for s in ("mlp_res", "self_attention_res")
                               for p in ("norm", "proj")]
    assert targets["model.layers.3.mlp_res_proj.weight"].spec.shape == (1, 16)
    gen = torch.Generator().manual_seed(9)
    norm, proj = 1 + torch.randn(16, generator=gen) / 5, torch.randn(1, 16, generator=gen) / 4
    targets["model.layers.3.mlp_res_norm.weight"].assign(norm)
    targets["model.layers.3.mlp_res_proj.weight"].assign(proj)
    cands = [torch.randn(2, 16, generator=gen) for _ in range(3)]
    torch.testing.assert_close(layer.mlp_res(cands), attn_res_loop(torch.stack(cands), proj, norm, EPS).float(),
                               rtol=1e-5, atol=1e-5)


class RecordingMix:
    """A stand-in mixing point that records the candidate set it is given and returns its sum."""

    def __init__(self):
        self.seen = []

    def __call__(self, candidates):
        self.seen.append(candidates.clone())
        return candidates.sum(0)


@pytest.mark.parametrize("num_layers, block", [(6, 2), (7, 3), (5, 1), (4, 12)])
def test_attention_residual_state_candidates(num_layers, block):
    """Candidate sets of every mixing point vs the definition: the embedding, every completed block
    (the sum of the attention and MLP outputs of `block` layers), and the current partial block."""
    gen = torch.Generator().manual_seed(10)
    emb = torch.randn(3, 8, generator=gen)
    outputs = [torch.randn(3, 8, generator=gen) for _ in range(2 * num_layers)]  # attn_0, mlp_0, attn_1, ...
    mix = RecordingMix()
    state = AttentionResidualState(emb, block)
    for layer in range(num_layers):
        state.attention_input(mix, layer)
        state.add(outputs[2 * layer])
        state.mlp_input(mix)
        state.add(outputs[2 * layer + 1])
    state.output(mix)

    def expected(done):  # candidates after `done` sublayer outputs, before the next sublayer
        per_block = 2 * block
        full, rest = divmod(done, per_block)
        blocks = [emb] + [sum(outputs[b * per_block:(b + 1) * per_block]) for b in range(full)]
        if rest:
            return blocks + [sum(outputs[full * per_block:done])]
        return blocks if done else [emb]

    sites = [2 * layer for layer in range(num_layers)] + [2 * layer + 1 for layer in range(num_layers)] + [2 * num_layers]
    for seen, done in zip(mix.seen, sorted(sites)):
        want = torch.stack(expected(done))
        assert seen.shape == want.shape, (done, seen.shape, want.shape)
        torch.testing.assert_close(seen, want, rtol=1e-6, atol=1e-6)
    assert max(s.shape[0] for s in mix.seen) == -(-num_layers // block) + 1


# -- the tiny K3 checkpoint ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k3_checkpoint(tmp_path_factory):
    return build_kimi_k3_checkpoint(tmp_path_factory.mktemp("kimi_k3"))


def test_load_spec_reports_k3_features(k3_checkpoint):
    spec = load_spec(k3_checkpoint)
    assert (spec.model_type, spec.text_model_type) == ("kimi_k3", "kimi_linear")
    assert [a for a, _ in spec.layer_kinds()] == ["kda", "kda", "kda", "mla", "kda", "mla"]
    assert [m for _, m in spec.layer_kinds()] == ["dense"] + ["moe"] * 5
    assert spec.cross_layer.kind == "attention_residual" and spec.cross_layer.attn_res_block_size == 2
    e = spec.experts
    assert (e.format, e.num, e.top_k, e.latent_dim, e.latent_norm, e.input_dim) == ("mxfp4", 8, 2, 64, True, 64)
    assert spec.quant.method == "compressed-tensors" and spec.quant.dense_format == "bf16"
    act = spec.layers[1].mlp.activation
    assert (act.kind, act.beta, act.linear_beta) == ("situ", 4.0, 25.0)
    assert spec.layers[3].attention.output_gate == "sigmoid" and spec.layers[3].attention.nope
    kda = spec.layers[0].attention
    assert (kda.output_gate, kda.gate_lower_bound) == ("full_rank", -5.0)
    assert spec.vision is None


def test_mxfp4_experts_load_from_the_checkpoint(k3_checkpoint):
    layer = 2
    spec = load_spec(k3_checkpoint)
    e = spec.experts
    moe = nn.Module()
    moe.experts = CompressedTensorsMxfp4Experts(e.num, e.intermediate_size, e.input_dim)
    prefix = f"{TEXT_PREFIX}model.layers.{layer}.block_sparse_moe."
    targets = collect_weight_targets(moe, prefix)
    with safe_open(str(k3_checkpoint / "model.safetensors"), "pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix + "experts.")}
    assert sorted(targets) == sorted(on_disk)  # every expert tensor, nothing else
    for name, target in targets.items():
        tensor = on_disk[name]
        assert target.spec.shape == tuple(tensor.shape) and target.spec.dtype_matches(tensor.dtype), name
        target.assign(tensor)

    weights = moe.experts.experts()
    inter = e.intermediate_size
    for j in range(e.num):
        base = f"{prefix}experts.{j}."
        gate, up, down = (mxfp4.dequantize_compressed_tensors(on_disk[f"{base}{w}.weight_packed"], on_disk[f"{base}{w}.weight_scale"],
                                                              dtype=torch.float32) for w in ("w1", "w3", "w2"))
        w13, w2 = weights.dequantize(j, torch.float32)
        assert torch.equal(w13[:inter], gate) and torch.equal(w13[inter:], up) and torch.equal(w2, down)
        # and independently of dayzero's decoder: ml_dtypes float4_e2m1fn / float8_e8m0fnu
        for w, ours in (("w1", w13[:inter]), ("w3", w13[inter:]), ("w2", w2)):
            packed = on_disk[f"{base}{w}.weight_packed"].numpy()
            scale = on_disk[f"{base}{w}.weight_scale"].numpy()
            oracle = mxfp4_values(packed.reshape(*packed.shape[:-1], -1, 16), scale)
            np.testing.assert_array_equal(ours.double().numpy(), oracle)
    assert weights.w13.dtype == torch.uint8 and weights.w13.shape == (e.num, 2 * inter, e.input_dim // 32, 16)


def test_mxfp4_experts_reject_misaligned_dims():
    with pytest.raises(ValueError, match="multiple of 32"):
        CompressedTensorsMxfp4Experts(4, 48, 64)


def test_checkpoint_tensor_dtypes_are_as_published(k3_checkpoint):
    with safe_open(str(k3_checkpoint / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        dtypes = {k: f.get_slice(k).get_dtype() for k in names}
    assert all(k.startswith(TEXT_PREFIX) for k in names)
    p = TEXT_PREFIX + "model.layers."
    assert dtypes[p + "0.self_attn.A_log"] == "F32" and dtypes[p + "0.self_attn.q_conv1d.weight"] == "F32"
    assert dtypes[p + "1.block_sparse_moe.gate.e_score_correction_bias"] == "F32"
    assert dtypes[p + "1.self_attention_res_proj.weight"] == "BF16"
    assert dtypes[p + "1.block_sparse_moe.experts.0.w1.weight_scale"] == "U8"
    assert p + "0.mlp.gate_proj.weight" in dtypes and p + "0.block_sparse_moe.gate_proj.weight" not in dtypes
    assert not any(k.endswith(("g_a_proj.weight", "g_b_proj.weight")) for k in names)
    assert TEXT_PREFIX + "model.output_attn_res_proj.weight" in dtypes
