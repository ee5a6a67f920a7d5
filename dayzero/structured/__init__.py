"""Structured outputs: constrained decoding through llguidance (docs/structured.md).

params.py: StructuredOutputs, what a request asks for (JSON schema, any JSON object, regex, EBNF
grammar, Lark grammar); grammar.py: GrammarCompiler (the tokenizer as llguidance sees it, grammars
checked and compiled once) and Grammar (one request's matcher); bitmask.py: the step's token masks,
filled on the host and applied to the logits rows that need them.
"""

from dayzero.structured.params import StructuredOutputs

__all__ = ["StructuredOutputs"]
