"""Chat requests' tools, reasoning and structured outputs: from the request to the prompt and the
constraint, and from the output text to the message (reasoning_content, content, tool_calls).

The checkpoint's chat format (dayzero/chat/formats.py) is detected once from its chat template and
model type (`--tool-call-parser` / `--reasoning-parser` override it, `none` turns it off). Per request:
tools and tool_choice are checked (an unknown tool name, tools on a template that has no tools, a
parameters schema llguidance refuses: 400 naming the field), the conversation is rendered by the
checkpoint's template with the tools (assistant tool calls' JSON arguments handed over as mappings, as
transformers' templates expect; a template that only takes text is given the text), and the
constraint is built: response_format / regex / ebnf, or the family's tool-call grammar for
tool_choice "required" or a named function (it starts after `</think>` when the prompt opened a
reasoning block). Each output sequence gets its own streaming parser.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Callable

from dayzero.chat.formats import ChatFormat, detect_format, format_named
from dayzero.chat.output import OutputDelta, OutputParser, ParsedOutput, parse_output
from dayzero.server.protocol import APIError
from dayzero.structured import StructuredOutputs

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class ChatSetup:
    """What the server knows about the checkpoint's chat format, decided once at start-up."""

    format: ChatFormat | None  # reads the output (tool calls and/or reasoning); None: plain text
    tools: bool  # tool calls are parsed (a tool-call parser is on)
    reasoning: bool  # reasoning blocks go to reasoning_content (a reasoning parser is on)
    template_has_tools: bool
    special_markers: bool  # some marker is a special token: such requests detokenize with skip_special_tokens=False
    token_id: Callable[[str], "int | None"] = field(repr=False, default=lambda s: None)

    @property
    def name(self) -> str | None:
        return self.format.name if self.format is not None else None


