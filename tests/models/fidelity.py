"""Fidelity on checkpoints in every layout: one transformers model, saved three ways, loaded by
dayzero, compared at the logits of the prefill and of every decode step.

    model = reference_model(model_type, config_kwargs, seed)   # transformers, random at realistic scale
    dirs = save_transformers_layouts(model, tmp)                # {"transformers": ..., "transformers in-memory": ...}
    check_fidelity(model, {**dirs, "release": release_dir}, prompt_len, decode_steps, seed)

The reference is transformers' full forward without a cache over the whole sequence (prompt +
decode tokens, teacher-forced: the decode tokens are drawn in advance, not sampled), so every decode
step of dayzero (prefill, then one token at a time with its cache) is judged against the model's
definition at that position, not against transformers' own cached path. float32, max relative error
1e-4 per step (max |ours - theirs| / max |theirs| over that step's logits).

`seeds()` gives the configs a test runs: a few by default, a larger sweep with DAYZERO_TEST_SWEEP=1.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import torch

from dayzero.models import load_model
from dayzero.verify import rank_reference_ties
from dayzero.weights import Checkpoint, match_layout
from tests.models.helpers import positions, rel_err

TOLERANCE = 1e-4
SWEEP = os.environ.get("DAYZERO_TEST_SWEEP", "") not in ("", "0")


def seeds(default: int = 3, sweep: int = 12) -> list[int]:
    """The seeds of the randomized configs: `default` of them, `sweep` with DAYZERO_TEST_SWEEP=1."""
    return list(range(sweep if SWEEP else default))


def choice(rng: random.Random, options):
    return options[rng.randrange(len(options))]


def reference_model(model_type: str, config_kwargs: dict, seed: int):
    """transformers' model of `config_kwargs`, every tensor redrawn at a realistic scale, in float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **config_kwargs)
    with torch.random.fork_rng():  # transformers' init draws from the global generator; every value is redrawn
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float().eval()
    redraw(model, seed, config)
    return model


