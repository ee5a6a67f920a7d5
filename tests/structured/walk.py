"""A random "model" for grammar tests: fresh normal logits every step, sampled by the engine's own
Sampler under the request's grammar, the grammar advanced with every token as the engine does."""

from __future__ import annotations

import random

import torch

from dayzero.engine.sampling import Sampler, SamplingParams
from dayzero.structured.grammar import GrammarCompiler
from dayzero.structured.params import StructuredOutputs


def walk(compiler: GrammarCompiler, spec: StructuredOutputs, seed: int, max_steps: int = 400,
         scale: float = 3.0) -> tuple[list[int], bool]:
    """(the sampled ids without the final EOS, whether an EOS ended it within max_steps)."""
    vocab = compiler.vocab_size
    sampler = Sampler(vocab, seed=seed)
    state = sampler.new_state(SamplingParams(max_tokens=max_steps, temperature=1.0, seed=seed), [0])
    state.grammar = compiler.new(spec)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, vocab, generator=gen) * scale
        token = int(sampler(logits, [state]).token_ids[0])
        state.grammar.accept(token)
        if token in compiler.eos_token_ids:
            return out, True
        out.append(token)
    return out, False


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema whose instances stay short under random logits: strings, arrays and numbers bounded."""
    kinds = ["string", "integer", "boolean", "enum", "null", "number"] + (["object", "array", "anyOf"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 6)}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 3, None, True, "naïve 日本"], rng.randint(1, 4))}
    if kind == "object":
        props = {f"k{i}_{rng.randint(0, 99)}": random_schema(rng, depth + 1) for i in range(rng.randint(0, 4))}
        required = [k for k in props if rng.random() < 0.7]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    return {"type": kind}
