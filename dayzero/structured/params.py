"""What a constrained request asks for. Names follow vLLM's StructuredOutputsParams."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of:
    json: a JSON schema (dict or its JSON text): the output is one JSON value valid against it.
    json_object: True: the output is one JSON object, any object.
    regex: the output matches the regular expression (whole).
    grammar: an EBNF grammar (GBNF, as SGLang's and llama.cpp's `ebnf`; Lark is accepted too).
    lark: a grammar in llguidance's Lark syntax (the tool-call grammars; `<[id]>` names a token id).

    enable_after_token_ids: the constraint starts after the request samples one of these ids (a
    thinking model's end-of-reasoning token): the reasoning before it is free. Empty: from the first token.
    source: the request field the constraint came from, named in errors ("response_format", ...).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    lark: str | None = None
    enable_after_token_ids: tuple[int, ...] = ()
    source: str = field(default="structured_outputs", compare=False)

    def __post_init__(self):
        given = [name for name in ("json", "regex", "grammar", "lark") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"{self.source}: give exactly one of json, json_object, regex, grammar, lark; "
                             f"got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "grammar", "lark") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar depends on (the compiler's cache key)."""
        if self.json_object:
            return "json_object", ""
        value = getattr(self, self.kind)
        return self.kind, value if isinstance(value, str) else json.dumps(value, sort_keys=True)
