"""Tiny Kimi K2.5 (`kimi_k25`) checkpoints: a MoonViT vision tower and a DeepSeek-V3 text model.

transformers builds the random model; its weights are re-drawn at realistic scales (matrices N(0, 1 /
fan_in), norms 1 + N(0, 0.1^2), biases N(0, 0.1^2), embeddings and the position grid N(0, 1)) and the
checkpoint is written by transformers' own `save_pretrained` ("transformers" layout) or with the release
names ("release": `language_model.model.layers.N`, `vision_tower.patch_embed.proj`, `mm_projector.pre_norm`),
float32 (the tests compare in float32). The tokenizer is the demo's byte-level BPE plus Kimi's chat and
media tokens, with a Kimi-style chat template; `image_token_id` is its `<|media_pad|>`.

    build_kimi_k25_checkpoint(tmp_dir, layout="release", seed=0, **vision / text overrides) -> Path
    load_reference(path) -> transformers' Kimi_K25ForConditionalGeneration, float32
    random_image(width, height, seed) -> PIL image
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken

TEXT_DIMS = dict(
    model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)
VISION_DIMS = dict(
    patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=2, num_hidden_layers=2,
    hidden_size=48, intermediate_size=96, merge_kernel_size=[2, 2], hidden_act="gelu_pytorch_tanh",
    rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)
MEDIA_TOKENS = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]
CHAT_TOKENS = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>"]
IMAGE_PLACEHOLDER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
# Kimi's turn format; content is a string (dayzero.multimodal.chat writes image parts as IMAGE_PLACEHOLDER)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ '<|im_system|>system<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{%- elif message['role'] == 'user' %}{{ '<|im_user|>user<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{%- else %}{{ '<|im_assistant|>assistant<|im_middle|>' + message['content'] + '<|im_end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
)


def save_tokenizer(out_dir: Path) -> tuple[int, int, int]:
    """tokenizer.json + tokenizer_config.json; returns (vocabulary size, <|media_pad|> id, <|im_end|> id)."""
    from dayzero.demo.tokenizer import BOS, build_tokenizer, tokenizer_config

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MEDIA_TOKENS + CHAT_TOKENS])
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    config = {**tokenizer_config(), "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": BOS}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    return (tokenizer.get_vocab_size(with_added_tokens=True), tokenizer.token_to_id("<|media_pad|>"),
            tokenizer.token_to_id("<|im_end|>"))


def _redraw(state: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        shape = t.shape
        if name.endswith("e_score_correction_bias"):
            v = torch.rand(shape, generator=generator) * 0.2
        elif ("norm" in name) and name.endswith(".weight"):
            v = 1 + 0.1 * torch.randn(shape, generator=generator)
        elif name.endswith(".bias"):
            v = 0.1 * torch.randn(shape, generator=generator)
        elif "embed_tokens" in name or "position_embeddings" in name:
            v = torch.randn(shape, generator=generator)
        else:
            v = torch.randn(shape, generator=generator) / float(np.prod(shape[1:])) ** 0.5
        out[name] = v.to(t.dtype)
    return out


RELEASE_RENAMES = (("language_model.model.blocks.", "language_model.model.layers."),
                   ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
                   ("model.mm_projector.", "mm_projector."))


def build_kimi_k25_checkpoint(tmp_dir, *, layout: str = "release", seed: int = 0, preprocessor: dict | None = None,
                              vision: dict | None = None, **text) -> Path:
    """A tiny kimi_k25 checkpoint at tmp_dir/kimi_k25-<layout>-<seed>. vision / text: overrides of
    VISION_DIMS / TEXT_DIMS; preprocessor: preprocessor_config.json's fields (none by default)."""
    from transformers import AutoConfig, Kimi_K25ForConditionalGeneration

    if layout not in ("release", "transformers"):
        raise ValueError(f"layout must be release or transformers, got {layout!r}")
    tag = "-".join(f"{k}={v}" for k, v in sorted({**(vision or {}), **text}.items()))
    out = Path(tmp_dir) / f"kimi_k25-{layout}-{seed}{'-' + tag if tag else ''}"
    out.mkdir(parents=True, exist_ok=True)
    vocab, pad_id, end_id = save_tokenizer(out)
    vision_cfg = {**VISION_DIMS, **(vision or {})}
    text_cfg = {**TEXT_DIMS, "vocab_size": -(-vocab // 128) * 128, "eos_token_id": end_id, **text}
    cfg = AutoConfig.for_model("kimi_k25", text_config=text_cfg, vision_config=vision_cfg,
                               projection_hidden_size=vision_cfg["hidden_size"], image_token_id=pad_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Kimi_K25ForConditionalGeneration(cfg)
    state = _redraw(model.state_dict(), torch.Generator().manual_seed(seed))
    model.load_state_dict(state, strict=False)
    model.save_pretrained(out)
    if layout == "release":
        saved = load_file(out / "model.safetensors")
        renamed = {}
        for name, t in saved.items():
            for old, new in RELEASE_RENAMES:
                if name.startswith(old):
                    name = new + name[len(old):]
            renamed[name] = t
        save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    if preprocessor:
        (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return out


def load_reference(path, dtype: torch.dtype = torch.float32):
    from transformers import Kimi_K25ForConditionalGeneration

    return Kimi_K25ForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)
