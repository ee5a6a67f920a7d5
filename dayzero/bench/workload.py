"""The benchmark's workload: num_prompts requests of random token ids (seeded, so nothing is downloaded
and a run can be repeated), each with its own input and output length.

Lengths follow vLLM's random dataset: with range ratio r (0 <= r < 1) each length is drawn uniformly
from [floor(L * (1 - r)), ceil(L * (1 + r))] (at least 1); r = 0 gives every request exactly L. The
lengths depend only on the seed. The token ids also depend on a `draw` number, so that every
concurrency level of a sweep (and every warm-up) gets fresh prompts of the same lengths: no level
finds another level's prompts in the prefix cache.

`--json-schema` makes every request a constrained one (structured outputs): its output must be JSON
valid against the schema (RECORDS_SCHEMA by default: an array of at least 1000 small records, so that
no output completes within a benchmark's output length and every token is sampled under a live mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# draw numbers: concurrency levels use 0, 1, 2, ...; warm-ups count down from here
WARMUP_DRAW = 1 << 20

RECORD_SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0},
    "name": {"type": "string", "maxLength": 24},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "urgent", "later"]}, "maxItems": 4},
    "score": {"type": "number"},
    "active": {"type": "boolean"}},
    "required": ["id", "name", "tags", "score", "active"], "additionalProperties": False}
RECORDS_SCHEMA = {"type": "array", "items": RECORD_SCHEMA, "minItems": 1000}


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # max_tokens; with ignore_eos, exactly the tokens generated
    json_schema: dict | None = None  # the output must be JSON valid against it (a constrained request)


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    vocab_size: int  # token ids are drawn from [0, vocab_size)
    range_ratio: float = 0.0
    seed: int = 0
    json_schema: dict | None = None  # every request constrained to it (None: unconstrained)

    def __post_init__(self):
        for name in ("num_prompts", "input_len", "output_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")

    def _lengths(self, mean: int, rng: np.random.Generator) -> list[int]:
        low = max(1, math.floor(mean * (1 - self.range_ratio)))
        high = max(low, math.ceil(mean * (1 + self.range_ratio)))
        return rng.integers(low, high + 1, size=self.num_prompts).tolist()

    def lengths(self) -> list[tuple[int, int]]:
        """(input length, output length) per request; the same for every draw."""
        rng = np.random.default_rng([self.seed, 0])
        inputs = self._lengths(self.input_len, rng)
        return list(zip(inputs, self._lengths(self.output_len, rng)))

    def requests(self, draw: int = 0) -> list[BenchRequest]:
        """The requests of one draw: lengths() with token ids of their own."""
        rng = np.random.default_rng([self.seed, 1, draw])
        return [BenchRequest(rng.integers(0, self.vocab_size, size=n).tolist(), out, self.json_schema)
                for n, out in self.lengths()]

    @property
    def max_request_len(self) -> int:
        """The longest prompt + output of the workload, in tokens."""
        return max(n + out for n, out in self.lengths())

    def to_dict(self) -> dict:
        lengths = self.lengths()
        return {"num_prompts": self.num_prompts, "input_len": self.input_len, "output_len": self.output_len,
                "random_range_ratio": self.range_ratio, "seed": self.seed, "vocab_size": self.vocab_size,
                "total_input_tokens": sum(n for n, _ in lengths), "max_output_tokens": sum(o for _, o in lengths),
                "json_schema": self.json_schema}
