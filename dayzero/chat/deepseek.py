"""DeepSeek's tool-call markup: V3.1 (special tokens around JSON arguments) and DSML (V3.2, V4).

V3.1 (the tokenizer's chat template; `<｜...｜>` markers are single tokens):

    {content}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments JSON}<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>

DSML (DeepSeek-V3.2's `encoding_dsv32.py`, block `function_calls`; DeepSeek-V4's `encoding_dsv4.py`,
block `tool_calls`): parameters as tags, strings as is and other values as JSON:

    {content}\n\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls><｜end▁of▁sentence｜>

Reasoning (both): `{reasoning}</think>{content}` after a prompt that ends with `<think>` (thinking
mode; `</think>` ends the prompt in chat mode). Streaming DSML arguments: each parameter adds its
`"name": value` to the call's JSON text as soon as its closing tag arrives.
"""

from __future__ import annotations

import re

from dayzero.chat.output import MarkerCallsParser, OutputParser, to_json

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DSML = "｜DSML｜"
DSML_BLOCKS = ("function_calls", "tool_calls")  # V3.2, V4


class DeepSeekV31Parser(MarkerCallsParser):
    section_begin, section_end = (CALLS_BEGIN,), (CALLS_END,)
    call_begin, header_end, call_end = CALL_BEGIN, SEP, CALL_END


_INVOKE = re.compile(r'\s*<' + DSML + r'invoke\s+name="([^"]*)"\s*>')
_PARAM = re.compile(r'\s*<' + DSML + r'parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</' + DSML
                    + r'parameter>', re.S)
_INVOKE_END = re.compile(r'\s*</' + DSML + r'invoke>')
_BLOCK_END = re.compile(r'\s*</' + DSML + r'(?:' + "|".join(DSML_BLOCKS) + r')>')


class DsmlParser(OutputParser):
    """DeepSeek-V3.2 and V4 (either block name is read)."""

    openers = tuple(f"<{DSML}{b}>" for b in DSML_BLOCKS)

    def _step(self, final: bool) -> bool:
        handled = self._think_step(final)
        if handled is None:
            handled = self._text_step(self.openers, final)
        if handled is not None:
            return handled
        # "calls" (between invokes) or "invoke" (inside one): match whole tags at the buffer's start
        patterns = ((_INVOKE, self._invoke), (_BLOCK_END, self._block_end)) if self.mode == "calls" else \
            ((_PARAM, self._param), (_INVOKE_END, self._invoke_end))
        for pattern, action in patterns:
            m = pattern.match(self.buf)
            if m:
                self.buf = self.buf[m.end():]
                action(m)
                return True
        if final or (self.buf.strip() and not self._may_grow()):
            self._degrade("")
        return False

    def _may_grow(self) -> bool:
        """Whether the buffer can still become the tag expected next (it is a prefix of one)."""
        head = self.buf.lstrip()
        if self.mode == "calls":
            return any(t.startswith(head) or head.startswith(t) for t in
                       [f"<{DSML}invoke", *(f"</{DSML}{b}>" for b in DSML_BLOCKS)])
        return any(t.startswith(head) or head.startswith(t) for t in (f"<{DSML}parameter", f"</{DSML}invoke>"))

    def _invoke(self, m: re.Match) -> None:
        self._begin_call(m.group(1))
        self.mode = "invoke"

    def _param(self, m: re.Match) -> None:
        name, is_string, value = m.groups()
        first = self.calls[-1]["arguments"] == ""
        self._arguments(("{" if first else ", ") + to_json(name) + ": " + (to_json(value) if is_string == "true" else value))

    def _invoke_end(self, m: re.Match) -> None:
        self._arguments("{}" if self.calls[-1]["arguments"] == "" else "}")
        self._close_call()
        self.mode = "calls"

    def _block_end(self, m: re.Match) -> None:
        self.mode = "after"
