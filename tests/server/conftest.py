"""A real server on 127.0.0.1 and a free port (uvicorn in a background thread) with the demo model,
and an offline LLM on the same checkpoint for reference outputs."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest


@dataclass
class Running:
    url: str
    app: object
    server: object
    thread: threading.Thread
    llm: object = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(llm_kwargs: dict | None = None, **config) -> Running:
    import uvicorn

    from dayzero.engine.llm import LLM
    from dayzero.server.app import ServerConfig, create_app
    from dayzero.server.serve import DEMO_SERVED_NAME

    max_running = config.get("max_running_requests", 16)
    llm = LLM(max_num_seqs=max_running, **(llm_kwargs or {}))
    app = create_app(llm, ServerConfig(served_model_name=DEMO_SERVED_NAME, **config))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    return Running(url, app, server, thread, llm)


def stop_server(running: Running) -> None:
    running.server.should_exit = True
    running.thread.join(30)


@pytest.fixture(scope="session")
def server():
    running = start_server()
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def url(server) -> str:
    return server.url


@pytest.fixture(scope="session")
def offline():
    from dayzero.engine.llm import LLM

    return LLM()


def wait_pool_free(url: str, headers: dict | None = None, timeout: float = 30) -> dict:
    """/get_server_info once nothing is in flight; fails if the KV pool does not become fully free."""
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(f"{url}/get_server_info", headers=headers, timeout=10).json()
        pool = info["kv_pool"]
        if pool["num_free_blocks"] == pool["num_blocks"] and info["num_in_flight_reqs"] == 0:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"KV pool not free after {timeout} s: {info}")
        time.sleep(0.1)
