"""The step's token masks: filled on the host by llguidance, applied on the device to the rows that need them.

Layout: int32 [rows, ceil(V / 32)], bit b of word w allows token 32 * w + b (llguidance's layout).
The host buffer is pinned on CUDA and copied with one non-blocking transfer; an event recorded
after the copy guards the buffer's reuse. Rows without a grammar get no mask and cost nothing: the
sampler calls `fill` and `apply_token_bitmask` only when some row of the step is constrained.
"""

from __future__ import annotations

import torch

from dayzero.structured.grammar import Grammar


class TokenBitmask:
    def __init__(self, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.device = torch.device(device)
        self._host = torch.empty(0, self.words, dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None
        self._executor = None

    def _buffer(self, rows: int) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the last transfer out of the buffer is done
        if self._host.shape[0] < rows:
            cuda = self.device.type == "cuda"
            self._host = torch.empty(max(rows, 2 * self._host.shape[0]), self.words, dtype=torch.int32,
                                     pin_memory=cuda)
        return self._host[:rows]

    def fill(self, grammars: list[Grammar]) -> torch.Tensor:
        """The masks of the next token of each grammar, [len(grammars), words] int32 on the device."""
        from llguidance import LLExecutor

        host = self._buffer(len(grammars))
        live = []
        for i, g in enumerate(grammars):
            if g.failed:  # EOS only
                host[i].zero_()
                for t in g.eos_token_ids:
                    host[i, t // 32] |= _bit(t % 32)
            else:
                live.append((g.matcher, i))
        if len(live) == 1:
            matcher, i = live[0]
            matcher.unsafe_compute_mask_ptr(host[i].data_ptr(), self.words * 4)
        elif live:
            if self._executor is None:
                self._executor = LLExecutor()
            self._executor.unsafe_compute_mask_ptr(live, host.data_ptr(), self.words * 4, host.shape[0])
        if self.device.type != "cuda":
            return host.clone()
        out = host.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out


def _bit(b: int) -> int:
    return (1 << b) - (1 << 32) if b == 31 else 1 << b  # as a signed int32


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of bitmask[i] is 0. logits [B, V] float."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
