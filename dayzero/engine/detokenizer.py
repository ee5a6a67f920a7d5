"""Incremental detokenization: one request's output text, a few tokens decoded per step.

Decoding the whole output after every token costs O(length) per step. Instead each step decodes a
short window of tokens (the prefix-offset / read-offset technique): tokens [prefix_offset,
read_offset) are context already turned into text, tokens [read_offset, n) are new. The step's new
text is decode(window + new)[len(decode(window)):], so a decoder whose output for a token depends on
what precedes it (SentencePiece's Metaspace strips the space of a decode's first token; byte-level
BPE needs all bytes of a character) still gives the text the whole decode gives. While the window's
text ends in U+FFFD (a multi-byte character whose bytes have not all arrived) nothing is released
and the offsets stay, so the character comes out whole once its last byte does.

Invariants (the output ids only ever grow by appending):
- `text` (the concatenation of every released piece) equals decode(tokens) up to read_offset, and
  `flush()` releases the rest: after it, text == decode(tokens), with the decode settings below.
- Per step a few decodes of the last released piece's tokens and the ones held since: the work
  does not grow with the output. A run of replacement characters (invalid bytes) is held for about
  MAX_HELD tokens: then the text up to MAX_HELD tokens before the end is released, where decoding
  from that point gives the same text as decoding across it (it cuts no character and no invalid
  byte run; a UTF-8 character has at most 4 bytes, so what follows it decides this already).

Decode settings: skip_special_tokens per request, clean_up_tokenization_spaces off (that clean-up
rewrites text across token boundaries, so it could not be streamed).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole UTF-8 character
MAX_HELD = 3  # tokens held at most while the text ends in REPLACEMENT (every token has >= 1 byte)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, output_ids: list[int], skip_special_tokens: bool = True):
        """output_ids: the request's output token ids, read (never changed) at every `step`."""
        self.tokenizer, self.output_ids, self.skip_special_tokens = tokenizer, output_ids, skip_special_tokens
        # special tokens that decode to nothing are left out of the windows (a window of them alone
        # would be no context); what remains decodes as the whole output does
        self.skipped = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self.tokens: list[int] = []  # output_ids[:num_read] without the skipped ones
        self.num_read = 0
        self.prefix_offset = self.read_offset = 0
        self.pieces: list[str] = []  # the released text, in order
        self.num_chars = 0

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _release(self, piece: str, read_offset: int) -> str:
        self.prefix_offset, self.read_offset = self.read_offset, read_offset
        if piece:
            self.pieces.append(piece)
            self.num_chars += len(piece)
        return piece

    def step(self) -> str:
        """The text that the tokens appended since the last call make final ("" while a character
        is incomplete)."""
        self.tokens += [t for t in self.output_ids[self.num_read:] if t not in self.skipped]
        self.num_read = len(self.output_ids)
        n = len(self.tokens)
        if n == self.read_offset:
            return ""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset, n)
        if not full.endswith(REPLACEMENT):
            return self._release(full[len(prefix):], n)
        split = n - MAX_HELD
        if split > self.read_offset:  # a long run of replacement characters: release all but its end
            head = self._decode(self.prefix_offset, split)
            # the split cuts no character and no invalid byte run: decoding from it gives the same text
            if len(head) >= len(prefix) and head + self._decode(split, n) == full:
                return self._release(head[len(prefix):], split)
        return ""

    def flush(self) -> str:
        """Release everything (the request ends): an incomplete character comes out as U+FFFD."""
        piece = self.step()
        n = len(self.tokens)
        if n == self.read_offset:
            return piece
        prefix = self._decode(self.prefix_offset, self.read_offset)
        return piece + self._release(self._decode(self.prefix_offset, n)[len(prefix):], n)

    @property
    def text(self) -> str:
        """All text released so far (joined on each call: read it once, at the end)."""
        return "".join(self.pieces)
