"""The `dayzero` command line, end to end: the demo model, config-only planning, bad input."""

import json
import subprocess
import sys

from dayzero.cli import main
from tests.spec.fullsize_configs import config


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_inspect_without_model_uses_the_demo_checkpoint(capsys):
    rc, out, err = _run(capsys, "inspect", "--json", "--load")
    assert rc == 0, err
    report = json.loads(out)
    assert report["model_type"] == "deepseek_v4"
    assert "demo checkpoint" in err
    assert [layer["attention"] for layer in report["layers"]] == ["swa", "csa", "hca", "csa"]
    assert [layer["mlp"] for layer in report["layers"]] == ["hash_moe", "hash_moe", "moe", "moe"]
    assert report["experts"]["format"] == "mxfp4"
    assert report["cross_layer_residual"]["kind"] == "hyper_connection"
    ckpt = report["checkpoint"]
    assert ckpt["loaded"]["tensors"] == ckpt["tensors"] > 300
    assert set(ckpt["bytes_by_dtype"]) >= {"F8_E4M3", "F8_E8M0", "I8", "BF16"}


def test_inspect_text_report_on_the_demo(capsys):
    rc, out, _ = _run(capsys, "inspect")
    assert rc == 0
    for needle in ["Features", "Layers (attention+mlp)", "Ops", "Memory plan", "Checkpoint on disk"]:
        assert needle in out


def test_inspect_plans_a_full_size_model_from_config_json_alone(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(config("kimi-k3")))
    rc, out, err = _run(capsys, "inspect", str(tmp_path / "config.json"), "--json", "--gpus", "16", "--context", "1000000")
    assert rc == 0, err
    report = json.loads(out)
    assert 2.7e12 < report["params_total"] < 2.9e12
    assert {layer["attention"] for layer in report["layers"]} == {"kda", "mla"}
    assert "checkpoint" not in report
    memory = report["memory"]
    assert 0.35 < memory["kda_state_gib_per_request"] < 0.45
    assert memory["gpus"] == 16


def test_inspect_missing_path_is_an_error(capsys):
    rc, _, err = _run(capsys, "inspect", "/nonexistent/model")
    assert rc == 2
    assert "/nonexistent/model does not exist" in err


def test_load_on_a_config_only_directory_is_an_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(config("gpt-oss-120b")))
    rc, _, err = _run(capsys, "inspect", str(tmp_path), "--load")
    assert rc == 2
    assert "holds no *.safetensors weights" in err


def test_inspect_unknown_model_type_lists_supported(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba9", "hidden_size": 8}))
    rc, _, err = _run(capsys, "inspect", str(tmp_path))
    assert rc == 2
    assert "mamba9" in err and "deepseek_v4" in err and "kimi_linear" in err


def test_ops_lists_coverage(capsys):
    rc, out, _ = _run(capsys, "ops")
    assert rc == 0
    assert out.splitlines()[0].split()[:2] == ["op", "reference"]
    assert "linear_fp8_block" in out


def test_console_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "dayzero", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "inspect" in proc.stdout
