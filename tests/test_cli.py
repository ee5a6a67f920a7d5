"""The `dayzero` command line, end to end: the demo model, config-only planning, bad input."""

import json
import subprocess
import sys

import pytest

from dayzero.cli import main
from tests.readme import shell_commands
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


def test_every_readme_command_parses():
    """The README's dayzero commands use flags that exist (the model paths are examples)."""
    from dayzero.cli import build_parser

    commands = [argv[1:] for argv in shell_commands() if argv[0] == "dayzero"]
    assert {argv[0] for argv in commands} >= {"verify", "generate", "serve", "bench", "inspect"}
    for argv in commands:
        build_parser().parse_args(argv)
    tests = [argv for argv in shell_commands("Quick start") if argv[:3] == ["python", "-m", "pytest"]]
    assert tests == [["python", "-m", "pytest", "-q"]]


def test_inspect_reads_a_config_file_of_any_name(tmp_path, capsys):
    (tmp_path / "k3.json").write_text(json.dumps(config("kimi-k3")))
    rc, out, err = _run(capsys, "inspect", str(tmp_path / "k3.json"), "--json")
    assert rc == 0, err
    assert json.loads(out)["model_type"] == "kimi_k3"


def test_a_malformed_config_is_an_error_naming_the_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "gpt_oss",\n  "hidden_size": }')
    rc, _, err = _run(capsys, "inspect", str(tmp_path))
    assert rc == 2
    assert f"{tmp_path / 'config.json'} is not valid JSON" in err and "line 2" in err
    (tmp_path / "config.json").write_text("[1, 2]")
    rc, _, err = _run(capsys, "inspect", str(tmp_path / "config.json"))
    assert rc == 2 and "holds a JSON list" in err


def test_context_and_gpus_must_be_positive(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(config("gpt-oss-120b")))
    for flag, value in (("--context", "-5"), ("--context", "0"), ("--gpus", "0")):
        with pytest.raises(SystemExit) as exc:
            main(["inspect", str(tmp_path), flag, value])
        assert exc.value.code == 2
        assert f"{flag}: must be at least 1, got {value}" in capsys.readouterr().err
    from dayzero.plan import memory_plan
    from dayzero.spec import load_spec

    with pytest.raises(ValueError, match="context must be at least 1 token, got -5"):
        memory_plan(load_spec(tmp_path), context=-5)


@pytest.mark.parametrize("command", ["inspect", "verify", "generate", "serve", "bench"])
def test_every_command_takes_the_model_positionally_or_as_an_option(command, capsys):
    for argv in ([command, "/nonexistent/model"], [command, "--model", "/nonexistent/model"],
                 [command, "--model-path", "/nonexistent/model"]):
        rc, _, err = _run(capsys, *argv)
        assert rc == 2 and "model path /nonexistent/model does not exist" in err, (argv, err)
    with pytest.raises(SystemExit):
        main([command, "/a", "--model", "/b"])
    assert "two models given" in capsys.readouterr().err


def test_a_checkpoint_path_that_is_another_file_is_an_error(tmp_path, capsys):
    (tmp_path / "weights.bin").write_bytes(b"x")
    rc, _, err = _run(capsys, "generate", str(tmp_path / "weights.bin"))
    assert rc == 2 and "weights.bin is a file, not a checkpoint" in err


def test_serve_on_a_busy_port_fails_before_loading_the_model(monkeypatch, capsys):
    import socket

    import dayzero.engine.llm

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(dayzero.engine.llm, "LLM", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, _, err = _run(capsys, "serve", "--port", str(port))
    assert rc == 2
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    rc, _, err = _run(capsys, "serve", "--port", "70000")
    assert rc == 2 and "--port must be in [1, 65535]" in err
