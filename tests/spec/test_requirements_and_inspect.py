"""Ops needed per layer kind, coverage reporting, and the inspect report."""

from __future__ import annotations

import json

import pytest

from dayzero import inspect as dz_inspect
from dayzero.ops import requirements as req
from dayzero.spec import load_spec

from .fullsize_configs import config
from .tiny_configs import tiny_k3_config


def _ops(name: str, layer: int) -> list[str]:
    return req.required_ops(load_spec(config(name)).layers[layer])


def test_canonical_names_are_unique():
    assert len(set(req.ALL_OPS)) == len(req.ALL_OPS)


def test_required_ops_per_kind():
    v3_moe = _ops("deepseek-v3", 5)
    assert {req.MLA_ATTENTION, req.ROPE, req.LINEAR_FP8_BLOCK, req.ROUTE_SIGMOID_GROUPED, req.MOE_EXPERTS_FP8, req.SWIGLU} <= set(v3_moe)
    assert req.MOE_EXPERTS_FP8 not in _ops("deepseek-v3", 0)
    assert {req.INDEX_TOPK, req.SPARSE_MLA_ATTENTION, req.LAYER_NORM} <= set(_ops("deepseek-v3.2", 3))
    hca_hash = _ops("deepseek-v4-pro", 0)
    assert {req.KV_COMPRESSOR, req.SPARSE_ATTENTION, req.ROUTE_HASH, req.MOE_EXPERTS_MXFP4, req.HYPER_CONNECTION} <= set(hca_hash)
    assert req.V4_INDEX_TOPK not in hca_hash and req.PAGED_V4_ATTENTION in hca_hash  # decodes: paged in place
    assert {req.V4_INDEX_TOPK, req.PAGED_V4_INDEX_TOPK, req.ROUTE_SQRTSOFTPLUS} <= set(_ops("deepseek-v4-pro", 4))
    assert req.KV_COMPRESSOR not in _ops("deepseek-v4-flash", 0)  # window-only layer
    oss = _ops("gpt-oss-120b", 0)
    assert {req.GQA_ATTENTION, req.ROUTE_SOFTMAX_TOPK, req.MOE_EXPERTS_MXFP4, req.SWIGLU_CLAMPED, req.LINEAR} <= set(oss)
    k3 = load_spec(config("kimi-k3"))
    kda = req.required_ops(k3.layers[1])
    assert {req.SHORT_CONV1D_VARLEN, req.KDA_CHUNK_VARLEN, req.KDA_RECURRENT_SLOTS, req.GATED_RMS_NORM, req.SITU,
            req.ATTENTION_RESIDUAL} <= set(kda)
    mla = req.required_ops(k3.layers[3])
    assert req.MLA_ATTENTION in mla and req.ROPE not in mla  # NoPE MLA
    assert all(op in req.ALL_OPS for layer in k3.layers for op in req.required_ops(layer))


def test_model_level_ops():
    parts = req.model_level_ops(load_spec(config("kimi-k3")))
    assert parts["vision_tower"] == [req.VISION_ENCODER] and parts["lm_head"] == [req.LINEAR]
    assert req.HYPER_CONNECTION in req.model_level_ops(load_spec(config("deepseek-v4-flash")))["hyper_head"]


def test_missing_ops_are_reported_missing(monkeypatch):
    fake = {req.RMS_NORM: ["reference", "triton"]}
    monkeypatch.setattr(req, "backends_for", lambda op: fake.get(op, []))
    report = dz_inspect.build_report(config("deepseek-v3"))
    rows = {row["op"]: row["backends"] for row in report["ops"]}
    assert rows[req.RMS_NORM] == ["reference", "triton"]
    assert rows[req.MLA_ATTENTION] == [] and req.MLA_ATTENTION in report["ops_missing"]
    assert "MISSING" in dz_inspect.format_report(report)


def test_compress_runs():
    runs = dz_inspect.compress_runs(["mla+dense"] * 3 + ["mla+moe"] * 58)
    assert dz_inspect.format_runs(runs) == ["layers 0-2: mla+dense", "layers 3-60: mla+moe"]
    labels = ["a", "a", "a", "b"] * 3 + ["a"]
    assert dz_inspect.format_runs(dz_inspect.compress_runs(labels)) == ["layers 0-11: (a, a, a, b) x3", "layer 12: a"]
    assert dz_inspect.compress_runs([]) == []


def test_report_from_config_json_alone(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_k3_config()))
    report = dz_inspect.build_report(tmp_path, gpus=2, gpu_mem_gib=80, context=4096)
    json.dumps(report)  # the --json output
    for key in ("model_type", "layers", "experts", "cross_layer_residual", "vision", "params_total", "params_active", "memory"):
        assert key in report
    assert report["model_type"] == "kimi_k3"
    assert [(row["attention"], row["mlp"]) for row in report["layers"]][:4] == [
        ("kda", "dense"), ("kda", "moe"), ("kda", "moe"), ("mla", "moe")]
    assert (report["experts"]["num"], report["experts"]["top_k"], report["experts"]["format"]) == (8, 2, "mxfp4")
    assert report["cross_layer_residual"]["kind"] == "attention_residual"
    assert report["vision"]["kind"] == "moonvit3d"
    assert report["memory"]["context_fits"] and report["memory"]["gpus"] == 2
    text = dz_inspect.format_report(report)
    for needle in ("Features", "layer 0: kda+dense", "Ops", "Memory plan", "GiB"):
        assert needle in text


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3.2", "deepseek-v4-pro", "gpt-oss-120b", "kimi-k2"])
def test_reports_render_for_published_configs(name):
    report = dz_inspect.build_report(config(name), gpus=8)
    assert report["params_total"] > report["params_active"] > 0
    assert dz_inspect.format_report(report).count("\n") > 20


def test_a_model_that_does_not_fit_says_by_how_much_instead_of_negative_free_memory():
    text = dz_inspect.format_report(dz_inspect.build_report(config("kimi-k3"), gpus=1))
    line = next(l for l in text.splitlines() if "free for cache per GPU" in l)
    assert "none: the above exceed the GPU by" in line and "-" not in line.split("GPU")[1].split("none")[0]
    # on more GPUs, the per-GPU plan of the best tp x ep split: a GPU holds 1/tp of the dense weights (about
    # 107 GiB) and 1/ep of the experts (1.32 TiB), over 141 GiB for every tp x ep = 16; tp 2 x ep 32 fits
    for gpus, fits in ((16, False), (64, True)):
        text = dz_inspect.format_report(dz_inspect.build_report(config("kimi-k3"), gpus=gpus))
        line = next(l for l in text.splitlines() if l.strip().startswith("free for cache "))
        assert ("none: the above exceed the GPU by" in line) != fits, (gpus, line)
        assert "-" not in line.split("cache")[1].split("none")[0], line
