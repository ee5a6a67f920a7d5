"""Helpers shared by the model tests: prompts, positions, the error measure, greedy decoding."""

import torch

from dayzero.verify import rel_err  # max |ours - theirs| / max |theirs|

GENERATE = 32  # greedy tokens compared against transformers

__all__ = ["GENERATE", "assert_bf16_close_and_planned", "assert_greedy_matches_transformers",
           "assert_logits_match_transformers", "assert_refused", "greedy", "positions", "random_prompt", "rel_err",
           "save_bf16"]


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


def save_bf16(model, out, state: dict, *, original_format: bool, float32: tuple[str, ...] = (), extra=None) -> None:
    """transformers' `model` with its weights set to `state`, saved (original_format: save_pretrained's default
    names, else its in-memory ones), then rewritten bf16 as released checkpoints ship, the tensors whose names
    end in `float32` kept float32, plus extra(tensors) (e.g. an MTP layer the model must skip)."""
    from safetensors.torch import load_file, save_file

    with torch.no_grad():
        for name, p in model.state_dict().items():
            p.copy_(state[name])
    model.save_pretrained(out, save_original_format=original_format)
    tensors = {name: t.float() if name.endswith(float32) else t.to(torch.bfloat16)
               for name, t in load_file(out / "model.safetensors").items()}
    tensors.update(extra(tensors) if extra is not None else {})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def assert_bf16_close_and_planned(checkpoint, length: int, vocab: int) -> None:
    """The bf16 model stays within bf16 rounding of the float32 one at most positions (a routing decision may
    flip now and then), and holds exactly the weight bytes `dayzero inspect` plans per GPU (rank_weights)."""
    from dayzero.models import load_model
    from dayzero.parallel.state import Parallel
    from dayzero.rank_weights import rank_weights

    ids = random_prompt(1, length, vocab)
    ours16, ours32 = (load_model(checkpoint, dtype=d, progress=False) for d in (torch.bfloat16, torch.float32))
    with torch.no_grad():
        got, want = ours16(ids, positions(ids)), ours32(ids, positions(ids))
    per_position = (got - want).abs().amax(-1) / want.abs().amax(-1)
    assert float(per_position.median()) <= 3e-2
    held = sum(t.numel() * t.element_size() for t in [*ours16.parameters(), *ours16.buffers()])
    assert rank_weights(ours16.spec, Parallel()).total == held
