"""Kimi K2.5 / K2.6 (`kimi_k25`): MoonViT images merged into a DeepSeek-V3 / Kimi-K2 text model.

    features = mm_projector(vision_tower(pixels))     per image, (h / 2)(w / 2) rows of the text hidden size
                                                      (dayzero/models/moonvit.py)
    x = embed_tokens(ids), the rows of the image placeholder tokens (`image_token_id`, `<|media_pad|>`,
        repeated once per merged patch) replaced by the image's features in order
    logits = the text model's layers over x            (dayzero/models/deepseek_v3.py)
transformers embeds the placeholder (and video) ids as id 0 before the features replace them; so does
this file, so that a placeholder without features (no image given) reads the same row.

The encoder is its own step (`encode_images`, batched over images, prompts only); its features reach a
forward through the step cache (`cache.mm_embeds`: the packed rows of the step's placeholder tokens and
their features), set by the engine's runner or by the [B, T] form's `image_features`.

Checkpoint names as released: `language_model.model.*`, `language_model.lm_head.weight` (absent when
tie_word_embeddings, transformers' default for kimi_k25), `vision_tower.*`, `mm_projector.*`. What
transformers' `save_pretrained` writes differs in three names (below, TRANSFORMERS_SAVED); its in-memory
names split wqkv into q/k/v rows permuted to its half-split RoPE, which a layout cannot undo, and are
not loaded.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dayzero.models import register_model
from dayzero.models.base import CausalLM
from dayzero.models.deepseek_v3 import LAYOUTS as TEXT_LAYOUTS, DeepseekV3ForCausalLM
from dayzero.models.moonvit import MoonViT, Projector
from dayzero.spec import ModelSpec
from dayzero.weights import Layout, Rename

IMAGE_TOKEN_ID = 163605  # `<|media_pad|>`: transformers' Kimi_K25Config default (the remote code's media_placeholder_token_id)
VIDEO_TOKEN_ID = 163840

# transformers 5.17-5.25 `save_pretrained` inverts its load-time renames, and in doing so writes the text
# layers as `blocks`, the patch embedding under `vision_tower.encoder.` and the projector's norm under `model.`.
TRANSFORMERS_SAVED = (
    Rename(r"^language_model\.model\.blocks\.", "language_model.model.layers."),
    Rename(r"^vision_tower\.encoder\.patch_embed\.", "vision_tower.patch_embed."),
    Rename(r"^model\.mm_projector\.", "mm_projector."),
)
LAYOUTS = (
    TEXT_LAYOUTS[0].then(name="release", example="language_model.model.layers.N..., vision_tower.encoder.blocks.N.wqkv"),
    TEXT_LAYOUTS[0].then(*TRANSFORMERS_SAVED, name="transformers save_pretrained",
                         example="language_model.model.blocks.N..., vision_tower.encoder.patch_embed.proj"),
)


@register_model
class KimiK25ForConditionalGeneration(CausalLM):
    model_types = ("kimi_k25",)
    image_placeholder = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"  # one per image in a prompt

    def __init__(self, spec: ModelSpec, config: dict, dtype: torch.dtype, device: torch.device | str):
        super().__init__(spec, config, dtype, device)
        config = self.config
        text_config = dict(config["text_config"])
        if config.get("quantization_config") and not text_config.get("quantization_config"):
            text_config["quantization_config"] = config["quantization_config"]
        self.language_model = DeepseekV3ForCausalLM(replace(spec, model_type=spec.text_model_type, vision=None),
                                                    text_config, dtype, device)
        self.vision_tower = MoonViT(spec.vision, config, dtype, device)
        self.mm_projector = Projector(spec.vision, config, dtype, device)
        self.image_token_id = int(config.get("image_token_id", config.get("media_placeholder_token_id", IMAGE_TOKEN_ID)))
        self.video_token_id = int(config.get("video_token_id", VIDEO_TOKEN_ID))

    def layouts(self) -> tuple[Layout, ...]:
        return LAYOUTS

    def ignore_patterns(self) -> tuple[str, ...]:
        """The text model's (MTP layers, zero-width shared experts), under `language_model.`."""
        return tuple(p.replace(r"^model\.", r"^language_model\.model\.") for p in self.language_model.ignore_patterns())

    def post_load(self) -> None:
        self.language_model.post_load()

    def cuda_graph_blocker(self, max_model_len: int) -> str | None:
        """A decode step is the text model's (images reach prompts only)."""
        return self.language_model.cuda_graph_blocker(max_model_len)

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor, grids: tuple[tuple[int, int, int], ...]) -> list[torch.Tensor]:
        """The encoder step: pixels [N, 3, p, p] of the packed images (dayzero.multimodal.processor), grids
        (t, h, w) per image -> per image its placeholder tokens' features [(h / kh)(w / kw), hidden]."""
        merged = self.mm_projector(self.vision_tower(pixels.to(self.device_), grids))
        kh, kw = self.spec.vision.merge_kernel
        return list(merged.split([(h // kh) * (w // kw) for _, h, w in grids]))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache=None,
                image_features: torch.Tensor | None = None) -> torch.Tensor:
        """The base forms; in the [B, T] form image_features [M, hidden] are the features of input_ids'
        M placeholder tokens, in order (row by row), as transformers' masked_scatter takes them."""
        if image_features is None or input_ids.dim() == 1:
            return super().forward(input_ids, positions, cache)
        self.check_inputs(input_ids, positions, cache, self.spec.vocab_size)
        b, t = input_ids.shape
        rows = (input_ids.reshape(-1) == self.image_token_id).nonzero().squeeze(1)
        if rows.numel() != image_features.shape[0]:
            raise ValueError(f"input_ids hold {rows.numel()} image placeholder tokens (id {self.image_token_id}) but "
                             f"{image_features.shape[0]} image feature rows were given")
        step = (cache if cache is not None else self.new_cache(b)).step(t)
        step.mm_embeds = (rows, image_features)
        return self.forward_packed(input_ids.reshape(-1), positions.reshape(-1), step).view(b, t, -1)

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        media = (input_ids == self.image_token_id) | (input_ids == self.video_token_id)
        x = self.language_model.model.embed_tokens(torch.where(media, 0, input_ids))
        if cache.mm_embeds is not None:
            rows, features = cache.mm_embeds
            x = x.index_copy(0, rows, features.to(x.dtype))
        return self.language_model.forward_embeds(x, positions, cache)
