"""Kimi K2's tool-call markup (Kimi K2, K2 Thinking, K2.5, Kimi Linear, K3 share the tokenizer's markers):

    {content}<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>
    {arguments JSON}<|tool_call_end|><|tool_call_begin|>...<|tool_call_end|><|tool_calls_section_end|>

The call id is `functions.{name}:{index}` (the index counts calls across the conversation; tool
results answer it by that id). Reasoning: `<think>{reasoning}</think>` opens the thinking models'
answers. Some checkpoints write `<|tool_call_section_begin|>` (singular); both are read.
"""

from __future__ import annotations

from dayzero.chat.output import MarkerCallsParser

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call_name(call_id: str) -> str:
    """`functions.get_weather:0` -> `get_weather`."""
    name = call_id.strip().rsplit(":", 1)[0]
    return name.split(".", 1)[1] if name.startswith("functions.") else name


class KimiK2Parser(MarkerCallsParser):
    section_begin, section_end = SECTION_BEGIN, SECTION_END
    call_begin, header_end, call_end = CALL_BEGIN, ARG_BEGIN, CALL_END

    def _call_header(self, header: str) -> tuple[str, str | None]:
        return call_name(header), header.strip()
