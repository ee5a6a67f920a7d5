"""The chat formats dayzero reads, one per model family, and how a checkpoint picks its own.

A format knows its family's output markup (the parser class: reasoning and tool calls) and writes the
grammar that makes a tool call certain (`tool_call_grammar`: tool_choice "required" or a named
function), in llguidance's Lark syntax: markers that are one token of the vocabulary are named by id
(`<[id]>`: the model must sample that very token), other text as literals, arguments as the tool's
JSON schema (`%json`). Names follow vLLM's and SGLang's `--tool-call-parser` values (both spellings
are accepted).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from dayzero.chat import deepseek, harmony, kimi
from dayzero.chat.output import OutputParser

TokenId = Callable[[str], "int | None"]  # a marker's token id when it is one token of the vocabulary


@dataclass(frozen=True)
class ChatFormat:
    name: str
    parser: type[OutputParser]
    markers: tuple[str, ...]  # the markup's marker strings (special tokens or not)
    grammar: Callable[[list[dict], bool, TokenId], str]  # (tools, parallel, token id) -> the rules after `start`

    @property
    def think_markers(self) -> tuple[str, str] | None:
        return self.parser.think_markers

    def new_parser(self, reasoning: bool, tools: bool, parse_reasoning: bool = True) -> OutputParser:
        parser = self.parser(reasoning=reasoning and parse_reasoning, tools=tools)
        if not parse_reasoning:
            parser.think_markers = None
        return parser

    def tool_call_grammar(self, tools: list[dict], parallel: bool, token_id: TokenId) -> str:
        """A Lark grammar whose every sentence is one well-formed call (several if parallel) of one
        of `tools` (OpenAI function tools; pass one to force it), arguments valid against its schema."""
        return self.grammar(tools, parallel, token_id)


def _lit(marker: str, token_id: TokenId) -> str:
    tid = token_id(marker)
    return f"<[{tid}]>" if tid is not None else json.dumps(marker, ensure_ascii=False)


def _schema(tool: dict) -> str:
    schema = dict(tool["function"].get("parameters") or {"type": "object"})
    schema["x-guidance"] = {"whitespace_flexible": False}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _name(tool: dict) -> str:
    return tool["function"]["name"]


def _v31_grammar(tools, parallel, tid) -> str:
    fns = " | ".join(f"{json.dumps(_name(t))} {_lit(deepseek.SEP, tid)} {_schema(t)}" for t in tools)
    calls = "call+" if parallel else "call"
    return (f"start: {_lit(deepseek.CALLS_BEGIN, tid)} {calls} {_lit(deepseek.CALLS_END, tid)}\n"
            f"call: {_lit(deepseek.CALL_BEGIN, tid)} fn {_lit(deepseek.CALL_END, tid)}\n"
            f"fn: {fns}\n")


def _dsml_grammar(block: str) -> Callable:
    def grammar(tools, parallel, tid) -> str:
        d = deepseek.DSML
        rules, invokes = [], []
        for i, t in enumerate(tools):
            params = t["function"].get("parameters") or {}
            props = params.get("properties")
            required = set(params.get("required", []))
            parts = []
            if props is None:  # any parameters: free names, string values
                rules.append(f'free{i}: "<{d}parameter name=\\"" /[A-Za-z0-9_]+/ "\\" string=\\"true\\">" DSML_TEXT '
                             f'"</{d}parameter>\\n"')
                parts.append(f"free{i}*")
            for j, (key, sub) in enumerate(props.items() if props else []):
                is_string = isinstance(sub, dict) and (sub.get("type") == "string" or (
                    isinstance(sub.get("enum"), list) and sub["enum"] and all(isinstance(v, str) for v in sub["enum"])))
                head = json.dumps(f'<{d}parameter name="{key}" string="{"true" if is_string else "false"}">',
                                  ensure_ascii=False)
                if is_string:
                    value = _dsml_string(sub)
                else:
                    value = "%json " + json.dumps({**(sub if isinstance(sub, dict) else {}),
                                                   "x-guidance": {"whitespace_flexible": False}}, ensure_ascii=False)
                rules.append(f'p{i}_{j}: {head} {value} "</{d}parameter>\\n"')
                parts.append(f"p{i}_{j}" if key in required else f"p{i}_{j}?")
            head = json.dumps(f'<{d}invoke name="{_name(t)}">\n', ensure_ascii=False)
            rules.append(f'inv{i}: {head} {" ".join(parts)} "</{d}invoke>"')
            invokes.append(f"inv{i}")
        more = ' ("\\n" invoke)*' if parallel else ""
        open_, close = json.dumps(f"<{d}{block}>\n", ensure_ascii=False), json.dumps(f"\n</{d}{block}>", ensure_ascii=False)
        return (f"start: {open_} invoke{more} {close}\n"
                f"invoke: {' | '.join(invokes)}\n" + "\n".join(rules) + "\nDSML_TEXT: /[^<]*/\n")  # free parameters
    return grammar


def _dsml_string(schema: dict) -> str:
    """A string parameter's value as DSML writes it (as is, no quotes): its enum, its pattern, or text
    without '<' within its length bounds."""
    if isinstance(schema.get("enum"), list):
        return "(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"]) + ")"
    if isinstance(schema.get("pattern"), str):
        return "/" + schema["pattern"].replace("/", "\\/") + "/"
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    return f"/[^<]{{{int(low)},{'' if high is None else int(high)}}}/"


def _kimi_grammar(tools, parallel, tid) -> str:
    fns = " | ".join(f"{json.dumps('functions.' + _name(t) + ':')} /[0-9]{{1,3}}/ {_lit(kimi.ARG_BEGIN, tid)} {_schema(t)}"
                     for t in tools)
    calls = "call+" if parallel else "call"
    return (f"start: {_lit(kimi.SECTION_BEGIN[0], tid)} {calls} {_lit(kimi.SECTION_END[0], tid)}\n"
            f"call: {_lit(kimi.CALL_BEGIN, tid)} fn {_lit(kimi.CALL_END, tid)}\n"
            f"fn: {fns}\n")


def _harmony_grammar(tools, parallel, tid) -> str:
    # One call per turn (<|call|> stops the turn); the call is written straight away, without an analysis message.
    fns = " | ".join(f"{json.dumps(_name(t) + ' ')} {_lit(harmony.CONSTRAIN, tid)} \"json\" {_lit(harmony.MESSAGE, tid)} "
                     f"{_schema(t)}" for t in tools)
    return (f"start: {_lit(harmony.CHANNEL, tid)} \"commentary to=functions.\" fn {_lit(harmony.CALL, tid)}\n"
            f"fn: {fns}\n")


_DEEPSEEK_V31_MARKERS = (deepseek.CALLS_BEGIN, deepseek.CALLS_END, deepseek.CALL_BEGIN, deepseek.CALL_END, deepseek.SEP,
                         "<think>", "</think>")
_KIMI_MARKERS = (*kimi.SECTION_BEGIN, *kimi.SECTION_END, kimi.CALL_BEGIN, kimi.ARG_BEGIN, kimi.CALL_END, "<think>", "</think>")
_HARMONY_MARKERS = (harmony.CHANNEL, harmony.MESSAGE, harmony.START, harmony.END, harmony.CALL, harmony.RETURN,
                    harmony.CONSTRAIN)

FORMATS = {
    "deepseek_v31": ChatFormat("deepseek_v31", deepseek.DeepSeekV31Parser, _DEEPSEEK_V31_MARKERS, _v31_grammar),
    "deepseek_v32": ChatFormat("deepseek_v32", deepseek.DsmlParser, ("<think>", "</think>"), _dsml_grammar("function_calls")),
    "deepseek_v4": ChatFormat("deepseek_v4", deepseek.DsmlParser, ("<think>", "</think>"), _dsml_grammar("tool_calls")),
    "kimi_k2": ChatFormat("kimi_k2", kimi.KimiK2Parser, _KIMI_MARKERS, _kimi_grammar),
    "gpt_oss": ChatFormat("gpt_oss", harmony.HarmonyParser, _HARMONY_MARKERS, _harmony_grammar),
}
ALIASES = {"deepseekv31": "deepseek_v31", "deepseekv3": "deepseek_v31", "deepseekv32": "deepseek_v32",
           "deepseekv4": "deepseek_v4", "kimi": "kimi_k2", "kimik2": "kimi_k2", "gpt-oss": "gpt_oss",
           "openai": "gpt_oss", "harmony": "gpt_oss", "deepseek_r1": "deepseek_v31", "deepseek-r1": "deepseek_v31"}


def format_named(name: str) -> ChatFormat | None:
    """The format a --tool-call-parser / --reasoning-parser value names ("none": None); ValueError if unknown."""
    if name == "none":
        return None
    key = ALIASES.get(name, ALIASES.get(name.replace("_", "").replace("-", ""), name))
    if key not in FORMATS:
        raise ValueError(f"unknown parser {name!r}; choose one of {', '.join(FORMATS)} (or none)")
    return FORMATS[key]


def detect_format(model_type: str, chat_template: str | None) -> ChatFormat | None:
    """The checkpoint's format: from its chat template's markup where it has one, else its model type."""
    t = chat_template or ""
    if harmony.CHANNEL in t or model_type == "gpt_oss":
        return FORMATS["gpt_oss"]
    if kimi.SECTION_BEGIN[0] in t or model_type in ("kimi_k2", "kimi_k25", "kimi_linear", "kimi_k3"):
        return FORMATS["kimi_k2"]
    if f"<{deepseek.DSML}tool_calls>" in t or (model_type == "deepseek_v4" and deepseek.DSML not in t):
        return FORMATS["deepseek_v4"]
    if deepseek.DSML in t or model_type == "deepseek_v32":
        return FORMATS["deepseek_v32"]
    if deepseek.CALLS_BEGIN in t or model_type == "deepseek_v3":
        return FORMATS["deepseek_v31"]
    return None
