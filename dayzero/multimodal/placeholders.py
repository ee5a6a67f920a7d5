"""Where a prompt's images go: its image placeholder tokens, expanded to one per feature row.

A prompt marks each image with a run of the model's image placeholder token (Kimi K2.5: `<|media_pad|>`
inside `<|media_begin|>image<|media_content|>...<|media_end|>`, what its chat template writes). Run i
belongs to image i: a run of one token is expanded to the image's `num_tokens` copies (what a chat
template or a user writes), a run of exactly `num_tokens` is taken as already expanded (a prompt sent
back as token ids). Any other run length, or a number of runs that differs from the number of images,
is refused, naming the counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from dayzero.multimodal.images import ImageError
from dayzero.multimodal.processor import ImageInput


@dataclass(frozen=True)
class ImagePlacement:
    """An image and where its features go: prompt positions [offset, offset + image.num_tokens)."""

    image: ImageInput
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.image.num_tokens


def placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of token_id in ids."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def place_images(ids: list[int], images: list[ImageInput], token_id: int, where: str = "prompt"
                 ) -> tuple[list[int], tuple[ImagePlacement, ...]]:
    """(the prompt with every image's placeholder run expanded, the placements); ImageError on a mismatch."""
    runs = placeholder_runs(ids, token_id)
    if len(runs) != len(images):
        raise ImageError(f"{where}: {len(images)} image(s) given but the prompt has {len(runs)} image placeholder(s) "
                         f"(token id {token_id}); give one image per placeholder, in order")
    out: list[int] = []
    placements = []
    prev = 0
    for i, ((start, length), image) in enumerate(zip(runs, images)):
        if length not in (1, image.num_tokens):
            raise ImageError(f"{where}: image {i}'s placeholder is {length} tokens long; it must be 1 token (expanded "
                             f"here) or the image's {image.num_tokens} tokens")
        out += ids[prev:start]
        placements.append(ImagePlacement(image, len(out)))
        out += [token_id] * image.num_tokens
        prev = start + length
    return out + ids[prev:], tuple(placements)
