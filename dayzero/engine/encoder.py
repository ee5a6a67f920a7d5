"""The vision encoder's step: the image features a step's placeholder tokens need, encoded once per image.

Before a step's forward the runner asks `ImageEncoder.step_inputs` for the features of the scheduled
tokens that are image placeholders (a prefill chunk may cover an image whole, in part, or not at all; a
prefix-cache hit may have covered its start already). Every image the step needs that the feature cache
does not hold is encoded in one batched call of the model's `encode_images` (the images packed, the
encoder's attention varlen over them; prompts only, never a decode), its features cached by image hash
(dayzero.multimodal.feature_cache). The answer is the forward's `cache.mm_embeds`: the packed rows of
the placeholder tokens (long [M], on the device) and their features [M, hidden], in row order.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dayzero.multimodal.feature_cache import FeatureCache


class ImageEncoder:
    def __init__(self, model, cache: FeatureCache):
        self.model, self.cache = model, cache
        self.num_calls = 0  # batched encoder calls

    def step_inputs(self, scheduled: Sequence) -> tuple[torch.Tensor, torch.Tensor] | None:
        """scheduled: the step's ScheduledRequests in packed row order -> (rows, features), or None when no
        scheduled token is an image placeholder."""
        wanted = []  # (placement, first, last): feature rows [first, last) of the image, at packed row `row`
        row = 0
        for s in scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            for p in s.request.images:
                lo, hi = max(start, p.offset), min(end, p.end)
                if lo < hi:
                    wanted.append((p, lo - p.offset, hi - p.offset, row + lo - start))
            row += s.num_new_tokens
        if not wanted:
            return None
        features = self._features([p.image for p, *_ in wanted])
        device = self.model.device_
        rows = torch.cat([torch.arange(r, r + last - first) for _, first, last, r in wanted]).to(device)
        return rows, torch.cat([features[p.image.hash][first:last] for p, first, last, _ in wanted])

    def _features(self, images: list) -> dict[str, torch.Tensor]:
        """hash -> features of every image in `images`, the missing ones encoded in one call."""
        out, missing = {}, {}
        for image in images:
            if image.hash in out or image.hash in missing:
                continue
            cached = self.cache.get(image.hash)
            if cached is None:
                missing[image.hash] = image
            else:
                out[image.hash] = cached
        if missing:
            batch = list(missing.values())
            encoded = self.model.encode_images(torch.cat([im.pixels for im in batch]), tuple(im.grid for im in batch))
            self.num_calls += 1
            self.cache.num_encoded += len(batch)
            for image, features in zip(batch, encoded):
                self.cache.put(image.hash, features)
                out[image.hash] = features
        return out
