"""SIGTERM while a stream is in flight: `dayzero serve` stops accepting, lets the stream finish
(ending in data: [DONE]) and exits."""

import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_the_stream_in_flight_then_exits():
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "dayzero", "serve", "--port", str(port)],
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
        lines: list[str] = []

        def stream():
            body = {"model": model, "prompt": "hi", "max_tokens": 120, "stream": True, "temperature": 0}
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
        try:
            httpx.get(base + "/health", timeout=1)
            raise AssertionError("the server still answers after SIGTERM")
        except httpx.HTTPError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
