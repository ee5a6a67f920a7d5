"""Helpers shared by the model tests: prompts, positions, the error measure, greedy decoding."""

import torch

from dayzero.verify import rel_err  # max |ours - theirs| / max |theirs|

GENERATE = 32  # greedy tokens compared against transformers

__all__ = ["GENERATE", "greedy", "positions", "random_prompt", "rel_err"]


def random_prompt(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def positions(ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)


@torch.no_grad()
def greedy(model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dayzero: prefill then one-token decode steps with the cache -> (tokens [B, steps], step logits [B, steps, V])."""
    cache = model.new_cache(ids.shape[0])
    logits = model(ids, positions(ids), cache)[:, -1]
    tokens, step_logits = [], [logits]
    for _ in range(steps - 1):
        nxt = logits.argmax(-1, keepdim=True)
        tokens.append(nxt)
        logits = model(nxt, positions(nxt, cache.length), cache)[:, -1]
        step_logits.append(logits)
    tokens.append(logits.argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1), torch.stack(step_logits, dim=1)
