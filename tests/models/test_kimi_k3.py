"""Kimi K3's text tower (kimi_linear + K3 fields) on a tiny checkpoint in the published layout.

transformers has no K3 yet, so the whole forward is checked against `_oracle`, a plain-torch
transcription of the published modeling code's K3 paths written independently of the model file
(expanded MLA with a causal mask, transformers' own KDA fallbacks, per-token expert loops on
dequantized weights, the block-residual list of `KimiDecoderLayer._forward_attn_residual`).
Plain kimi_linear against transformers is tests/models/test_kimi_linear.py.
"""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dayzero.formats import mxfp4
from dayzero.models import load_model
from dayzero.models.k3_parts import CompressedTensorsMxfp4Experts
from dayzero.ops import REGISTRY
from dayzero.ops.requirements import model_ops
from dayzero.spec import UnsupportedModelError
from tests.models.kimi_k3_checkpoints import TEXT_PREFIX, build_kimi_k3_checkpoint
from tests.models.kimi_linear_checkpoints import GENERATE, positions, prompt, rel_err


@pytest.fixture(autouse=True)
def _private_rng():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_kimi_k3_checkpoint(tmp_path_factory.mktemp("kimi_k3"))


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, dtype=torch.float32, progress=False)


# -- an independent K3 forward ------------------------------------------------------------------


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _situ(g, u, beta, linear_beta):
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * linear_beta * torch.tanh(u / linear_beta)


def _apply_attn_res(prefix_sum, blocks, proj, norm, eps):
    """The published _apply_attn_res: softmax over [blocks..., prefix_sum] of proj . RMSNorm(v)."""
    values = torch.stack(blocks + [prefix_sum])
    scores = (_rms(values, norm, eps) * proj[0]).sum(-1)
    return (scores.softmax(0)[..., None] * values).sum(0)


