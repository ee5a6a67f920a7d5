"""gpt-oss's harmony format: messages on channels, tool calls addressed to `functions.{name}`.

After the prompt's `<|start|>assistant` the model writes one or more messages:

    <|channel|>analysis<|message|>{reasoning}<|end|>
    <|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}<|call|>
    <|start|>assistant<|channel|>final<|message|>{answer}<|return|>

A header runs from the message's start to `<|message|>`: the channel after `<|channel|>`, the
recipient after `to=` (before or after the channel), a content type (`<|constrain|>json`, `json`).
Messages end with `<|end|>`, or with `<|call|>` / `<|return|>`, which are stop tokens (so usually the
end of the output). The analysis channel is reasoning; a message to `functions.*` is a tool call
(one per turn: `<|call|>` stops generation); final and other commentary messages are content.

openai-harmony (the format's own library) parses this from token ids, but it loads its tokenizer
by downloading o200k_base.tiktoken (hash-checked) at first use; dayzero never downloads at run time,
so it reads the documented format from the text itself, as it reads the other families'.
"""

from __future__ import annotations

import re

from dayzero.chat.output import OutputParser

CHANNEL, MESSAGE, START, END = "<|channel|>", "<|message|>", "<|start|>", "<|end|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"to=(\S+)")


class HarmonyParser(OutputParser):
    think_markers = None

    def __init__(self, reasoning: bool = False, tools: bool = True):
        super().__init__(reasoning, tools)
        self.mode = "header"
        self.header = ""
        self.body = None  # "reasoning" | "content" | "call" while in a message

    def _step(self, final: bool) -> bool:
        if self.mode == "raw":
            text, _ = self._until((), final)
            self._content(text)
            return False
        if self.mode == "between":  # after a message's end: the next one's <|start|>
            found = self._starts(START, final)
            if found is None:
                return False
            if found:
                self.mode = "header"
                return True
            if self.buf.strip() or final:
                self._degrade("")
            else:
                self.buf = ""
            return False
        if self.mode == "header":
            text, marker = self._until((MESSAGE, *_ENDS), final)
            self.header += text
            if marker is None:
                if final and self.header.strip():
                    self._degrade(self.header)
                return False
            if marker != MESSAGE or CHANNEL not in self.header:
                self._degrade(self.header + marker)
                return False
            self._open(self.header)
            self.header = ""
            self.mode = "body"
            return True
        text, marker = self._until(_ENDS, final)  # a message's body
        if self.body == "reasoning":
            self._reasoning(text)
        elif self.body == "call":
            self._arguments(text)
        else:
            self._content(text)
        if marker is not None or final:  # the end of the message (a stop token ends the text itself)
            if self.body == "call":
                self._close_call()
            self.mode = "between"
            return marker is not None
        return False

    def _open(self, header: str) -> None:
        words = header.split(CHANNEL, 1)[1].replace(CONSTRAIN, " ").split()
        channel = words[0] if words else ""
        m = _RECIPIENT.search(header.replace(CHANNEL, " ").replace(CONSTRAIN, " "))
        recipient = m.group(1) if m else None
        if recipient is not None and recipient.startswith("functions.") and self.tools:
            self.body = "call"
            self._drop_held_space()
            self._begin_call(recipient[len("functions."):])
        elif channel == "analysis":
            self.body = "reasoning"
        else:
            self.body = "content"
