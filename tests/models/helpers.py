"""Helpers shared by the model tests: prompts, positions, the error measure, greedy decoding."""

import torch

from dayzero.verify import rel_err  # max |ours - theirs| / max |theirs|

GENERATE = 32  # greedy tokens compared against transformers

__all__ = ["GENERATE", "assert_greedy_matches_transformers", "assert_logits_match_transformers", "assert_refused",
           "greedy", "positions", "random_prompt", "rel_err"]


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


def assert_logits_match_transformers(ours, hf, ids: torch.Tensor, vocab: int, tolerance: float = 1e-4) -> None:
    """One full forward of both: float32 logits [B, T, vocab] within `tolerance` (max relative error)."""
    with torch.no_grad():
        got, want = ours(ids, positions(ids)), hf(ids).logits
    assert got.dtype == torch.float32 and got.shape == (*ids.shape, vocab)
    err = rel_err(got, want)
    print(f"max relative logits error, prompt {ids.shape[1]}: {err:.2e}")
    assert err <= tolerance


def assert_greedy_matches_transformers(ours, hf, ids: torch.Tensor, steps: int = GENERATE) -> None:
    """dayzero's cached greedy decode gives transformers' `generate` tokens, and its step logits equal
    one full forward over the whole sequence (prefill + decode = full forward, 1e-5)."""
    length = ids.shape[1]
    tokens, step_logits = greedy(ours, ids, steps)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                           min_new_tokens=steps, pad_token_id=0)
    assert torch.equal(tokens, want[:, length:])
    with torch.no_grad():
        full = ours(want[:, :-1], positions(want[:, :-1]))[:, length - 1:]
    assert rel_err(step_logits, full) <= 1e-5


def assert_refused(tmp_path, config: dict, field: str) -> None:
    """`config` (written as tmp_path/config.json, no weights) is refused for `field` alike by
    load_spec, by `dayzero inspect`'s report and by the loader, before any weights are looked for."""
    import json

    import pytest

    from dayzero.inspect import build_report
    from dayzero.models import load_model
    from dayzero.spec import UnsupportedModelError, load_spec

    (tmp_path / "config.json").write_text(json.dumps(config))
    for attempt in (load_spec, build_report, lambda p: load_model(p, dtype=torch.float32, progress=False)):
        with pytest.raises(UnsupportedModelError) as info:
            attempt(tmp_path)
        assert info.value.field == field, str(info.value)
