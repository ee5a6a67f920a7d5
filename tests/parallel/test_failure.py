"""A failed rank ends the job within seconds and is named: a killed worker, an exception inside one, through
the `LLM` API and `dayzero serve` (CPU, gloo, the demo model at --tp 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from dayzero.engine import SamplingParams
from dayzero.engine.llm import LLM
from dayzero.engine.tp_workers import RankFailure

LONG = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def _generate_until_it_fails(llm: LLM, deadline_s: float = 20.0) -> tuple[RankFailure, float]:
    start = time.monotonic()
    with pytest.raises(RankFailure) as failed:
        while time.monotonic() - start < deadline_s:
            llm.generate(["Hello there, how are you"], LONG)
    return failed.value, time.monotonic() - start


def test_a_killed_worker_fails_the_next_step_naming_its_rank():
    a_killed_worker_fails_the_next_step_naming_its_rank()


def a_killed_worker_fails_the_next_step_naming_its_rank(**kwargs):
    """Also on two GPUs (tests/parallel/test_nccl_multi_gpu.py: NCCL, the collective waiting on the dead rank
    aborted)."""
    llm = LLM(None, tensor_parallel_size=2, **kwargs)
    try:
        assert len(llm.generate(["Hi"], SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].token_ids) == 4
        pid = llm.workers.pids[1]
        threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()  # mid-generate
        failure, seconds = _generate_until_it_fails(llm)
        assert f"rank 1 (pid {pid}) exited with code -9" in str(failure)
        assert seconds < 10
        with pytest.raises(RankFailure, match="rank 1"):  # and every later call, at once
            llm.generate(["Hi"], SamplingParams(max_tokens=2))
    finally:
        start = time.monotonic()
        llm.close()
        assert time.monotonic() - start < 10


def test_an_exception_in_a_worker_is_reported_with_its_cause():
    llm = LLM(None, tensor_parallel_size=2)
    try:
        llm.workers.send("not a step")  # the worker's run_step cannot read it: it raises, reports, exits
        failure, seconds = _generate_until_it_fails(llm)
        assert "rank 1" in str(failure) and "exited with code 1" in str(failure)
        assert "AttributeError: 'str' object has no attribute" in str(failure)
        assert seconds < 10
    finally:
        llm.close()


def _get(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if body else ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_the_server_reports_a_killed_rank_and_exits_within_seconds(tmp_path):
    the_server_reports_a_killed_rank_and_exits_within_seconds(tmp_path)


def the_server_reports_a_killed_rank_and_exits_within_seconds(tmp_path, *flags: str):
    """flags: more `dayzero serve` flags (tests/parallel/test_nccl_multi_gpu.py: --device cuda, NCCL)."""
    from tests.server.conftest import free_port

    port = free_port()
    log = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "dayzero", "serve", "--tp", "2", "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, open(tmp_path / "stderr").read()
            try:
                if _get(url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        status, info = _get(url + "/get_server_info")
        assert status == 200 and info["tp_size"] == 2 and set(info["rank_pids"]) == {"0", "1"}
        worker = info["rank_pids"]["1"]
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        code = proc.wait(timeout=15)
        assert time.monotonic() - killed < 10
        assert code == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    stderr = log.read()
    assert f"rank 1 (pid {worker}) exited with code -9" in stderr and "the server exits" in stderr