def redraw(model, seed: int, config) -> None:
    """Fresh values for every parameter and persistent buffer (in transformers' in-memory names):
    matrices N(0, 1/fan_in) (fan_in the last dim), embeddings N(0, 1), norm weights 1 + N(0, 0.1^2),
    biases N(0, 0.1^2), router correction biases U(0, 0.2), sinks / compressor position biases
    N(0, 0.5^2), hyper-connection base N(0, 0.1^2) and scale U(0.5, 1.5), KDA A_log = log U(1, 16)
    and dt_bias = inverse softplus of U(1e-3, 1e-1); hash routing tables: top-k distinct experts per
    token id."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            shape = t.shape
            if name.endswith("tid2eid"):
                experts = config.n_routed_experts
                t.copy_(torch.rand(shape[0], experts, generator=gen).argsort(-1)[:, : shape[1]])
                continue
            if not t.is_floating_point():
                continue
            if name.endswith("e_score_correction_bias"):
                v = 0.2 * torch.rand(shape, generator=gen)
            elif name.endswith("A_log"):
                v = (1 + 15 * torch.rand(shape, generator=gen)).log()
            elif name.endswith("dt_bias"):
                dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(shape, generator=gen))
                v = dt + torch.log(-torch.expm1(-dt))
            elif name.endswith(("sinks", "position_bias")):
                v = 0.5 * torch.randn(shape, generator=gen)
            elif name.endswith(("hc.base", "hc_base")):
                v = 0.1 * torch.randn(shape, generator=gen)
            elif name.endswith(("hc.scale", "hc_scale")):
                v = 0.5 + torch.rand(shape, generator=gen)
            elif "norm" in name and t.dim() == 1:
                v = 1 + 0.1 * torch.randn(shape, generator=gen)
            elif "bias" in name:
                v = 0.1 * torch.randn(shape, generator=gen)
            elif "embed_tokens" in name:
                v = torch.randn(shape, generator=gen)
            elif t.dim() == 1:
                v = torch.randn(shape, generator=gen)
            else:
                v = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
            t.copy_(v)


def save_transformers_layouts(model, tmp: Path) -> dict[str, Path]:
    """The model saved by transformers' save_pretrained, and with save_original_format=False (its
    in-memory names), as {layout name: directory}."""
    dirs = {"transformers": Path(tmp) / "transformers", "transformers in-memory": Path(tmp) / "in_memory"}
    model.save_pretrained(dirs["transformers"])
    model.save_pretrained(dirs["transformers in-memory"], save_original_format=False)
    return dirs


def detected_layout(model, path: Path) -> str:
    expected = {name: t.spec for name, t in model.weight_targets().items()}
    layout, _ = match_layout(Checkpoint.open(path), model.layouts(), expected, family=model.spec.model_type,
                             ignore_unexpected=model.ignore_patterns())
    return layout.name


def token_ids(vocab: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(1000 + seed))


@torch.no_grad()
def step_errors(ours, reference_logits: torch.Tensor, ids: torch.Tensor, prompt_len: int) -> list[float]:
    """[prefill error, error of decode step 1, ...]: dayzero's prefill of ids[:, :prompt_len] (every
    prompt position) and then one cached step per remaining token, each against `reference_logits`
    [1, T, vocab] (transformers' full forward over ids) at the same positions."""
    cache = ours.new_cache(1)
    prefill = ours(ids[:, :prompt_len], positions(ids[:, :prompt_len]), cache)
    errors = [rel_err(prefill, reference_logits[:, :prompt_len])]
    for t in range(prompt_len, ids.shape[1]):
        step = ours(ids[:, t:t + 1], positions(ids[:, t:t + 1], t), cache)
        errors.append(rel_err(step[:, 0], reference_logits[:, t]))
    return errors


def check_fidelity(reference, dirs: dict[str, Path], prompt_len: int, decode_steps: int, seed: int,
                   decode_layouts: tuple[str, ...] = ("transformers", "release"),
                   detected_as: dict[str, str] | None = None) -> dict[str, list[float]]:
    """Load every directory with dayzero: it must be detected as the layout it is keyed by (or as
    `detected_as[key]`: where transformers saves the release names, that is "release"), and match
    `reference` to TOLERANCE at the prefill and at every decode step. Layouts outside
    `decode_layouts` are checked on the prefill and must load bitwise the same tensors as the first
    one (so their decode steps are those of the first); returns {layout: step errors}."""
    rank_reference_ties(reference, reference.config.model_type)  # DSA top-k ties by key index, as dayzero
    vocab = reference.config.vocab_size
    ids = token_ids(vocab, prompt_len + decode_steps, seed)
    with torch.no_grad():
        want = reference(ids).logits.float()
    results, first = {}, None
    for layout, path in dirs.items():
        ours = load_model(path, dtype=torch.float32, progress=False)
        assert detected_layout(ours, path) == (detected_as or {}).get(layout, layout)
        if layout in decode_layouts:
            errors = step_errors(ours, want, ids, prompt_len)
        else:
            errors = step_errors(ours, want, ids[:, : prompt_len + 1], prompt_len)
            state, first_state = ours.state_dict(), first.state_dict()
            assert state.keys() == first_state.keys()
            assert all(torch.equal(state[k], first_state[k]) for k in state), layout
        if first is None:
            first = ours
        results[layout] = errors
        print(f"  {layout}: prefill {errors[0]:.1e}, decode max {max(errors[1:]):.1e} over {len(errors) - 1} steps")
    for layout, errors in results.items():
        bad = [i for i, e in enumerate(errors) if not e <= TOLERANCE]
        assert not bad, (f"{layout}: relative logits error above {TOLERANCE} at "
                         + ", ".join("prefill" if i == 0 else f"decode step {i}" for i in bad)
                         + f": {[f'{errors[i]:.2e}' for i in bad]}")
    return results
