"""Constrained requests in the engine: their outputs hold their constraint under greedy and seeded
sampling, synchronously and with async scheduling (token for token the same), and the unconstrained
requests beside them get exactly the tokens they get alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from dayzero.engine import SamplingParams
from dayzero.engine.errors import InvalidRequestError
from dayzero.engine.llm import LLM
from dayzero.structured import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
PROMPTS = ["The lighthouse keeper", "Hello world", "1 2 3", "Numbers: 4 5"]


def _params():
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputs(json=SCHEMA)), free,
            SamplingParams(max_tokens=40, temperature=1.0, seed=5, n=2,
                           structured_outputs=StructuredOutputs(regex=r"(yes|no), [0-9]{1,3}")), free]


def _outputs(llm):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in llm.generate(PROMPTS, _params())]


@pytest.fixture(scope="module")
def sync_outputs():
    llm = LLM(enable_prefix_caching=False, async_scheduling=False)
    return _outputs(llm), llm


def test_constrained_outputs_hold(sync_outputs):
    outs, llm = sync_outputs
    jsonschema.validate(json.loads(outs[0][0][1]), SCHEMA)
    assert outs[0][0][2] == "stop"
    for completion in outs[2]:
        assert re.fullmatch(r"(yes|no), [0-9]{1,3}", completion[1]) and completion[2] == "stop"
    alone = llm.generate([PROMPTS[1], PROMPTS[3]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in alone] == [outs[1][0][0], outs[3][0][0]]  # others pay nothing, in tokens


def test_async_scheduling_gives_the_same_tokens(sync_outputs):
    llm = LLM(enable_prefix_caching=False, async_scheduling=True)
    assert llm.engine.async_scheduling
    assert _outputs(llm) == sync_outputs[0]
    assert llm.engine.num_overlapped_steps > 3 and llm.engine.num_grammar_waits > 3
    waits = llm.engine.num_grammar_waits
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert llm.engine.num_grammar_waits == waits  # steps without a constrained row never wait


def test_invalid_constraint_is_refused_before_queueing(sync_outputs):
    llm = sync_outputs[1]
    bad = SamplingParams(structured_outputs=StructuredOutputs(regex="(", source="regex"))
    with pytest.raises(InvalidRequestError) as err:
        llm.generate("hi", bad)
    assert err.value.param == "regex" and not llm.engine.has_unfinished()
