"""Constrained requests in the engine: their outputs hold their constraint under greedy and seeded
sampling, synchronously and with async scheduling (token for token the same), and the unconstrained
requests beside them get exactly the tokens they get alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from dayzero.engine import SamplingParams
from dayzero.engine.errors import InvalidRequestError
from dayzero.engine.llm import LLM
from dayzero.structured import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
PROMPTS = ["The lighthouse keeper", "Hello world", "1 2 3"]


def _params():
    return [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputs(json=SCHEMA)),
            SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=1.0, seed=5, n=2,
                           structured_outputs=StructuredOutputs(regex=r"(yes|no), [0-9]{1,3}"))]


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
    alone = llm.generate(PROMPTS[1], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert alone[0].token_ids == outs[1][0][0]  # the unconstrained request's tokens do not change


def test_async_scheduling_gives_the_same_tokens(sync_outputs):
    llm = LLM(enable_prefix_caching=False, async_scheduling=True)
    assert llm.engine.async_scheduling
    assert _outputs(llm) == sync_outputs[0]
    assert llm.engine.num_overlapped_steps > 3 and llm.engine.num_grammar_waits > 3
    waits = llm.engine.num_grammar_waits
    llm.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert llm.engine.num_grammar_waits == waits  # steps without a constrained row never wait


def test_invalid_constraint_is_refused_before_queueing(sync_outputs):
    llm = sync_outputs[1]
    bad = SamplingParams(structured_outputs=StructuredOutputs(regex="(", source="regex"))
    with pytest.raises(InvalidRequestError) as err:
        llm.generate("hi", bad)
    assert err.value.param == "regex" and not llm.engine.has_unfinished()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_and_async_scheduling():
    """On the GPU (decode graphs, async scheduling, pinned mask transfers): the constraints hold and the
    tokens equal the synchronous engine's on the same device."""
    kwargs = dict(device="cuda", enable_prefix_caching=False)
    sync = _outputs(LLM(async_scheduling=False, **kwargs))
    overlap = LLM(async_scheduling=True, **kwargs)
    assert overlap.engine.async_scheduling and _outputs(overlap) == sync
    jsonschema.validate(json.loads(sync[0][0][1]), SCHEMA)
    assert all(re.fullmatch(r"(yes|no), [0-9]{1,3}", c[1]) for c in sync[2])
    assert overlap.engine.num_grammar_waits > 3
