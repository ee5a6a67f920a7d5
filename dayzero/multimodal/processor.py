"""MoonViT's image preprocessing (Kimi K2.5), with Pillow and numpy.

For an image of H x W pixels, patch size p and merge size m (2):
    1. fit: nh = max(1, H // p), nw = max(1, W // p) patches; scale = min(1, sqrt(max_patches / (nh nw)),
       max_side p / H, max_side p / W) (never up); the new size int(H scale) x int(W scale) (at least 1,
       at most max_side p) — `fit_size`, the arithmetic of the checkpoint's processor (transformers'
       `navit_resize`, Moonshot's media processor);
    2. resize to it with Pillow's bicubic filter (when it differs), then pad right and bottom with zeros up
       to multiples of m p;
    3. x / 255, then (x - image_mean) / image_std per channel (the padding too: zeros become -mean / std);
    4. cut into p x p patches, row by row: pixels float32 [gh gw, 3, p, p], grid (1, gh, gw).
The image then takes gh gw / m^2 placeholder tokens in the prompt (one per merged 2 x 2 block).

Settings come from the checkpoint's preprocessor_config.json, in transformers' names (`max_patches`,
`size.max_height`, `patch_size`, `merge_size`, `image_mean`, `image_std`) or the remote code's
(`media_proc_cfg`: `in_patch_limit`, `patch_limit_on_one_side`, `merge_kernel_size`, ...); defaults are
transformers' Kimi_K25ImageProcessor's. transformers resizes with torchvision's bicubic (antialiased),
Moonshot's processor with Pillow's: the two differ by a few levels of 255 on resized images, and not at
all on images that need no resize.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dayzero.multimodal.images import image_hash, load_image
from dayzero.spec import VisionSpec


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: what the encoder reads and what the prompt makes room for."""

    hash: str  # content hash of the RGB image (images.image_hash): the feature cache's and prefix cache's key
    pixels: torch.Tensor  # float32 [t gh gw, 3, p, p], patches row by row
    grid: tuple[int, int, int]  # (t, gh, gw) patches
    num_tokens: int  # placeholder tokens (feature rows): t-pooled gh gw / (kh kw)


@dataclass(frozen=True)
class ProcessorConfig:
    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384  # patches of one image after the fit (before padding)
    max_patches_per_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_checkpoint(cls, path: str | Path, vision: VisionSpec) -> "ProcessorConfig":
        """preprocessor_config.json of the checkpoint directory (either naming), checked against the vision
        tower's patch and merge sizes; the defaults where it is absent."""
        f = Path(path) / "preprocessor_config.json"
        raw = json.loads(f.read_text()) if f.is_file() else {}
        raw = {**raw, **(raw.get("media_proc_cfg") or {})}
        size = raw.get("size") or {}
        cfg = cls(
            patch_size=int(raw.get("patch_size", vision.patch_size)),
            merge_size=int(raw.get("merge_size", raw.get("merge_kernel_size", vision.merge_kernel[0]))),
            max_patches=int(raw.get("max_patches", raw.get("in_patch_limit", cls.max_patches))),
            max_patches_per_side=int(size.get("max_height", raw.get("patch_limit_on_one_side", cls.max_patches_per_side))),
            image_mean=tuple(float(x) for x in raw.get("image_mean", cls.image_mean)),
            image_std=tuple(float(x) for x in raw.get("image_std", cls.image_std)),
        )
        for name, ours, model in (("patch_size", cfg.patch_size, vision.patch_size),
                                  ("merge_size", cfg.merge_size, vision.merge_kernel[0])):
            if ours != model:
                raise ValueError(f"{f}: {name} {ours} differs from the vision tower's {model} (config.json vision_config)")
        if vision.merge_kernel[0] != vision.merge_kernel[1]:
            raise ValueError(f"vision_config.merge_kernel_size {list(vision.merge_kernel)} is not square; the image "
                             "processor pads both sides to one merge size")
        return cfg


def fit_size(height: int, width: int, cfg: ProcessorConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized height, width), (padded height, width)) in pixels: step 1 and the padding of step 2."""
    p, side = cfg.patch_size, cfg.max_patches_per_side
    patches = max(1, height // p) * max(1, width // p)
    scale = min(1.0, math.sqrt(cfg.max_patches / patches), side * p / height, side * p / width)
    new_h = min(max(1, int(height * scale)), side * p)
    new_w = min(max(1, int(width * scale)), side * p)
    factor = cfg.merge_size * p
    return (new_h, new_w), (-(-new_h // factor) * factor, -(-new_w // factor) * factor)


class ImageProcessor:
    def __init__(self, cfg: ProcessorConfig):
        self.cfg = cfg
        self._mean = np.asarray(cfg.image_mean, dtype=np.float32)
        self._std = np.asarray(cfg.image_std, dtype=np.float32)

    @classmethod
    def from_checkpoint(cls, path: str | Path, vision: VisionSpec) -> "ImageProcessor":
        return cls(ProcessorConfig.from_checkpoint(path, vision))

    def num_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens an image of height x width pixels takes."""
        _, (ph, pw) = fit_size(height, width, self.cfg)
        return (ph // self.cfg.patch_size) * (pw // self.cfg.patch_size) // self.cfg.merge_size**2

    def __call__(self, source, where: str = "image") -> ImageInput:
        """Load (images.load_image: ImageError names `where`) and preprocess one image."""
        image = load_image(source, where)
        return self.preprocess(image)

    def preprocess(self, image: Image.Image) -> ImageInput:
        """An RGB PIL image -> ImageInput (steps 1-4 of the module docstring)."""
        cfg, p = self.cfg, self.cfg.patch_size
        (new_h, new_w), (pad_h, pad_w) = fit_size(image.height, image.width, cfg)
        resized = image if (new_h, new_w) == (image.height, image.width) else \
            image.resize((new_w, new_h), Image.Resampling.BICUBIC)
        canvas = np.zeros((pad_h, pad_w, 3), dtype=np.float32)
        canvas[:new_h, :new_w] = np.asarray(resized, dtype=np.float32) / 255.0
        canvas = (canvas - self._mean) / self._std
        gh, gw = pad_h // p, pad_w // p
        patches = canvas.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
        return ImageInput(image_hash(image), torch.from_numpy(np.ascontiguousarray(patches)), (1, gh, gw),
                          gh * gw // cfg.merge_size**2)
