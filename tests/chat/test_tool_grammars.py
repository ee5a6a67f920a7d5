"""tool_choice "required" / a named function, per family: under the family's tool-call grammar every
output of random logits is a well-formed call (several when parallel) to one of the given tools, its
arguments valid against the tool's schema, as the family's parser reads it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from dayzero.chat.formats import FORMATS
from dayzero.chat.output import parse_output
from dayzero.server.chat import ChatSetup, chat_setup, tool_choice_constraint
from dayzero.structured.grammar import GrammarCompiler
from tests.chat.families import EOS_TOKENS, FAMILIES
from tests.structured.walk import walk

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["c", "f"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "lookup.ids", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99}, "maxItems": 3},
                                         "exact": {"type": "boolean"}},
        "required": ["ids"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def setup_for(family, tokenizer) -> tuple[ChatSetup, GrammarCompiler]:
    setup = chat_setup(tokenizer, "")
    assert setup.format is FORMATS[family] and setup.template_has_tools
    eos = {tokenizer.convert_tokens_to_ids(t) for t in EOS_TOKENS.get(family, [tokenizer.eos_token])}
    return setup, GrammarCompiler(tokenizer, 896, eos)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["required", "named", "parallel"])
def test_forced_calls_are_well_formed(family_tokenizers, family, mode):
    tok = family_tokenizers[family]
    setup, compiler = setup_for(family, tok)
    name = "lookup.ids" if mode == "named" else None
    spec = tool_choice_constraint(setup, TOOLS, "named" if mode == "named" else "required", name,
                                  parallel=mode == "parallel", in_reasoning=False)
    counts = set()
    for seed in range(8):
        ids, ended = walk(compiler, spec, seed, max_steps=600)
        text = tok.decode(ids, skip_special_tokens=False)
        assert ended, f"no end within the budget: {text!r}"
        parsed = parse_output(setup.format.new_parser(reasoning=False, tools=True), text)
        assert parsed.tool_calls, f"no call read from {text!r}"
        counts.add(len(parsed.tool_calls))
        for call in parsed.tool_calls:
            assert call.name == name if name else call.name in SCHEMAS
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if mode != "parallel" or family == "gpt_oss":  # harmony: one call per turn
            assert len(parsed.tool_calls) == 1


@pytest.mark.parametrize("family", ["deepseek_v31", "kimi_k2"])
def test_forced_call_after_reasoning(family_tokenizers, family):
    """In thinking mode the grammar starts after </think>: the reasoning before it is free."""
    tok = family_tokenizers[family]
    setup, compiler = setup_for(family, tok)
    spec = tool_choice_constraint(setup, TOOLS, "named", "now", parallel=False, in_reasoning=True)
    think_end = tok.convert_tokens_to_ids("</think>")
    assert spec.enable_after_token_ids == (think_end,)
    grammar = compiler.new(spec)
    for t in tok("some free reasoning", add_special_tokens=False).input_ids + [think_end]:
        grammar.accept(t)
    assert grammar.active and not grammar.failed
