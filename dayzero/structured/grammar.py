"""Grammars through llguidance: checked and compiled once per distinct constraint, one matcher per request.

llguidance (guidance-ai/llguidance, a Rust library with an abi3 wheel and no Python dependencies)
builds the token mask lazily from a lexer over the tokenizer's token trie, so a JSON schema needs no
ahead-of-time compilation (on the CPU here, a synthetic 201K vocabulary: checking a schema 0.1-11 ms,
a request's matcher 0.2-0.9 ms, one row's mask a fraction of a millisecond: bench/structured.py). The
tokenizer is handed over once (`llguidance.hf.from_tokenizer`, about a second for 200K tokens, done
at the first constrained request); token ids past the tokenizer's (the model's padded vocabulary)
are never allowed. Special tokens (0xFF-prefixed in llguidance's view) never match grammar text: a
grammar names them by id, `<[id]>`.

Masks: `Grammar.accept(token)` advances the matcher with every token appended to the request, in
order; the sampler asks for the mask of the next token (dayzero/structured/bitmask.py). Once the
grammar is complete the mask allows only the EOS ids, so the request ends with "stop" (with
ignore_eos it keeps sampling EOS until max_tokens). A matcher that enters an error state (a token it
refused: none can be sampled under its mask, so this means a bug or a token forced around it) allows
EOS only from then on and logs why.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

from dayzero.structured.params import StructuredOutputs

log = logging.getLogger("dayzero")

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: `{"a":1}`, no free whitespace between tokens
CACHE_SIZE = 256  # compiled grammars kept (least recently used out first)


class GrammarError(ValueError):
    """A constraint llguidance refuses; `param` is the request field it came from (StructuredOutputs.source)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it, and every distinct constraint compiled once.

    vocab_size: the model's (logits) vocabulary, >= the tokenizer's; eos_token_ids: what the mask
    allows once a grammar is complete. Thread-safe: the server checks grammars on its event loop while
    the engine thread creates matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._compiled: OrderedDict[tuple[str, str], str] = OrderedDict()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputs) -> str:
        """llguidance's grammar for spec, checked; GrammarError naming spec.source if it is invalid."""
        key = spec.key
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        grammar = _grammar_text(spec)
        from llguidance import LLMatcher

        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise GrammarError(f"{spec.source}: invalid {_NAMES[spec.kind]}: {messages[0].strip()}", spec.source)
        with self._lock:
            self._compiled[key] = grammar
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return grammar

    def new(self, spec: StructuredOutputs) -> "Grammar":
        """A fresh matcher for one request (spec compiled if it was not yet)."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.ll_tokenizer, self.compile(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{spec.source}: {matcher.get_error()}", spec.source)
        return Grammar(matcher, frozenset(spec.enable_after_token_ids), self.eos_token_ids)


_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regular expression",
          "grammar": "EBNF grammar", "lark": "Lark grammar"}


def _grammar_text(spec: StructuredOutputs) -> str:
    from llguidance import LLMatcher, grammar_from

    try:
        if spec.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if spec.regex is not None:
            return LLMatcher.grammar_from_regex(spec.regex)
        if spec.grammar is not None:
            return grammar_from("gbnf", spec.grammar)
        return LLMatcher.grammar_from_lark(spec.lark)
    except (ValueError, TypeError) as exc:  # not JSON, not a schema object, a GBNF that does not convert
        raise GrammarError(f"{spec.source}: invalid {_NAMES[spec.kind]}: {exc}", spec.source) from None


class Grammar:
    """One request's matcher. `accept` every token appended to the request, in order; `active` says
    whether the next token is constrained (False until one of enable_after is sampled)."""

    def __init__(self, matcher, enable_after: frozenset[int], eos_token_ids: list[int]):
        self.matcher = matcher
        self.enable_after = enable_after
        self.eos_token_ids = eos_token_ids
        self.active = not enable_after
        self.num_accepted = 0

    def accept(self, token: int) -> None:
        self.num_accepted += 1
        if not self.active:
            self.active = token in self.enable_after
            return
        if self.matcher.is_stopped() or self.matcher.is_error():
            return  # complete (EOS only from here) or failed
        if not self.matcher.consume_token(token):
            log.warning("a constrained request sampled token %d that its grammar refuses (%s); it may only end now",
                        token, self.matcher.get_error())

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    @property
    def is_complete(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_accepting()
