"""A random "model" for grammar tests: fresh normal logits every step, sampled by the engine's own
Sampler under the request's grammar, the grammar advanced with every token as the engine does."""

from __future__ import annotations

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
