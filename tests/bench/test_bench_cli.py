"""`dayzero bench` end to end on the demo (CPU): the report, the JSON and its PNG, a two-level sweep,
`--vs transformers`, `--url` against a server on loopback, and bad flags."""

import contextlib
import io
import json
import re
import struct

import pytest

from dayzero.cli import main

WORKLOAD = ["--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--num-warmups", "1"]
REPORT_LINES = ["Successful requests:", "Benchmark duration (s):", "Request throughput (req/s):",
                "Input token throughput (tok/s):", "Output token throughput (tok/s):",
                "Total token throughput (tok/s):",
                "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "Median TPOT (ms):",
                "P99 TPOT (ms):", "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):"]


def _value(out: str, label: str, nth: int = 0) -> str:
    return re.findall(rf"^{re.escape(label)}\s+(\S+)", out, flags=re.M)[nth]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One run: a sweep of concurrency 1 and 4, the JSON and PNG, and transformers on the same prompts."""
    out = tmp_path_factory.mktemp("bench") / "result.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["bench", *WORKLOAD, "--max-concurrency", "1", "4", "--output-file", str(out),
                   "--vs", "transformers"])
    return rc, stdout.getvalue(), stderr.getvalue(), out


def test_the_report_has_every_line_per_level(sweep):
    rc, out, err, _ = sweep
    assert rc == 0, err
    for label in REPORT_LINES:
        assert len(re.findall(rf"^{re.escape(label)}", out, flags=re.M)) == 2, label
    assert [_value(out, "Max request concurrency:", i) for i in range(2)] == ["1", "4"]
    assert _value(out, "Successful requests:") == "4" and _value(out, "Total generated tokens:") == "16"
    assert re.search(r"^Peak memory \(GiB, process max RSS\):\s+\d+\.\d\d", out, flags=re.M)
    assert "dayzero, concurrency 1" in err and "transformers, concurrency 4" in err  # the progress bars


def test_the_json_is_consistent(sweep):
    _, _, _, path = sweep
    result = json.loads(path.read_text())
    assert result["workload"]["num_prompts"] == 4 and result["ignore_eos"] is True
    runs = result["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 4]  # the sweep: one row per level
    for run in runs:
        assert run["completed"] == 4 and run["failed"] == 0
        assert run["total_output_tokens"] == 4 * 4 and run["output_lens"] == [4] * 4  # ignore_eos: all reach 4
        assert run["total_input_tokens"] == 4 * 8
        assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration"])
        assert run["total_token_throughput"] == pytest.approx(48 / run["duration"])
        assert run["request_throughput"] == pytest.approx(4 / run["duration"])
        assert all(len(itl) == 3 for itl in run["itls"])
        assert 0 < run["mean_ttft_ms"] <= run["mean_e2el_ms"] and run["p99_itl_ms"] >= run["median_itl_ms"] > 0
        assert run["peak_memory_bytes"] > 0
    assert runs[0]["concurrency"] <= 1.0 + 1e-6  # one request at a time: latencies add up to the duration at most


def test_vs_transformers_prints_the_ratio_of_the_same_prompts(sweep):
    _, out, _, path = sweep
    table = out[out.index("dayzero vs transformers"):]
    ratios = re.findall(r"^(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)x$", table, flags=re.M)
    assert [r[0] for r in ratios] == ["1", "4"]
    baseline = json.loads(path.read_text())["transformers"]
    runs = json.loads(path.read_text())["runs"]
    for (_, ours, theirs, ratio), b, r in zip(ratios, baseline, runs):
        assert b["total_output_tokens"] == 16 and b["completed"] == 4
        assert b["ratio"] == pytest.approx(r["output_throughput"] / b["output_throughput"])
        assert float(ours) == pytest.approx(r["output_throughput"], abs=0.006)
        assert float(theirs) == pytest.approx(b["output_throughput"], abs=0.006)
        assert float(ratio) == pytest.approx(b["ratio"], abs=0.006)
    assert [b["batch_size"] for b in baseline] == [1, 4]


def test_the_png_beside_the_json_is_a_valid_image(sweep):
    from matplotlib import image

    _, _, _, path = sweep
    png = path.with_suffix(".png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (1100, 420)  # 11 x 4.2 inches at 100 dpi
    pixels = image.imread(png)
    assert pixels.shape[:2] == (420, 1100) and pixels.std() > 0  # decodes, and is not blank


def test_url_benchmarks_a_server_on_loopback(tmp_path, capsys):
    from tests.server.conftest import start_server, stop_server

    running = start_server()
    try:
        out_file = tmp_path / "url.json"
        rc = main(["bench", "--url", running.url + "/v1", *WORKLOAD, "--max-concurrency", "2", "--disable-tqdm",
                   "--output-file", str(out_file)])
        out, err = capsys.readouterr()
    finally:
        stop_server(running)
    assert rc == 0, err
    assert f"{running.url} (demo, /v1/completions)" in out
    assert _value(out, "Successful requests:") == "4"
    assert "Peak memory (GiB):" in out and "n/a" in out
    run = json.loads(out_file.read_text())["runs"][0]
    assert run["completed"] == 4 and run["total_output_tokens"] == 16  # the server's usage counts
    assert run["peak_memory_bytes"] is None
    assert run["output_throughput"] == pytest.approx(16 / run["duration"])
    assert all(t is not None and t > 0 for t in run["ttfts"])


def test_url_without_a_server_names_the_url(capsys):
    from tests.server.conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "--url", url, *WORKLOAD]) == 2
    err = capsys.readouterr().err
    assert f"--url {url}: cannot reach the server" in err


@pytest.mark.parametrize("flag, value, message", [
    ("--num-prompts", "0", "must be at least 1, got 0"),
    ("--input-len", "-3", "must be at least 1, got -3"),
    ("--output-len", "0", "must be at least 1, got 0"),
    ("--max-concurrency", "0", "must be at least 1, got 0"),
    ("--random-range-ratio", "1.5", "must be in [0, 1), got 1.5"),
    ("--num-warmups", "-1", "must be at least 0, got -1"),
    ("--input-len", "many", "invalid int value: 'many'"),
])
def test_bad_flags_are_argparse_errors_naming_the_flag(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err


@pytest.mark.parametrize("argv, message", [
    (["--vs", "transformers", "--url", "http://127.0.0.1:1"], "--vs transformers runs transformers in this process"),
    (["--profile-steps", "2", "--url", "http://127.0.0.1:1"], "--profile-steps profiles the engine in this process"),
    (["--output-file", "plot.png"], "--output-file plot.png is the JSON"),
    (["--mem-fraction", "1.5"], "--mem-fraction must be in (0, 1], got 1.5"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be at least 1, or -1"),
    (["--max-running-requests", "0"], "--max-running-requests must be at least 1, got 0"),
])
def test_flags_that_cannot_go_together(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_without_matplotlib_output_file_fails_before_the_run(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["bench", *WORKLOAD, "--output-file", str(tmp_path / "r.json")]) == 2
    captured = capsys.readouterr()
    assert "--output-file also writes a PNG plot, which needs matplotlib: pip install matplotlib" in captured.err
    assert "Benchmark Result" not in captured.out and not (tmp_path / "r.json").exists()


def test_json_schema_flag(tmp_path):
    from dayzero.bench.command import _json_schema
    from dayzero.bench.workload import RECORDS_SCHEMA

    assert _json_schema(None) is None and _json_schema("records") is RECORDS_SCHEMA
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    assert _json_schema(str(schema)) == {"type": "object"}
    schema.write_text("[1]")
    with pytest.raises(ValueError, match="is an object"):
        _json_schema(str(schema))
    with pytest.raises(ValueError, match="no such file"):
        _json_schema(str(tmp_path / "missing.json"))
