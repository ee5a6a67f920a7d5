"""`dayzero serve` as the README starts it: the README's curl request works as written against the
demo; then SIGTERM while a stream is in flight: the server stops accepting, lets the stream finish
(ending in data: [DONE]) and exits."""

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
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        assert model == "demo"
        url = curl[1].replace(f":{readme_port}/", f":{port}/")
        r = httpx.post(url, json=json.loads(curl[curl.index("-d") + 1]), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        lines: list[str] = []

        def stream():
            body = {"model": model, "prompt": "hi", "max_tokens": 48, "stream": True, "temperature": 0}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.time() + 30
        while len(lines) < 3 and reader.is_alive() and time.time() < deadline:
            time.sleep(0.01)
        assert len(lines) >= 3, lines
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(timeout=60)
        assert lines[-1] == "data: [DONE]"
        log = proc.stdout.read()
        assert "Shutting down" in log and "Application shutdown complete" in log
        assert re.search(r"\[dayzero\] loaded .*; startup [\d.]+ s: locate .* weights [\d.]+ s \(.*GB/s\)", log), log
        try:
            httpx.get(base + "/health", timeout=1)
            raise AssertionError("the server still answers after SIGTERM")
        except httpx.HTTPError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
