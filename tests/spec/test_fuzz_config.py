"""`dayzero inspect` on broken config.json files, under hypothesis: the published configs of every family
(and tiny Kimi Linear / K2.5 ones) with fields removed, or set to wrong types, huge, negative, zero,
fractional or non-finite values, strings and nested junk, at the top level and inside nested objects
(rope, quantization, linear attention, text and vision configs). Each one either gives a report (and
its text and JSON) or raises a ValueError that names a config field; never another exception, never a
hang. Derandomized in CI (DAYZERO_FULL_TESTS=1: 10x more examples)."""

from __future__ import annotations

import copy
import json
import os
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dayzero.inspect import build_report, format_report
from tests.spec.fullsize_configs import PUBLISHED
from tests.spec.tiny_configs import TINY

EXAMPLES = 3000 if os.environ.get("DAYZERO_FULL_TESTS") == "1" else 300
BASES = {**{name: cfg for name, (cfg, _, _) in PUBLISHED.items()},
         **{f"{t}-tiny": {"model_type": t, **copy.deepcopy(TINY[t])} for t in ("kimi_linear", "kimi_k25", "deepseek_v4")}}
SECONDS = 20  # an example that takes longer hangs

JUNK = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, -1, -7, 1, 2, 3, 2.5, 1e-9, 10**6, 2**31, 2**63, 10**30, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.sampled_from(["", "yarn", "silu", "fp8"]),
    st.lists(st.integers(-2, 5), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(-2, 5), max_size=2),
)


def _paths(cfg, prefix=()) -> list[tuple]:
    """Every key path of the config (nested objects included, list items of objects too)."""
    out = []
    items = cfg.items() if isinstance(cfg, dict) else enumerate(cfg) if isinstance(cfg, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        if isinstance(value, (dict, list)) and len(out) < 400:
            out += _paths(value, (*prefix, key))
    return out


@st.composite
def broken_configs(draw):
    name = draw(st.sampled_from(sorted(BASES)))
    cfg = copy.deepcopy(BASES[name])
    changed = []
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(cfg)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = cfg
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.integers(0, 3)) == 0 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JUNK)
        changed.append(path)
    return name, cfg, changed


def _keys(cfg) -> set[str]:
    return {str(p[-1]) for p in _paths(cfg)} | {str(p[0]) for p in _paths(cfg)}


def _alarm(signum, frame):
    raise TimeoutError(f"inspect took more than {SECONDS} s")


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(broken_configs())
def test_a_broken_config_gives_a_report_or_an_error_naming_a_field(case):
    name, cfg, changed = case
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS)
    try:
        report = build_report(cfg)
        format_report(report)
        json.dumps(report, default=str)
    except ValueError as err:  # UnsupportedModelError and the checks that name their field
        message = str(err)
        named = {k for k in _keys(cfg) | {str(p[-1]) for p in changed} | {str(p[0]) for p in changed}
                 if isinstance(k, str) and len(k) > 1}
        assert any(k in message for k in named), f"{name} changed at {changed}: {message}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_the_bases_give_reports():
    for name, cfg in BASES.items():
        report = build_report(copy.deepcopy(cfg))
        assert report["params_total"] > report["params_active"] > 0 and format_report(report), name
