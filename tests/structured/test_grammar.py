"""Constrained decoding through llguidance: every sampled output of random logits parses and validates
against its schema (varied, seeded schemas), regexes and EBNF grammars hold, masks are exact, and a bad
constraint is refused naming its field."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from dayzero.demo import demo_checkpoint
from dayzero.structured.bitmask import TokenBitmask, apply_token_bitmask
from dayzero.structured.grammar import GrammarCompiler, GrammarError
from dayzero.structured.params import StructuredOutputs
from tests.structured.walk import random_schema, walk


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_checkpoint())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, 896, {tokenizer.eos_token_id})


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("seed", range(40))
def test_random_schemas_validate(compiler, tokenizer, seed):
    rng = random.Random(seed)
    schema = {"type": "object", "properties": {"x": random_schema(rng), "y": random_schema(rng)},
              "required": ["x"], "additionalProperties": False} if seed % 2 else random_schema(rng)
    ids, ended = walk(compiler, StructuredOutputs(json=schema), seed)
    assert ended, f"no EOS within the step budget: {decode(tokenizer, ids)!r}"
    jsonschema.validate(json.loads(decode(tokenizer, ids)), schema)


def test_json_object_regex_ebnf_lark(compiler, tokenizer):
    for seed in range(6):
        ids, ended = walk(compiler, StructuredOutputs(json_object=True), seed, max_steps=1500, scale=0.5)
        if ended:  # an unbounded object may run past the budget: what it wrote is a prefix of JSON
            assert isinstance(json.loads(decode(tokenizer, ids)), dict)
        ids, ended = walk(compiler, StructuredOutputs(regex=r"(cat|dog)s? [0-9]{2,4}"), seed)
        assert ended and re.fullmatch(r"(cat|dog)s? [0-9]{2,4}", decode(tokenizer, ids))
        ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
        ids, ended = walk(compiler, StructuredOutputs(grammar=ebnf), seed)
        text = decode(tokenizer, ids)
        assert ended and re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text
        ids, ended = walk(compiler, StructuredOutputs(lark='start: "yes" | "no"'), seed)
        assert ended and decode(tokenizer, ids) in ("yes", "no")


def test_enable_after_leaves_the_reasoning_free(compiler, tokenizer):
    """The constraint starts after one of enable_after_token_ids is sampled (a thinking model's </think>)."""
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    grammar = compiler.new(StructuredOutputs(regex="[0-9]+", enable_after_token_ids=(think_end,)))
    assert not grammar.active
    for t in tokenizer("free text!", add_special_tokens=False).input_ids:
        grammar.accept(t)
    assert not grammar.active and not grammar.failed
    grammar.accept(think_end)
    assert grammar.active
    mask = TokenBitmask(896, "cpu").fill([grammar])
    allowed = {t for t in range(896) if (int(mask[0, t // 32]) >> (t % 32)) & 1}
    assert allowed and all(decode(tokenizer, [t]).isdigit() for t in allowed)


def test_mask_is_applied_exactly(compiler):
    """apply_token_bitmask against llguidance's numpy reference, several rows, a vocabulary not a multiple of 32."""
    from llguidance.numpy import apply_token_bitmask_inplace

    grammars = [compiler.new(StructuredOutputs(regex=r)) for r in ("[a-c]+", "x|yz", "[0-9]")]
    masks = TokenBitmask(896, "cpu").fill(grammars)
    logits = torch.randn(5, 880)
    rows = torch.tensor([0, 2, 4])
    want = logits.numpy().copy()
    sub = want[[0, 2, 4]]
    apply_token_bitmask_inplace(sub, masks.numpy()[:, :28].copy())
    want[[0, 2, 4]] = sub
    apply_token_bitmask(logits, rows, masks)
    np.testing.assert_array_equal(logits.numpy(), want)
    assert torch.isfinite(logits[1]).all() and torch.isfinite(logits[3]).all()  # unconstrained rows untouched


@pytest.mark.parametrize("spec, field, words", [
    (StructuredOutputs(json={"type": "frob"}, source="response_format.json_schema.schema"),
     "response_format.json_schema.schema", "Invalid type"),
    (StructuredOutputs(json="{not json", source="json_schema"), "json_schema", "invalid JSON schema"),
    (StructuredOutputs(json=[1, 2], source="json_schema"), "json_schema", "a JSON schema is an object"),
    (StructuredOutputs(regex="a(b", source="regex"), "regex", "unclosed group"),
    (StructuredOutputs(grammar="root ::= (", source="ebnf"), "ebnf", "invalid EBNF grammar"),
])
def test_invalid_constraints_name_the_field(compiler, spec, field, words):
    with pytest.raises(GrammarError, match=words) as err:
        compiler.compile(spec)
    assert err.value.param == field and str(err.value).startswith(field)


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(json={}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