def chat_setup(tokenizer, model_type: str, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> ChatSetup:
    """tool_call_parser / reasoning_parser: a format name, "none", or None (detect from the checkpoint)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    template = template if isinstance(template, str) else None
    detected = detect_format(model_type, template)
    tool_fmt = detected if tool_call_parser is None else format_named(tool_call_parser)
    reason_fmt = detected if reasoning_parser is None else format_named(reasoning_parser)
    fmt = tool_fmt or reason_fmt
    reasoning = reason_fmt is not None and (reason_fmt.think_markers is not None or reason_fmt.name == "gpt_oss")
    specials = set()
    if tokenizer is not None:
        specials = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}

    def token_id(text: str) -> int | None:
        return vocab.get(text)

    return ChatSetup(fmt, tool_fmt is not None, reasoning, _template_uses_tools(template),
                     fmt is not None and any(m in specials for m in fmt.markers), token_id)


def _template_uses_tools(template: str | None) -> bool:
    if not template:
        return False
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return "tools" in template


# ---------------------------------------------------------------------------------------------------
# Requests


def check_tools(tools: list | None) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of function tools", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise APIError(400, f"{where}: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise APIError(400, f"{where}.function.name: {name!r} is not a valid function name (letters, digits, "
                                "_ . -; at most 64)", f"{where}.function.name")
        if name in names:
            raise APIError(400, f"{where}.function.name: {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
    return tools


def check_tool_choice(tool_choice, tools: list[dict]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function or None)."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice {tool_choice!r} is invalid: expected none, auto, required or "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if tool_choice != "none" and not tools:
            raise APIError(400, f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise APIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", "tool_choice")
    known = [t["function"]["name"] for t in tools]
    if name not in known:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the request's tools "
                            f"({', '.join(known) or 'none given'})", "tool_choice")
    return "named", name


def tool_arguments_as_mappings(messages: list[dict]) -> list[dict]:
    """The conversation with assistant tool calls' JSON-text arguments turned into mappings."""
    out = copy.deepcopy(messages)
    for i, m in enumerate(out):
        for j, call in enumerate(m.get("tool_calls") or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    where = f"messages.{i}.tool_calls.{j}.function.arguments"
                    raise APIError(400, f"{where}: not JSON", where) from None
    return out


def render(llm, messages: list[dict], tools: list[dict], template_kwargs: dict) -> list[int]:
    """The prompt ids: the template with mappings as tool-call arguments, else (a template that
    concatenates them as text) with the arguments as the client sent them."""
    tools_arg = tools or None
    try:
        return llm.apply_chat_template(tool_arguments_as_mappings(messages), tools=tools_arg, **template_kwargs)
    except APIError:
        raise
    except Exception as first:  # noqa: BLE001 - the template's own error, reported below
        if not any(m.get("tool_calls") for m in messages):
            raise APIError(400, f"messages: the chat template failed: {first}", "messages") from None
        try:
            return llm.apply_chat_template(messages, tools=tools_arg, **template_kwargs)
        except Exception as exc:  # noqa: BLE001
            raise APIError(400, f"messages: the chat template failed: {exc}", "messages") from None


@dataclass
class ChatPlan:
    """One request's reading of its output: whether to parse tool calls and reasoning, and how."""

    setup: ChatSetup
    parse_tools: bool
    in_reasoning: bool  # the prompt opened a reasoning block

    @property
    def active(self) -> bool:
        return self.setup.format is not None and (self.parse_tools or self.setup.reasoning)

    def new_parser(self) -> OutputParser | None:
        if not self.active:
            return None
        return self.setup.format.new_parser(self.in_reasoning, self.parse_tools, self.setup.reasoning)


def prompt_in_reasoning(setup: ChatSetup, tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends inside a reasoning block (a thinking-mode generation prompt ends with `<think>`)."""
    fmt = setup.format
    if fmt is None or fmt.think_markers is None or tokenizer is None or not setup.reasoning:
        return False
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False).rstrip()
    start, end = fmt.think_markers
    return tail.endswith(start)


def tool_choice_constraint(setup: ChatSetup, tools: list[dict], mode: str, name: str | None, parallel: bool,
                           in_reasoning: bool) -> StructuredOutputs | None:
    if mode not in ("required", "named"):
        return None
    chosen = [t for t in tools if t["function"]["name"] == name] if mode == "named" else tools
    grammar = setup.format.tool_call_grammar(chosen, parallel and mode == "required", setup.token_id)
    after: tuple[int, ...] = ()
    if in_reasoning:
        end = setup.format.think_markers[1]
        end_id = setup.token_id(end)
        if end_id is not None:
            after = (end_id,)
        else:  # `</think>` is not one token: the grammar closes the reasoning block itself
            grammar = grammar.replace("start:", "start: " + json.dumps(end), 1)
    return StructuredOutputs(lark=grammar, enable_after_token_ids=after, source="tool_choice")


def reasoning_gate(setup: ChatSetup, spec: StructuredOutputs | None, in_reasoning: bool) -> StructuredOutputs | None:
    """A response_format constraint starts after the reasoning block when the prompt opened one."""
    if spec is None or not in_reasoning:
        return spec
    end_id = setup.token_id(setup.format.think_markers[1])
    if end_id is None:
        return spec
    return StructuredOutputs(json=spec.json, json_object=spec.json_object, regex=spec.regex, grammar=spec.grammar,
                             lark=spec.lark, enable_after_token_ids=(end_id,), source=spec.source)


# ---------------------------------------------------------------------------------------------------
# Responses


def message(parsed: ParsedOutput | None, text: str) -> dict:
    if parsed is None:
        return {"role": "assistant", "content": text}
    out = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        out["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        out["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
    return out


def parse_whole(parser: OutputParser | None, text: str) -> ParsedOutput | None:
    return None if parser is None else parse_output(parser, text)


def delta_fields(delta: OutputDelta) -> dict:
    """An OpenAI stream chunk's delta: reasoning_content, content, tool_calls (a call's first piece has
    its id, type and name; later ones only argument text), one entry per call index."""
    out: dict = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    calls: dict[int, dict] = {}
    for piece in delta.tool_calls:
        entry = calls.get(piece.index)
        if entry is None:
            entry = calls[piece.index] = {"index": piece.index, "function": {"arguments": ""}}
        if piece.id is not None:
            entry.update(id=piece.id, type="function")
            entry["function"]["name"] = piece.name
        entry["function"]["arguments"] += piece.arguments
    if calls:
        out["tool_calls"] = list(calls.values())
    return out


def finish_reason(reason: str | None, parser: OutputParser | None, parsed: ParsedOutput | None = None) -> str | None:
    """"tool_calls" for an output that ended by itself ("stop") with tool calls."""
    calls = parsed.tool_calls if parsed is not None else (parser.calls if parser is not None else [])
    return "tool_calls" if reason == "stop" and calls else reason
