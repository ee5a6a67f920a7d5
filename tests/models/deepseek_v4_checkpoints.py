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


def build_deepseek_v4_checkpoint(tmp_dir: str | os.PathLike, **overrides) -> Path:
    """Write config.json and model.safetensors of a tiny random DeepSeek-V4 into `tmp_dir`.

    overrides: config.json fields (e.g. sliding_window, index_topk, compress_ratios, num_hidden_layers).
    Dims stay <= 128 or multiples of 128 (FP8 blocks) and multiples of 32 (FP4 blocks)."""
    out = Path(tmp_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_v4_config(**overrides)
    state = {name: t.contiguous() for name, t in demo_state_dict(config).items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out
