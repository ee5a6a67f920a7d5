"""StartupTimer: phases in order, children nested, seconds that add up, the one-line summary, the report."""

import time

import pytest

from dayzero.startup import StartupTimer


def test_phases_nest_and_add_up():
    timer = StartupTimer()
    with timer.phase("config"):
        time.sleep(0.02)
    with timer.phase("weights", bytes=3 * 10**8, detail="3 file(s), 4 thread(s)"):
        time.sleep(0.05)
    with timer.phase("engine"):
        with timer.phase("kv_pool") as pool:
            time.sleep(0.03)
            pool.bytes = 2**31
        time.sleep(0.01)
    assert [p.name for p in timer.phases] == ["config", "weights", "engine"]
    engine = timer.get("engine")
    assert [c.name for c in engine.children] == ["kv_pool"] and timer.get("kv_pool") is engine.children[0]
    assert engine.seconds >= engine.children[0].seconds + 0.01
    assert timer.get("config").seconds >= 0.02 and timer.get("weights").seconds >= 0.05
    assert timer.phase_seconds == pytest.approx(timer.total_seconds, abs=0.005)
    weights = timer.get("weights")
    assert weights.gb_per_s == pytest.approx(0.3 / weights.seconds)
    assert weights.gb_per_s < 6  # 0.3 GB in at least 50 ms

    line = timer.summary()
    assert "\n" not in line and line.startswith(f"startup {timer.total_seconds:.2f} s: config ")
    assert f"weights {weights.seconds:.2f} s (286.10 MiB, {weights.gb_per_s:.2f} GB/s)" in line
    assert "engine" in line and "[kv_pool" in line and "2.00 GiB" in line
    assert "thread" not in line  # details are the report's

    report = timer.report().splitlines()
    assert report[0] == f"startup {timer.total_seconds:.2f} s"
    assert report[2].startswith("  weights") and report[2].endswith("; 3 file(s), 4 thread(s))")
    assert report[4].startswith("    kv_pool")  # indented under engine

    d = timer.as_dict()
    assert d["total_s"] == timer.total_seconds
    assert [p["name"] for p in d["phases"]] == ["config", "weights", "engine"]
    assert d["phases"][1]["bytes"] == 3 * 10**8 and d["phases"][2]["children"][0]["bytes"] == 2**31


def test_a_gap_between_phases_is_shown_not_hidden():
    timer = StartupTimer()
    with timer.phase("a"):
        pass
    time.sleep(0.03)
    with timer.phase("b"):
        pass
    assert timer.total_seconds - timer.phase_seconds >= 0.03
    assert "(between phases) 0.0" in timer.report()


def test_a_failing_phase_is_recorded_and_the_error_passes():
    timer = StartupTimer()
    with pytest.raises(RuntimeError, match="boom"):
        with timer.phase("weights"):
            time.sleep(0.01)
            raise RuntimeError("boom")
    assert timer.get("weights").seconds >= 0.01
    with timer.phase("after"):  # the failed phase is closed: this one is top level
        pass
    assert [p.name for p in timer.phases] == ["weights", "after"]


def test_record_adds_a_phase_timed_elsewhere():
    timer = StartupTimer()
    with timer.phase("engine"):
        timer.record("capture", 1.5, detail="8 batch sizes")
    assert timer.get("capture").seconds == 1.5 and timer.phases[0].children[0].name == "capture"
    timer.record("warmup", 0.25)
    assert timer.phases[-1].name == "warmup"
    assert timer.get("nothing") is None
