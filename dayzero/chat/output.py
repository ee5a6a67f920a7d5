"""What a chat model's output holds once its family's markup is read: reasoning, content, tool calls.

A family's parser (dayzero/chat/<family>.py) reads the output text with its special tokens kept
(the server detokenizes such requests with skip_special_tokens=False) and turns it into deltas:
reasoning text, content text, and tool-call events (a call's start with its id and name, then
pieces of its JSON arguments), as the OpenAI API streams them. The same parser serves both answers:
streaming feeds it each text delta, non-streaming feeds the whole text once (`parse_output`), so
the two agree on every well-formed output.

Markup is matched on text, not token ids, so a marker split across deltas is found: the scanner holds
back any tail of the buffer that could still grow into a marker. Output the format cannot read (a
tool call that never closes, arguments that are not JSON, text where a marker must come) degrades:
non-streaming returns the raw text after the reasoning as plain `content` and no tool calls;
streaming, which cannot take back what it sent, turns the rest of the output into content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCallDelta:
    """One piece of a streamed tool call: the first has id and name (and arguments ""), the others
    pieces of the arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: "OutputDelta") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def to_json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class OutputParser:
    """Streaming reader of one output. Subclasses define the family's markup in `_step`.

    reasoning: the output starts inside the reasoning block (the prompt ended with its opening
    marker); think_markers: the (start, end) markers of a reasoning block, or None for formats
    without one; tools: the request offered tools (else tool markup is plain content)."""

    think_markers: tuple[str, str] | None = ("<think>", "</think>")

    def __init__(self, reasoning: bool = False, tools: bool = True):
        self.mode = "reasoning" if reasoning and self.think_markers else "content"
        self.tools = tools
        self.buf = ""
        self.started = False  # any text was read
        self.malformed = False
        self.calls: list[dict] = []  # {"id", "name", "arguments", "closed"} per call begun
        self.held_space = ""  # trailing whitespace of content, held until we know whether a tool block follows
        self.after_reasoning = False  # the newlines that follow a reasoning block's end are not content
        self._out = OutputDelta()

    # -- the public interface ----------------------------------------------------------------------
    def feed(self, text: str) -> OutputDelta:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> OutputDelta:
        """The end of the output: what was held back, and unclosed markup read as it stands."""
        out = self._run(final=True)
        if self.held_space:
            out.content += self.held_space
            self.held_space = ""
        return out

    def _run(self, final: bool) -> OutputDelta:
        self._out = OutputDelta()
        while self._step(final):
            pass
        return self._out

    # -- helpers for subclasses --------------------------------------------------------------------
    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    def _until(self, markers: tuple[str, ...], final: bool) -> tuple[str, str | None]:
        """(text before the first marker found, the marker), consuming both; without a marker, the text
        that cannot be the start of one (all of it when final) and None."""
        hits = [(i, m) for m in markers if (i := self.buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
            text, self.buf = self.buf[:i], self.buf[i + len(marker):]
            return text, marker
        keep = 0 if final else _partial_marker(self.buf, markers)
        text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return text, None

    def _starts(self, marker: str, final: bool) -> bool | None:
        """Whether the buffer (after leading whitespace) starts with marker: True (consumed), False, or
        None when it cannot tell yet (the buffer is a prefix of it)."""
        stripped = self.buf.lstrip()
        if stripped.startswith(marker):
            self.buf = stripped[len(marker):]
            return True
        if not final and marker.startswith(stripped):
            return None
        return False

    def _reasoning(self, text: str) -> None:
        self._out.reasoning += text

    def _content(self, text: str) -> None:
        if self.after_reasoning:
            text = text.lstrip("\n")
            self.after_reasoning = not text
        if not text:
            return
        if not self.tools:
            self._out.content += text
            return
        text = self.held_space + text
        body = text.rstrip()
        self.held_space = text[len(body):]
        self._out.content += body

    def _drop_held_space(self) -> None:
        self.held_space = ""

    def _begin_call(self, name: str, call_id: str | None = None) -> None:
        call = {"id": call_id or new_call_id(), "name": name, "arguments": "", "closed": False}
        self.calls.append(call)
        self._out.tool_calls.append(ToolCallDelta(len(self.calls) - 1, call["id"], name, ""))

    def _arguments(self, text: str) -> None:
        if text:
            self.calls[-1]["arguments"] += text
            self._out.tool_calls.append(ToolCallDelta(len(self.calls) - 1, arguments=text))

    def _close_call(self) -> None:
        self.calls[-1]["closed"] = True

    def _degrade(self, text: str) -> None:
        """Markup the format cannot read: the rest of the output is content."""
        self.malformed = True
        self.mode = "raw"
        self._content(text + self.buf)
        self.buf = ""

    def _think_step(self, final: bool) -> bool | None:
        """The reasoning block's part of a step: True/False when it handled the step, None to go on."""
        if self.think_markers is None:
            return None
        start, end = self.think_markers
        if self.mode == "reasoning":
            text, marker = self._until((end,), final)
            self._reasoning(text)
            if marker is not None:
                self.mode = "content"
                self.after_reasoning = True
                return True
            return False
        if self.mode == "content" and not self.started:  # a reasoning block opened by the output itself
            opened = self._starts(start, final)
            if opened is None:
                return False
            self.started = True
            if opened:
                self.mode = "reasoning"
                return True
        return None


    def _text_step(self, openers: tuple[str, ...], final: bool) -> bool | None:
        """Content up to a tool block's opener (plain content when tools are off, after a block, or once
        degraded): True/False when it handled the step, None when a tool block is being read."""
        if self.mode in ("raw", "after") or (self.mode == "content" and not self.tools):
            text, _ = self._until((), final)
            self._content(text)
            return False
        if self.mode != "content":
            return None
        text, marker = self._until(openers, final)
        self._content(text)
        if marker is None:
            return False
        self._drop_held_space()
        self.mode = "calls"
        return True


class MarkerCallsParser(OutputParser):
    """Tool calls between special-token markers, arguments as JSON text (DeepSeek-V3.1, Kimi K2):

        {section_begin}{call_begin}{header}{header_end}{arguments}{call_end}...{section_end}

    `_call_header(header)` gives the call's (name, id or None for a fresh one)."""

    section_begin: tuple[str, ...]
    section_end: tuple[str, ...]
    call_begin: str
    header_end: str
    call_end: str

    def _call_header(self, header: str) -> tuple[str, str | None]:
        return header.strip(), None

    def _step(self, final: bool) -> bool:
        handled = self._think_step(final)
        if handled is None:
            handled = self._text_step(self.section_begin, final)
        if handled is not None:
            return handled
        if self.mode == "calls":  # between calls: the next call or the end of the section
            for marker, mode in ((self.call_begin, "header"), *((m, "after") for m in self.section_end)):
                found = self._starts(marker, final)
                if found is None:
                    return False
                if found:
                    self.mode = mode
                    return True
            if self.buf or final:
                self._degrade("")
            return False
        if self.mode == "header":
            header, marker = self._until((self.header_end,), final)
            if marker is None:
                self.buf = header + self.buf  # wait for the whole header
                if final:
                    self._degrade("")
                return False
            self._begin_call(*self._call_header(header))
            self.mode = "arguments"
            return True
        text, marker = self._until((self.call_end,), final)  # arguments
        self._arguments(text)
        if marker is None:
            return False
        self._close_call()
        self.mode = "calls"
        return True


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest suffix of text that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def parse_output(parser: OutputParser, text: str) -> ParsedOutput:
    """The whole output at once (non-streaming). Malformed tool markup, an unclosed call or arguments
    that are not a JSON object leave the text after the reasoning as plain content."""
    out = parser.feed(text)
    out.extend(parser.finish())
    calls = parser.calls
    ok = not parser.malformed and all(c["closed"] and _is_json_object(c["arguments"]) for c in calls)
    if not ok:
        raw = text
        if out.reasoning and parser.think_markers is not None:
            end = parser.think_markers[1]
            raw = text.split(end, 1)[1] if end in text else ""
        return ParsedOutput(out.reasoning or None, raw.strip() or None, [])
    return ParsedOutput(out.reasoning or None, out.content or None,
                        [ToolCall(c["id"], c["name"], c["arguments"]) for c in calls])


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
