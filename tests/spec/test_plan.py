"""Plans for the published full-size configs against the published numbers, and the formulas."""

from __future__ import annotations

import pytest

from dayzero.plan import (
    GIB, WorkspacePolicy, active_params, bytes_per_param, expert_params, expert_workspace_bytes, kda_state_bytes,
    layer_cache, memory_plan, total_params,
)
from dayzero.spec import load_spec

from .fullsize_configs import PUBLISHED, config


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_params_near_published(name):
    cfg, total, active = PUBLISHED[name]
    spec = load_spec(cfg)
    assert total_params(spec) == pytest.approx(total, rel=0.03)
    assert active_params(spec) == pytest.approx(active, rel=0.05)


def test_layer_patterns_of_published_configs():
    pro = load_spec(config("deepseek-v4-pro"))
    kinds = [k for k, _ in pro.layer_kinds()]
    assert kinds[:4] == ["hca", "hca", "csa", "hca"] and len(kinds) == 61 and kinds[-1] == "csa"
    assert [m for _, m in pro.layer_kinds()][:4] == ["hash_moe"] * 3 + ["moe"]
    flash = load_spec(config("deepseek-v4-flash"))
    assert [k for k, _ in flash.layer_kinds()][:4] == ["swa", "swa", "csa", "hca"]
    k3 = load_spec(config("kimi-k3"))
    kinds = [k for k, _ in k3.layer_kinds()]
    assert kinds.count("mla") == 24 and kinds.count("kda") == 69
    assert kinds[3] == "mla" and kinds[91:] == ["mla", "mla"]
    v3 = load_spec(config("deepseek-v3"))
    assert [m for _, m in v3.layer_kinds()] == ["dense"] * 3 + ["moe"] * 58


def test_kimi_k3_kda_state_is_about_0_4_gib():
    spec = load_spec(config("kimi-k3"))
    state = kda_state_bytes(spec)
    # 69 layers x (96 heads x 128 x 128 x 4 B recurrent + 3 x 12288 x 3 x 2 B conv)
    assert state == 69 * (96 * 128 * 128 * 4 + 3 * 12288 * 3 * 2)
    assert state / GIB == pytest.approx(0.4, abs=0.03)


def test_cache_entry_sizes():
    """What the paged storage allocates (bf16, blocks of 16 tokens; dayzero/cache/layout.py)."""
    v3 = load_spec(config("deepseek-v3")).layers[0].attention
    assert layer_cache(v3, "bf16").per_token == 576 * 2
    assert layer_cache(v3, "fp8").per_token == 512 + 4 * 4 + 64 + 4  # e4m3 + an fp32 scale per 128, rope too
    v32 = load_spec(config("deepseek-v3.2")).layers[0].attention
    assert layer_cache(v32, "bf16").per_token == 576 * 2 + 128 * 2  # + indexer K
    assert layer_cache(v32, "fp8").per_token == 596 + 128 + 4
    oss = load_spec(config("gpt-oss-120b"))
    swa, full = oss.layers[0].attention, oss.layers[1].attention
    assert layer_cache(full).per_token == 2 * 8 * 64 * 2
    # a window of 128 holds the blocks of its last 127 tokens and the next one's: 9 blocks of 16
    assert layer_cache(swa).per_token == 0 and layer_cache(swa).fixed == 9 * 16 * 2 * 8 * 64 * 2
    pro = load_spec(config("deepseek-v4-pro"))
    hca, csa = pro.layers[0].attention, pro.layers[2].attention
    assert layer_cache(hca).per_token == 1024 / 16  # one 128-token entry per 16-token block
    assert layer_cache(csa).per_token == 1024 / 4 + 256 / 4  # compressed entries + indexer keys, ratio 4
    compressor = 4 * 4 * 2 * 512 * 2 + 4 * 4 * 2 * 128 * 2  # pending + prev kv/gate of both compressors
    assert layer_cache(csa).fixed == 9 * 16 * 1024 + compressor


def test_bytes_per_param():
    assert bytes_per_param("bf16") == 2
    assert bytes_per_param("mxfp4") == pytest.approx(0.53125)
    assert bytes_per_param("fp8") == pytest.approx(1 + 4 / 128**2)
    assert bytes_per_param("fp8", scale_fmt="ue8m0") == pytest.approx(1 + 1 / 128**2)
    assert bytes_per_param("int4") == pytest.approx(0.5625)


def test_expert_workspace_policy():
    spec = load_spec(config("gpt-oss-120b"))
    one = 3 * 2880 * 2880 + 4 * (2 * 2880 * 23 + 2880 * 23)  # 2880 = 22.5 x 128: 23 scales per row
    assert expert_workspace_bytes(spec, 1, WorkspacePolicy(max_tokens_per_step=1)) == pytest.approx(4 * one)
    assert expert_workspace_bytes(spec, 1) == pytest.approx(128 * one)  # 4 x 8192 > 128 experts
    assert expert_workspace_bytes(spec, 8) == pytest.approx(16 * one)  # local experts only
    assert expert_workspace_bytes(spec, 1, WorkspacePolicy(max_tokens_per_step=4, buffers=2)) == pytest.approx(32 * one)
    assert expert_workspace_bytes(load_spec(config("deepseek-v3")), 1) == 0  # FP8 experts need no conversion


@pytest.mark.parametrize("name", ["gpt-oss-120b", "deepseek-v4-flash"])
def test_planned_workspace_holds_every_expert_in_the_kernels_slot_layout(name):
    from dayzero.kernels.moe import expert_slot_bytes

    spec = load_spec(config(name))
    e = spec.experts
    assert expert_workspace_bytes(spec, 1) // expert_slot_bytes(e.intermediate_size, spec.hidden_size) == e.num


def test_gpt_oss_120b_fits_one_h200():
    plan = memory_plan(load_spec(config("gpt-oss-120b")), gpus=1, gpu_mem_gib=141, context=131072)
    assert 55 < plan.weights_gib < 66  # ~60.8 GiB checkpoint
    assert plan.context_fits and plan.context_limit == 131072
    assert plan.max_context_tokens > 131072


def test_kimi_k3_needs_more_than_eight_h200():
    spec = load_spec(config("kimi-k3"))
    assert memory_plan(spec, gpus=8, gpu_mem_gib=141).max_context_tokens == 0
    plan16 = memory_plan(spec, gpus=16, gpu_mem_gib=141, context=1048576)
    assert plan16.context_fits and plan16.context_limit == 1048576


def test_context_fit_formula():
    spec = load_spec(config("deepseek-v3"))
    plan = memory_plan(spec, gpus=8, gpu_mem_gib=141, activation_reserve_gib=8)
    free = 141 * GIB - plan.weights_gib * GIB / 8 - 8 * GIB
    assert plan.max_context_tokens == int(8 * free // (61 * 1152))
    assert plan.context_limit == 163840
    fp8 = memory_plan(spec, gpus=8, gpu_mem_gib=141, kv_dtype="fp8")
    assert fp8.max_context_tokens > plan.max_context_tokens


def test_window_layers_do_not_grow():
    spec = load_spec(config("gpt-oss-120b"))
    plan = memory_plan(spec, gpus=1, gpu_mem_gib=141)
    assert plan.cache_bytes_per_token == 18 * 2 * 8 * 64 * 2  # only the 18 full-attention layers grow
