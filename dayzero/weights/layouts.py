"""Tensor layouts: the names a checkpoint stores its tensors under, mapped onto a model's names.

A family's weights reach users under several names: the release (what the model's authors
publish), what transformers' `save_pretrained` writes, and transformers' in-memory names
(`save_pretrained(save_original_format=False)`, or any state_dict of its model). A model lists the
layouts it loads (`CausalLM.layouts()`); each is an ordered list of rules applied to every entry
of the checkpoint's catalogue in turn (what one rule renames is what the next one sees):

    Rename(pattern, replacement)    re.sub of the first match: the same tensor under a new name
    Unstack(pattern, replacement)   a tensor [N, ...] holds N tensors [...]; "{i}" in the
                                    replacement becomes the index (stacked experts)
    Chunk(pattern, replacements)    a tensor [k*n, ...] holds k tensors [n, ...] in order
                                    (gate and up rows, q/k/v convolutions)

Unstack and Chunk split along dim 0, so each piece is a contiguous byte range of its file: the
pieces are catalogue entries like any other (`TensorInfo.stored_as` names the stored tensor) and
are read straight from disk, nothing is copied twice. A pattern that matches no tensor does
nothing, so a layout's rules only need to cover the names that differ from the model's.

`match_layout` maps the checkpoint through each layout in order and keeps the first whose tensors
fit the model's schema (names, shapes, dtypes): no flag is needed. When none fits, it raises the
problems of the closest one (fewest missing and unexpected names) after a list of every layout
tried and how far it was.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dayzero.weights.checkpoint import Checkpoint
from dayzero.weights.errors import MissingTensorError, UnexpectedTensorError
from dayzero.weights.header import DTYPES, TensorInfo
from dayzero.weights.schema import TensorSpec, count_problems, find_problems, schema_error


@dataclass(frozen=True)
class Rename:
    pattern: str
    replacement: str

    def apply(self, info: TensorInfo) -> list[TensorInfo] | None:
        name, n = re.subn(self.pattern, self.replacement, info.name, count=1)
        return [_renamed(info, name)] if n else None


@dataclass(frozen=True)
class Unstack:
    pattern: str
    replacement: str  # "{i}" is the index along dim 0

    def apply(self, info: TensorInfo) -> list[TensorInfo] | None:
        if not re.search(self.pattern, info.name) or len(info.shape) < 2:
            return None
        template = re.sub(self.pattern, self.replacement, info.name, count=1)
        return _pieces(info, [template.replace("{i}", str(i)) for i in range(info.shape[0])], info.shape[1:])


@dataclass(frozen=True)
class Chunk:
    pattern: str
    replacements: tuple[str, ...]

    def apply(self, info: TensorInfo) -> list[TensorInfo] | None:
        parts = len(self.replacements)
        if not re.search(self.pattern, info.name) or not info.shape or info.shape[0] % parts:
            return None
        names = [re.sub(self.pattern, r, info.name, count=1) for r in self.replacements]
        return _pieces(info, names, (info.shape[0] // parts, *info.shape[1:]))


Rule = Rename | Unstack | Chunk


@dataclass(frozen=True)
class Layout:
    """name: how errors call it; example: a few stored names, for the error message."""

    name: str
    example: str
    rules: tuple[Rule, ...] = ()

    def apply(self, checkpoint: Checkpoint) -> Checkpoint:
        """The checkpoint with its catalogue under the model's names (the files are not touched)."""
        if not self.rules:
            return checkpoint
        tensors = list(checkpoint.tensors.values())
        for rule in self.rules:
            out = []
            for info in tensors:
                out += rule.apply(info) or [info]
            tensors = out
        return dataclasses.replace(checkpoint, tensors={t.name: t for t in tensors})

    def then(self, *rules: Rule, name: str | None = None, example: str | None = None) -> Layout:
        """This layout followed by more rules (e.g. a wrapper's prefix after a text model's names)."""
        return Layout(name or self.name, example or self.example, self.rules + rules)


def match_layout(checkpoint: Checkpoint, layouts: Iterable[Layout], expected: Mapping[str, TensorSpec], *,
                 family: str, ignore_unexpected: Iterable[str | re.Pattern] = ()) -> tuple[Layout, Checkpoint]:
    """(the first layout the checkpoint fits, the checkpoint under the model's names)."""
    ignore = tuple(ignore_unexpected)
    tried = []
    for layout in layouts:
        mapped = layout.apply(checkpoint)
        problems = find_problems(mapped, expected, ignore_unexpected=ignore)
        if not problems:
            return layout, mapped
        tried.append((layout, problems))
    if len(tried) == 1:
        raise schema_error(tried[0][1], f"Checkpoint {checkpoint.path} does not match the model")
    closest, problems = min(tried, key=lambda t: (_name_problems(t[1]), len(t[1])))
    lines = [f"Checkpoint {checkpoint.path} matches none of the tensor layouts {family} loads:"]
    for layout, found in tried:
        lines.append(f"  {layout.name} ({layout.example}): {count_problems(found)}{_sample(found)}")
    raise schema_error(problems, "\n".join(lines) + f"\nClosest is {closest.name}")


def _name_problems(problems) -> int:
    return sum(isinstance(p, (MissingTensorError, UnexpectedTensorError)) for p in problems)


def _sample(problems) -> str:
    """'; e.g. missing A, unexpected B': one name of each kind, so the list shows what differs."""
    out = []
    for kind, label in ((MissingTensorError, "missing"), (UnexpectedTensorError, "unexpected")):
        first = next((p for p in problems if type(p) is kind), None)
        if first is not None:
            out.append(f"{label} {first.tensor}")
    return f"; e.g. {', '.join(out)}" if out else ""


def _renamed(info: TensorInfo, name: str) -> TensorInfo:
    stored = info.stored_as or info.name
    return dataclasses.replace(info, name=name, stored_as=None if stored == name else stored)


def _pieces(info: TensorInfo, names: list[str], shape: tuple[int, ...]) -> list[TensorInfo] | None:
    """`info` cut along dim 0 into len(names) consecutive pieces of `shape` each; None when a
    piece is not a whole number of bytes (sub-byte dtypes)."""
    bits = math.prod(shape) * DTYPES[info.dtype].bits
    if bits % 8:
        return None
    size = bits // 8
    stored = info.stored_as or info.name
    return [dataclasses.replace(info, name=n, shape=tuple(shape), start=info.start + k * size,
                                end=info.start + (k + 1) * size, stored_as=stored)
            for k, n in enumerate(names)]