@torch.no_grad()
def _oracle(path, ids):
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    import json
    cfg = json.loads((path / "config.json").read_text())["text_config"]
    raw = load_file(path / "model.safetensors")
    w = {k[len(TEXT_PREFIX):]: v.float() for k, v in raw.items() if not k.endswith(("weight_packed", "weight_scale"))}
    eps, lac = cfg["rms_norm_eps"], cfg["linear_attn_config"]
    heads_kda, d = lac["num_heads"], lac["head_dim"]
    kda_layers = {i - 1 for i in lac["kda_layers"]}
    beta_s, lbeta_s = cfg["activation_situ_beta"], cfg["activation_situ_linear_beta"]
    b, t = ids.shape

    def expert(p, j, x):
        deq = {n: mxfp4.dequantize_compressed_tensors(raw[f"{TEXT_PREFIX}{p}experts.{j}.{n}.weight_packed"],
                                                      raw[f"{TEXT_PREFIX}{p}experts.{j}.{n}.weight_scale"], torch.float32)
               for n in ("w1", "w2", "w3")}
        return _situ(x @ deq["w1"].T, x @ deq["w3"].T, beta_s, lbeta_s) @ deq["w2"].T

    def mlp(p, x):
        return _situ(x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T, beta_s, lbeta_s) @ w[p + "down_proj.weight"].T

    def moe(p, x):
        flat = x.reshape(-1, x.shape[-1])
        scores = (flat @ w[p + "gate.weight"].T).sigmoid()
        idx = (scores + w[p + "gate.e_score_correction_bias"]).topk(cfg["num_experts_per_token"], dim=-1).indices
        weight = scores.gather(1, idx)
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20) * cfg["routed_scaling_factor"]
        z = flat @ w[p + "routed_expert_down_proj.weight"].T
        y = torch.zeros_like(z)
        for n in range(flat.shape[0]):
            for k in range(idx.shape[1]):
                y[n] += weight[n, k] * expert(p, int(idx[n, k]), z[n])
        y = _rms(y, w[p + "routed_expert_norm.weight"], eps) @ w[p + "routed_expert_up_proj.weight"].T
        return y.view(x.shape) + mlp(p + "shared_experts.", x)

    def kda(p, x):
        def conv(n):
            y = x @ w[p + f"{n}_proj.weight"].T
            kernel = w[p + f"{n}_conv1d.weight"]
            return F.silu(F.conv1d(y.transpose(1, 2), kernel, padding=kernel.shape[-1] - 1, groups=y.shape[-1])[..., :t]).transpose(1, 2)

        q, k, v = (conv(n).reshape(b, t, heads_kda, d) for n in "qkv")
        raw_g = (x @ w[p + "f_a_proj.weight"].T @ w[p + "f_b_proj.weight"].T + w[p + "dt_bias"]).view(b, t, heads_kda, d)
        g = lac["gate_lower_bound"] * torch.sigmoid(w[p + "A_log"][:heads_kda].exp()[:, None] * raw_g)
        beta = torch.sigmoid(x @ w[p + "b_proj.weight"].T)
        o, _ = chunk_kimi_delta_attention(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        gate = (x @ w[p + "g_proj.weight"].T).view(b, t, heads_kda, d)
        o = _rms(o, w[p + "o_norm.weight"], eps) * torch.sigmoid(gate)
        return o.reshape(b, t, -1) @ w[p + "o_proj.weight"].T

    def mla(p, x):
        h, dn, dr, dv, c = (cfg[f] for f in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
        q = _rms(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], 1e-6) @ w[p + "q_b_proj.weight"].T
        q = q.view(b, t, h, dn + dr).transpose(1, 2)
        kv = x @ w[p + "kv_a_proj_with_mqa.weight"].T
        kvb = (_rms(kv[..., :c], w[p + "kv_a_layernorm.weight"], 1e-6) @ w[p + "kv_b_proj.weight"].T).view(b, t, h, dn + dv).transpose(1, 2)
        keys = torch.cat([kvb[..., :dn], kv[:, None, :, c:].expand(b, h, t, dr)], -1)
        att = (q @ keys.transpose(-1, -2)) * (dn + dr) ** -0.5
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        o = (att @ kvb[..., dn:]).transpose(1, 2).reshape(b, t, h * dv)
        o = o * torch.sigmoid(x @ w[p + "g_proj.weight"].T)
        return o @ w[p + "o_proj.weight"].T

    hidden = w["model.embed_tokens.weight"][ids]
    blocks, prefix_sum = [], hidden
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _apply_attn_res(prefix_sum, blocks, w[p + "self_attention_res_proj.weight"], w[p + "self_attention_res_norm.weight"], eps) if blocks else prefix_sum
        if i % cfg["attn_res_block_size"] == 0:
            blocks, prefix_sum = blocks + [prefix_sum], None
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        out = (kda if i in kda_layers else mla)(p + "self_attn.", x)
        prefix_sum = out if prefix_sum is None else prefix_sum + out
        h = _apply_attn_res(prefix_sum, blocks, w[p + "mlp_res_proj.weight"], w[p + "mlp_res_norm.weight"], eps)
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        prefix_sum = prefix_sum + (mlp(p + "mlp.", x) if i < cfg["first_k_dense_replace"] else moe(p + "block_sparse_moe.", x))
    h = _apply_attn_res(prefix_sum, blocks, w["model.output_attn_res_proj.weight"], w["model.output_attn_res_norm.weight"], eps)
    return _rms(h, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


# -- tests ----------------------------------------------------------------------------------------


def test_k3_experts_stay_packed_and_equal_the_on_disk_weights(checkpoint, model):
    raw = load_file(checkpoint / "model.safetensors")
    moe_layers = [i for i, layer in enumerate(model.model.layers) if layer.moe]
    assert moe_layers
    for i in moe_layers:
        experts = model.model.layers[i].block_sparse_moe.routed.experts
        assert isinstance(experts, CompressedTensorsMxfp4Experts) and experts.w13.dtype == torch.uint8
        inter = experts.intermediate
        for j in range(experts.num):
            disk = {n: mxfp4.dequantize_compressed_tensors(
                raw[f"{TEXT_PREFIX}model.layers.{i}.block_sparse_moe.experts.{j}.{n}.weight_packed"],
                raw[f"{TEXT_PREFIX}model.layers.{i}.block_sparse_moe.experts.{j}.{n}.weight_scale"], torch.float32)
                for n in ("w1", "w2", "w3")}
            w13 = mxfp4.dequantize(experts.w13[j], experts.w13_scale[j], torch.float32)
            w2 = mxfp4.dequantize(experts.w2[j], experts.w2_scale[j], torch.float32)
            assert torch.equal(w13[:inter], disk["w1"]) and torch.equal(w13[inter:], disk["w3"])
            assert torch.equal(w2, disk["w2"])


@pytest.mark.parametrize("length", (5, 70))
def test_k3_logits_match_the_independent_forward(checkpoint, model, length):
    ids = prompt(2, length, seed=5)
    with torch.no_grad():
        got = model(ids, positions(ids))
    err = rel_err(got, _oracle(checkpoint, ids))
    print(f"K3 max relative logits error vs the oracle, prompt {length}: {err:.2e}")
    assert err <= 1e-4


def test_k3_prefill_decode_and_chunked_prefill_equal_one_forward(model):
    """The float32 chunked KDA form and the token recurrence round differently (~1e-6 per layer);
    six layers of K3 keep the difference below 1e-4 of the logits."""
    ids = prompt(2, 150, seed=6)
    with torch.no_grad():
        full = model(ids, positions(ids))
        cache = model.new_cache(2)
        steps = [model(ids[:, :100], positions(ids[:, :100]), cache)]
        steps += [model(ids[:, i:i + 1], positions(ids[:, i:i + 1], i), cache) for i in range(100, 150)]
        chunked_cache, pieces, start = model.new_cache(2), [], 0
        for size in (7, 1, 64, 78):
            piece = ids[:, start:start + size]
            pieces.append(model(piece, positions(piece, start), chunked_cache))
            start += size
    decode_err, chunk_err = rel_err(torch.cat(steps, 1), full), rel_err(torch.cat(pieces, 1), full)
    print(f"K3 prefill+decode vs one forward: {decode_err:.2e}; chunked prefill: {chunk_err:.2e}")
    assert decode_err <= 1e-4 and chunk_err <= 1e-4
    assert cache.length == 150 and (0, "recurrent") in cache.storage.states and (3, "kv_latent") in cache.storage.specs


@pytest.mark.parametrize("length", (5, 150))
def test_k3_generates_greedily_with_the_cache_as_with_full_forwards(model, length):
    ids = prompt(1, length, seed=7)
    cache, seq, tokens = model.new_cache(1), ids, []
    with torch.no_grad():
        logits = model(ids, positions(ids), cache)[:, -1]
        for _ in range(GENERATE):
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(nxt)
            seq = torch.cat([seq, nxt], 1)
            logits = model(nxt, positions(nxt, cache.length), cache)[:, -1]
        full = model(seq[:, :-1], positions(seq[:, :-1]))[:, length - 1:]
    assert torch.equal(torch.cat(tokens, 1), full.argmax(-1))
    assert len(set(torch.cat(tokens, 1)[0].tolist())) > 1


def test_k3_bfloat16_runs_close_to_float32(checkpoint, model):
    """bf16 rounds the residual stream (~4% of the tiny model's hidden states by layer 1); with 8
    experts and top-2 routing a few percent of tokens then pick another expert, which moves their
    outputs entirely (as transformers' own bf16 would): most positions stay close, most argmaxes agree."""
    ours16 = load_model(checkpoint, dtype=torch.bfloat16, progress=False)
    assert ours16.model.layers[1].block_sparse_moe.routed.experts.w13.dtype == torch.uint8
    ids = prompt(2, 40, seed=8)
    with torch.no_grad():
        got, want = ours16(ids, positions(ids)), model(ids, positions(ids))
    assert torch.isfinite(got).all()
    per_position = (got - want).abs().amax(-1) / want.abs().amax(-1)
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    print(f"K3 bf16 vs float32: median per-position error {float(per_position.median()):.2e}, argmax agreement {agree:.2f}")
    assert float(per_position.median()) <= 1e-1 and agree >= 0.75


def test_k3_model_calls_exactly_the_ops_inspect_declares(model):
    with REGISTRY.record_calls() as calls, torch.no_grad():
        ids = prompt(1, 70, seed=9)
        cache = model.new_cache(1)
        model(ids, positions(ids), cache)
        model(ids[:, :1], torch.tensor([[70]]), cache)
    declared = set(model_ops(model.spec))
    assert set(calls) <= declared, f"called but not declared: {sorted(set(calls) - declared)}"
    assert declared <= set(calls), f"declared but never called: {sorted(declared - set(calls))}"


FEATURE_OFF = {  # id: (text_config overrides, what the model then looks like; layers: 0 KDA dense, 1 KDA MoE, 3 MLA)
    "no_attn_res": (dict(attn_res_block_size=None),
                    lambda m: m.attn_res_block is None and not hasattr(m.model, "output_attn_res")
                    and not hasattr(m.model.layers[1], "mlp_res")),
    "no_latent": (dict(routed_expert_hidden_size=None),
                  lambda m: not hasattr(m.model.layers[1].block_sparse_moe, "routed")
                  and m.model.layers[1].block_sparse_moe.experts.input_dim == 128),
    "no_latent_norm": (dict(latent_moe_use_norm=False),
                       lambda m: m.model.layers[1].block_sparse_moe.routed.routed_expert_norm is None),
    "no_mla_gate": (dict(mla_use_output_gate=False), lambda m: m.model.layers[3].self_attn.g_proj is None),
    "silu": (dict(hidden_act="silu"), lambda m: m.model.layers[0].mlp.activation.kind == "swiglu"
             and m.model.layers[1].block_sparse_moe.activation.kind == "swiglu"),
    "plain_kda_gate": (dict(linear_attn_config={"gate_lower_bound": None}),
                       lambda m: m.model.layers[0].self_attn.lower_bound is None),
}


@pytest.mark.parametrize("feature", sorted(FEATURE_OFF))
def test_each_k3_feature_follows_its_config_field(tmp_path, feature):
    """Without its field, a K3 feature is absent (its tensors are not expected) and the model still runs."""
    overrides, looks_plain = FEATURE_OFF[feature]
    model = load_model(build_kimi_k3_checkpoint(tmp_path, **overrides), dtype=torch.float32, progress=False)
    assert looks_plain(model)
    ids = prompt(1, 20, seed=10)
    with torch.no_grad():
        full = model(ids, positions(ids))
        cache = model.new_cache(1)
        model(ids[:, :19], positions(ids[:, :19]), cache)
        last = model(ids[:, 19:], positions(ids[:, 19:], 19), cache)
    assert torch.isfinite(full).all() and rel_err(last, full[:, 19:]) <= 1e-4


def test_k3_refuses_int4_experts(tmp_path):
    import json

    path = build_kimi_k3_checkpoint(tmp_path)
    config = json.loads((path / "config.json").read_text())
    qc = config["text_config"]["quantization_config"]
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "pack-quantized"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="quantization_config.format"):
        load_model(path, dtype=torch.float32, progress=False)
