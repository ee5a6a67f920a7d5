"""One generation request as the scheduler tracks it: its tokens, status and progress.

Token accounting (units: tokens)
- `num_tokens` = len(prompt_token_ids) + len(output_token_ids): every token known so far.
- `num_computed_tokens`: the leading tokens whose KV entries are in the request's blocks (computed
  by the model or matched in the prefix cache). Always <= num_tokens. A decoding request has
  num_computed_tokens == num_tokens - 1: its last sampled token is the next step's input.
- A step that brings num_computed_tokens up to num_tokens produces logits for the last token, so
  the runner samples one new token for it; a prefill chunk that stops short samples nothing.
- `images`: the prompt's images and the positions of their placeholder tokens (vision-language models);
  a block of tokens that overlaps an image has the image's hash among its prefix-cache keys
  (`block_extra_keys`), so that two prompts alike but for an image never share that block.
- With async scheduling (dayzero/engine/engine.py) a sampled token can be `num_pending`: counted in
  num_tokens and num_output_tokens before its value reaches the host. `token_ids` gives PENDING (-1)
  for it (the runner reads such an input from the device); output_token_ids holds only known tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dayzero.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from dayzero.multimodal.placeholders import ImagePlacement

PENDING = -1  # the id token_ids gives for a sampled token whose value is still on the device


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # admitted, holds blocks
    PREEMPTED = "preempted"  # blocks taken back; waits to recompute prompt + output from scratch
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token id, or a stop string (finish_reason "stop")
    FINISHED_LENGTH = "finished_length"  # max_tokens reached or the KV pool full (finish_reason "length")
    FINISHED_ABORTED = "finished_aborted"  # cancelled by the client (finish_reason "abort")
    FINISHED_ERROR = "finished_error"  # a step it was in failed (finish_reason "error"; Engine: A failed step)

    def block_extra_keys(self, start: int, end: int) -> tuple[str, ...] | None:
        """The hashes of the images whose placeholders overlap tokens [start, end), None when none do."""
        keys = tuple(p.image.hash for p in self.images if p.offset < end and p.end > start)
        return keys or None

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    arrival: int = -1  # admission order, set by Scheduler.add; FCFS and preemption order use it
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the first admission
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    num_pending: int = 0  # sampled tokens whose ids are not on the host yet (async scheduling)
    images: tuple[ImagePlacement, ...] = ()  # in prompt order

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        known = self.prompt_token_ids[start:end] + self.output_token_ids[max(start - p, 0):max(end - p, 0)]
        missing = min(end, self.num_tokens) - max(start, self.num_known_tokens)
        return known + [PENDING] * missing if missing > 0 else known

    def block_extra_keys(self, start: int, end: int) -> tuple[str, ...] | None:
        """The hashes of the images whose placeholders overlap tokens [start, end), None when none do."""
        keys = tuple(p.image.hash for p in self.images if p.offset < end and p.end > start)
        return keys or None

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: "stop", "length", "abort", "error" (a failed step), or None while unfinished."""
        return _FINISH_REASONS.get(self.status)
