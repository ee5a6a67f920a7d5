"""Kimi K2's tool-call markup (Kimi K2, K2 Thinking, K2.5, Kimi Linear, K3 share the tokenizer's markers):

    {content}<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>
    {arguments JSON}<|tool_call_end|><|tool_call_begin|>...<|tool_call_end|><|tool_calls_section_end|>

The call id is `functions.{name}:{index}` (the index counts calls across the conversation; tool
results answer it by that id). Reasoning: `<think>{reasoning}</think>` opens the thinking models'
answers. Some checkpoints write `<|tool_call_section_begin|>` (singular); both are read.
"""

from __future__ import annotations

from dayzero.chat.output import OutputParser

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call_name(call_id: str) -> str:
    """`functions.get_weather:0` -> `get_weather`."""
    name = call_id.strip().rsplit(":", 1)[0]
    return name.split(".", 1)[1] if name.startswith("functions.") else name


class KimiK2Parser(OutputParser):
    def _step(self, final: bool) -> bool:
        handled = self._think_step(final)
        if handled is not None:
            return handled
        if self.mode in ("content", "raw", "after"):
            if self.mode != "content" or not self.tools:
                text, _ = self._until((), final)
                self._content(text)
                return False
            text, marker = self._until(SECTION_BEGIN, final)
            self._content(text)
            if marker is None:
                return False
            self._drop_held_space()
            self.mode = "calls"
            return True
        if self.mode == "calls":
            for markers, mode in (((CALL_BEGIN,), "id"), (SECTION_END, "after")):
                for marker in markers:
                    found = self._starts(marker, final)
                    if found is None:
                        return False
                    if found:
                        self.mode = mode
                        return True
            if self.buf or final:
                self._degrade("")
            return False
        if self.mode == "id":
            call_id, marker = self._until((ARG_BEGIN,), final)
            if marker is None:
                self.buf = call_id + self.buf
                if final:
                    self._degrade("")
                return False
            self._begin_call(call_name(call_id), call_id.strip())
            self.mode = "arguments"
            return True
        text, marker = self._until((CALL_END,), final)  # arguments
        self._arguments(text)
        if marker is not None:
            self._close_call()
            self.mode = "calls"
            return True
        return False
