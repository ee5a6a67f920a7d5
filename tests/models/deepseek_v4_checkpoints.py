"""Tiny DeepSeek-V4 checkpoints in the real on-disk layout, for the model and verify tests.

Built like the demo checkpoint (dayzero.demo.checkpoint draws every tensor at a realistic scale in
DeepSeek's original names and formats: FP8 e4m3 dense weights with 128x128 UE8M0 scales, FP4
experts as int8 pairs with UE8M0 scales per 32, float32 hyper-connection weights, sinks, APE and
correction biases) with a smaller vocabulary, five layers covering window-only, CSA and HCA, a short
sliding window, and enough indexer heads that exact score ties are unlikely.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from dayzero.demo.checkpoint import DEMO_CONFIG, demo_state_dict

TINY_V4 = dict(
    DEMO_CONFIG,
    vocab_size=256,
    num_hidden_layers=5,
    compress_ratios=[0, 4, 128, 4, 128],  # window only, CSA, HCA, CSA, HCA
    num_hash_layers=2,
    sliding_window=16,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=8,
)


def tiny_v4_config(**overrides) -> dict:
    config = dict(TINY_V4, **overrides)
    config["compress_ratios"] = list(config["compress_ratios"])[: config["num_hidden_layers"]]
    return config


def build_deepseek_v4_checkpoint(tmp_dir: str | os.PathLike, *, mtp: bool = False, **overrides) -> Path:
    """Write config.json and model.safetensors of a tiny random DeepSeek-V4 into `tmp_dir`.

    overrides: config.json fields (e.g. sliding_window, index_topk, compress_ratios, num_hidden_layers).
    Dims stay <= 128 or multiples of 128 (FP8 blocks) and multiples of 32 (FP4 blocks).
    mtp: also ship one MTP layer as the real checkpoint does (`mtp.0.*` tensors, here a copy of the
    last layer's, `num_nextn_predict_layers: 1` and a trailing `compress_ratios` entry)."""
    out = Path(tmp_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_v4_config(**overrides)
    state = {name: t.contiguous() for name, t in demo_state_dict(config).items()}
    if mtp:
        last = f"layers.{config['num_hidden_layers'] - 1}."
        state.update({"mtp.0." + n[len(last):]: t.clone() for n, t in state.items() if n.startswith(last)})
        config.update(num_nextn_predict_layers=1, compress_ratios=config["compress_ratios"] + [0])
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def load_reference(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """transformers' DeepseekV4ForCausalLM on the checkpoint (on CPU it dequantizes FP8 / FP4 on load)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.generation_config.eos_token_id = None  # generate exactly the requested number of tokens
    return model.eval()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def greedy(model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dayzero: prefill then one-token decode steps with the cache -> (tokens [B, steps], logits [B, steps, vocab])."""
    cache = model.new_cache(ids.shape[0])
    batch, length = ids.shape
    logits = model(ids, torch.arange(length).expand(batch, -1), cache)[:, -1]
    tokens, step_logits = [], [logits]
    for _ in range(steps - 1):
        nxt = logits.argmax(-1, keepdim=True)
        tokens.append(nxt)
        logits = model(nxt, torch.full_like(nxt, cache.length), cache)[:, -1]
        step_logits.append(logits)
    tokens.append(logits.argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1), torch.stack(step_logits, dim=1)
