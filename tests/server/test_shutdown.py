"""`dayzero serve` as the README starts it: the README's curl request works as written against the
demo; then SIGTERM while a stream and a plain request are in flight: the server stops accepting, lets
both finish (the stream ending in data: [DONE]) and exits with 0. A second SIGINT exits at once."""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from tests.readme import shell_commands


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_example_then_sigterm_finishes_the_stream_in_flight_then_exits():
    (serve,) = [argv for argv in shell_commands("Serving") if argv[:2] == ["dayzero", "serve"]]
    (curl,) = [argv for argv in shell_commands("Serving") if argv[0] == "curl"]
    readme_port = serve[serve.index("--port") + 1]
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    serve[serve.index("--port") + 1] = str(port)  # the README's command, on a free port
    proc = subprocess.Popen([sys.executable, "-m", "dayzero", *serve[1:]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_up(base)
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        assert model == "demo"
        url = curl[1].replace(f":{readme_port}/", f":{port}/")
        r = httpx.post(url, json=json.loads(curl[curl.index("-d") + 1]), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        lines: list[str] = []
        answers: list[httpx.Response] = []

        def stream():
            body = {"model": model, "prompt": "hi", "max_tokens": 48, "stream": True, "temperature": 0}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)

        def complete():  # a non-streaming request in flight too: it gets its whole answer
            answers.append(httpx.post(base + "/generate", json={"text": "hi", "sampling_params": {
                "max_new_tokens": 40, "ignore_eos": True}}, timeout=60))

        readers = [threading.Thread(target=stream), threading.Thread(target=complete)]
        for reader in readers:
            reader.start()
        deadline = time.time() + 30
        while len(lines) < 3 and readers[0].is_alive() and time.time() < deadline:
            time.sleep(0.01)
        assert len(lines) >= 3, lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # drained, then a clean exit
        for reader in readers:
            reader.join(timeout=60)
        assert lines[-1] == "data: [DONE]"
        assert answers[0].status_code == 200 and answers[0].json()["meta_info"]["completion_tokens"] == 40
        log = proc.stdout.read()
        assert "Shutting down" in log and "Application shutdown complete" in log and "SIGTERM: draining" in log
        assert re.search(r"\[dayzero\] loaded .*; startup [\d.]+ s: locate .* weights [\d.]+ s \(.*GB/s\)", log), log
        try:
            httpx.get(base + "/health", timeout=1)
            raise AssertionError("the server still answers after SIGTERM")
        except httpx.HTTPError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_sigint_exits_at_once():
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "dayzero", "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_up(base)
        lines: list[str] = []

        def stream():  # thousands of tokens: it would keep a draining server up for its whole grace period
            body = {"prompt": "hi", "max_tokens": 4000, "stream": True, "ignore_eos": True}
            try:
                with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                    lines.extend(line for line in r.iter_lines() if line)
            except httpx.HTTPError as exc:
                lines.append(repr(exc))

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.time() + 30
        while len(lines) < 3 and time.time() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None  # draining: the stream goes on
        proc.send_signal(signal.SIGINT)
        start = time.time()
        assert proc.wait(timeout=10) == 130 and time.time() - start < 3
        reader.join(timeout=30)
        assert lines[-1] != "data: [DONE]"  # cut
        log = proc.stdout.read()
        assert "SIGINT: draining" in log and "second SIGINT: exiting now" in log and "Traceback" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()


def _wait_up(base: str) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"{base} did not come up")
