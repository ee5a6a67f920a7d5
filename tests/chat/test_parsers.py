"""Each family's parser against its chat template: tool calls (and reasoning) rendered by the family's
format and parsed back equal the originals, whole and streamed (text deltas cut at every token
boundary, as the engine's detokenizer hands them out, and at every character); malformed output
degrades to plain content and never raises."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from dayzero.chat.formats import FORMATS, detect_format, format_named
from dayzero.chat.output import OutputDelta, parse_output
from dayzero.engine.detokenizer import IncrementalDetokenizer
from tests.chat.families import FAMILIES

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "search.web", "description": "",
                                           "parameters": {"type": "object"}}}]
CALLS = [("get_weather", {"city": "Paris <b> & \"Nice\"", "days": 3}),
         ("search.web", {"q": "naïve café 日本", "filters": [1, 2.5, None, True], "deep": {"a": {"b": []}}}),
         ("get_weather", {})]
EOS = ("<｜end▁of▁sentence｜>", "<|im_end|>", "<|call|>", "<|return|>")


def conversation(family: str, calls, content: str | None, reasoning: str | None):
    tool_calls = [{"id": f"functions.{name}:{i}", "type": "function",
                   "function": {"name": name, "arguments": json.dumps(args) if family == "deepseek_v31" else args}}
                  for i, (name, args) in enumerate(calls)]
    assistant = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"}, assistant]


def model_output(tokenizer, messages) -> str:
    """What the model writes for the last (assistant) message: the full rendering minus the generation prompt."""
    prefix = tokenizer.apply_chat_template(messages[:-1], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert full.startswith(prefix)
    out = full[len(prefix):]
    for eos in EOS:  # a stop token ends generation and its text is not returned
        if out.endswith(eos):
            return out[:-len(eos)]
    return out


def token_deltas(tokenizer, text: str) -> list[str]:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    output: list[int] = []
    detok = IncrementalDetokenizer(tokenizer, output, skip_special_tokens=False)
    deltas = []
    for t in ids:
        output.append(t)
        deltas.append(detok.step())
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    return deltas


def stream(parser, pieces) -> OutputDelta:
    total = OutputDelta()
    for piece in pieces:
        total.extend(parser.feed(piece))
    total.extend(parser.finish())
    return total


def calls_of(delta: OutputDelta) -> list[tuple[str | None, str, dict]]:
    calls: dict[int, list] = {}
    for piece in delta.tool_calls:
        if piece.id is not None:
            assert piece.index == len(calls) and piece.arguments == ""
            calls[piece.index] = [piece.id, piece.name, ""]
        calls[piece.index][2] += piece.arguments
    return [(i, n, json.loads(a)) for i, n, a in calls.values()]


CASES = [(CALLS, "Let me check.", "The user wants weather; call the tool."), (CALLS[:1], None, None),
         (CALLS[1:], "", None)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_round_trip(family_tokenizers, family, case):
    calls, content, reasoning = CASES[case]
    if family == "deepseek_v31" or family.startswith("deepseek_v"):
        reasoning = None  # DeepSeek's templates drop earlier turns' reasoning
    tok = family_tokenizers[family]
    text = model_output(tok, conversation(family, calls, content, reasoning))
    fmt = detect_format("", tok.chat_template)
    assert fmt is FORMATS[family]
    want = [(name, args) for name, args in calls]
    want_content = None if family == "gpt_oss" else (content or None)  # gpt-oss's template drops it with calls

    whole = parse_output(fmt.new_parser(reasoning=False, tools=True), text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == want
    assert (whole.content, whole.reasoning) == (want_content, reasoning)
    if family == "kimi_k2":
        assert [c.id for c in whole.tool_calls] == [f"functions.{n}:{i}" for i, (n, _) in enumerate(calls)]

    for pieces in (token_deltas(tok, text), list(text)):  # every token boundary, every character
        streamed = stream(fmt.new_parser(reasoning=False, tools=True), pieces)
        assert [(n, a) for _, n, a in calls_of(streamed)] == want
        assert (streamed.content or None, streamed.reasoning or None) == (want_content, reasoning)
    for cut in range(len(text) + 1):  # two deltas split at every character
        streamed = stream(fmt.new_parser(reasoning=False, tools=True), [text[:cut], text[cut:]])
        assert [(n, a) for _, n, a in calls_of(streamed)] == want


@pytest.mark.parametrize("family", ["deepseek_v31", "deepseek_v4", "kimi_k2"])
def test_reasoning_from_a_thinking_prompt(family_tokenizers, family):
    """A thinking-mode prompt ends with <think>: the output is reasoning up to </think>, then content."""
    fmt = FORMATS[family]
    text = "Think about <b>it</b>, then\nanswer.</think>\n\nThe answer is 4."
    whole = parse_output(fmt.new_parser(reasoning=True, tools=True), text)
    assert (whole.reasoning, whole.content, whole.tool_calls) == ("Think about <b>it</b>, then\nanswer.",
                                                                  "The answer is 4.", [])
    streamed = stream(fmt.new_parser(reasoning=True, tools=True), list(text))
    assert (streamed.reasoning, streamed.content) == ("Think about <b>it</b>, then\nanswer.", "The answer is 4.")
    off = parse_output(fmt.new_parser(reasoning=True, tools=True, parse_reasoning=False), text)
    assert off.reasoning is None and off.content == text


def test_without_tools_markup_is_content():
    fmt = FORMATS["kimi_k2"]
    text = "a<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    assert parse_output(fmt.new_parser(reasoning=False, tools=False), text).content == text


def test_named_parsers_and_aliases():
    assert format_named("deepseekv31") is FORMATS["deepseek_v31"] and format_named("openai") is FORMATS["gpt_oss"]
    assert format_named("none") is None
    with pytest.raises(ValueError, match="unknown parser 'frob'"):
        format_named("frob")
    assert detect_format("gpt_oss", None) is FORMATS["gpt_oss"] and detect_format("llama", "{{ x }}") is None


@pytest.mark.parametrize("family", FAMILIES)
def test_truncated_output_degrades_to_content(family_tokenizers, family):
    """Every prefix of a well-formed output (the model stopped by max_tokens anywhere) parses without
    raising; one cut inside a call has no tool calls and its text as content."""
    tok = family_tokenizers[family]
    text = model_output(tok, conversation(family, CALLS[:2], "Checking.", None))
    fmt = FORMATS[family]
    for cut in range(len(text)):
        whole = parse_output(fmt.new_parser(reasoning=False, tools=True), text[:cut])
        streamed = stream(fmt.new_parser(reasoning=False, tools=True), list(text[:cut]))
        if len(whole.tool_calls) < 2 and cut:
            assert all(c.name in ("get_weather", "search.web") for c in whole.tool_calls)
        assert isinstance(streamed, OutputDelta)
    broken = text.replace("get_weather", "get weather", 1)[: len(text) // 2] + "}}<garbage"
    assert parse_output(fmt.new_parser(reasoning=False, tools=True), broken).tool_calls == []


_MARKUP = ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
           "<｜tool▁calls▁end｜>", "<｜DSML｜tool_calls>", '<｜DSML｜invoke name="f">',
           '<｜DSML｜parameter name="a" string="false">', "</｜DSML｜parameter>", "</｜DSML｜invoke>",
           "</｜DSML｜tool_calls>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.f:0",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|channel|>",
           "analysis", "commentary to=functions.f", "<|message|>", "<|end|>", "<|start|>", "assistant", "<think>",
           "</think>", "{", "}", '"a": 1', "\n", " ", "x"]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(FAMILIES), st.lists(st.sampled_from(_MARKUP), max_size=14), st.booleans(), st.integers(1, 5))
def test_random_markup_never_raises(family, pieces, reasoning, step):
    text = "".join(pieces)
    fmt = FORMATS[family]
    whole = parse_output(fmt.new_parser(reasoning=reasoning, tools=True), text)
    for call in whole.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
    stream(fmt.new_parser(reasoning=reasoning, tools=True), [text[i:i + step] for i in range(0, len(text), step)])
