"""The vision encoder's outputs kept by image hash, so that an image seen again (the next turn of a
conversation, another request with the same picture) is not encoded again.

An LRU over whole images: `get` marks an image used; `put` adds one and drops the least recently used
until the cached feature rows fit `capacity_tokens` (an image larger than the capacity is kept alone,
until the next put). `num_encoded` counts the images the encoder computed (the encoder adds them),
`num_hits` the lookups that found their image.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class FeatureCache:
    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_tokens = 0  # feature rows held
        self.num_encoded = 0  # images the encoder computed
        self.num_hits = 0

    def __contains__(self, image_hash: str) -> bool:
        return image_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, image_hash: str) -> torch.Tensor | None:
        features = self._entries.get(image_hash)
        if features is not None:
            self._entries.move_to_end(image_hash)
            self.num_hits += 1
        return features

    def put(self, image_hash: str, features: torch.Tensor) -> None:
        if image_hash in self._entries:
            self.num_tokens -= self._entries.pop(image_hash).shape[0]
        self._entries[image_hash] = features
        self.num_tokens += features.shape[0]
        while self.num_tokens > self.capacity_tokens and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self.num_tokens -= old.shape[0]

    def clear(self) -> None:
        self._entries.clear()
        self.num_tokens = 0
