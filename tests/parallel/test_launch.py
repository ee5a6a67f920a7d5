"""The ways a job is launched (dayzero.parallel.launch): two "nodes" on this machine (SGLang's --nnodes /
--node-rank / --dist-init-addr, node 1's command running its rank) and torchrun (each process started by
it, RANK 0 running the command) print one process's text; the flags' errors name the flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dayzero.parallel.launch import Launch, from_torchrun, launch_of
from tests.server.conftest import free_port

GENERATE = ["generate", "--prompt", "The lighthouse keeper", "--max-tokens", "6"]


def _dayzero(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dayzero", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def one_process_text() -> str:
    """`dayzero generate`'s text (greedy) on one process: run in this one (a process of its own would add
    only the ~2 s of its start-up on CI's 2 cores)."""
    import contextlib
    import io

    from dayzero.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(GENERATE) == 0
    assert out.getvalue().strip()
    return out.getvalue()


def test_two_nodes_give_one_processs_text(one_process_text):
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = subprocess.Popen([sys.executable, "-m", "dayzero", *GENERATE, *flags, "--node-rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        node0 = _dayzero(*GENERATE, *flags, "--node-rank", "0")
        out1, err1 = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
    assert node0.returncode == 0, node0.stderr
    assert node0.stdout == one_process_text
    assert node1.returncode == 0, err1
    assert out1 == ""  # node 1 runs its rank; only rank 0 prints


def test_torchrun_gives_one_processs_text(one_process_text):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           "-m", "dayzero", *GENERATE, "--tp", "2"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout == one_process_text


def test_launch_flags_are_checked_naming_the_flag():
    with pytest.raises(ValueError, match="--dist-init-addr"):
        Launch(nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match="--node-rank"):
        Launch(nnodes=2, node_rank=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match="HOST:PORT"):
        Launch(nnodes=2, node_rank=0, dist_init_addr="nohost")
    with pytest.raises(ValueError, match="do not split over --nnodes 2"):
        Launch(nnodes=2, dist_init_addr="h:1").check(3)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        from_torchrun(torchrun).check(4)
    with pytest.raises(ValueError, match="torchrun"):
        launch_of(nnodes=2, dist_init_addr="h:1", environ=torchrun)
    assert launch_of(environ={}) == Launch()


def test_each_node_runs_its_own_ranks_on_its_own_devices():
    node1 = Launch(nnodes=2, node_rank=1, dist_init_addr="h:1")
    assert node1.spawned_ranks(8) == [4, 5, 6, 7] and not node1.is_rank0()
    assert Launch(nnodes=2, node_rank=0, dist_init_addr="h:1").spawned_ranks(8) == [1, 2, 3]
    assert node1.device("cuda", 6, 8) == "cuda:2" and node1.device("cpu", 6, 8) == "cpu"
    torchrun = from_torchrun({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert torchrun.spawned_ranks(4) == [] and torchrun.device("cuda", 3, 4) == "cuda:1"
    assert torchrun.init_method() == "env://"


def test_verify_splits_dayzeros_side_and_passes_against_transformers(tmp_path, capsys):
    """`dayzero verify --tp 2`: the split model's step logits against transformers' (Kimi Linear: KDA and
    MLA heads over tp); the JSON names the split."""
    import json

    from dayzero.cli import main
    from tests.models.kimi_linear_checkpoints import build_kimi_linear_checkpoint

    path = build_kimi_linear_checkpoint(tmp_path, seed=11)
    assert main(["verify", str(path), "--tp", "2", "--decode-steps", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["tp"] == 2 and result["ep"] == 1
    assert result["max_rel_err"] < 1e-4 and len(result["decode_rel_err"]) == 3
