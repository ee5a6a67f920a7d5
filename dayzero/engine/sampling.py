"""Sampling: per-request parameters, the batched sampler, and stop conditions.

One decode step hands the sampler float logits [B, V] for B requests (one row each). Per row, in
this order (vLLM's classic order, as its V0 sampler applied them):

  1. penalties        repetition on prompt + output tokens; frequency, then presence, on output tokens
  2. greedy           rows with temperature < GREEDY_TEMPERATURE take argmax here and skip 3-6
  3. temperature      logits / T
  4. top-k            keep tokens whose logit >= the k-th largest (ties with the k-th are kept)
  5. top-p            on the distribution renormalised after top-k, keep the smallest prefix of
                      tokens by descending probability whose mass reaches p; tokens tied with the
                      last one kept are kept as well (so the rule does not depend on sort order)
  6. min-p            keep tokens with p >= min_p * p_max
  7. sample           one draw from softmax of what is left, from the request's own generator

vLLM's V1 sampler applies min-p before top-k/top-p; the two orders differ only when top-p and min-p
are both set (min-p first changes the mass that top-p renormalises over).

Logprobs follow vLLM's default (`logprobs_mode="raw_logprobs"`): they are log_softmax of the model's
raw logits, before penalties, temperature and truncation, so they describe the model, not the
sampling distribution, and a greedy and a sampled request report the same numbers.

Randomness: every request owns a `torch.Generator`, seeded from `SamplingParams.seed` or, when the
seed is None, from a seed drawn off the sampler's global seed at admission. A row's draw reads only
its own generator (one uniform variate per step, turned into a token by the inverse CDF of its
distribution), so a seeded request produces the same tokens whichever other requests share its
batch, and a step draws B numbers rather than B x V.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from dayzero.engine.errors import InvalidRequestError
from dayzero.structured.bitmask import TokenBitmask, apply_token_bitmask
from dayzero.structured.grammar import Grammar
from dayzero.structured.params import StructuredOutputs

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (argmax), as vLLM does
MAX_LOGPROBS = 20  # the OpenAI API's limit on top logprobs
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    """How to sample one request. Field names and defaults are vLLM's.

    max_tokens: output tokens to generate at most; None = until the context is full (the engine's check).
    temperature: 0 (below GREEDY_TEMPERATURE) = greedy.
    top_k: -1 or 0 = off. top_p: 1.0 = off. min_p: 0.0 = off.
    repetition_penalty: HF/vLLM semantics, over prompt and output tokens: a seen token's logit l
        becomes l / r if l > 0 else l * r. 1.0 = off.
    presence_penalty, frequency_penalty: OpenAI semantics, over output tokens only:
        l -= frequency_penalty * count + presence_penalty * (count > 0).
    seed: None = drawn from the engine's global seed; an int makes the request reproducible.
    stop: strings that end generation; the matched string is not returned. A single string is accepted.
    stop_token_ids: token ids that end generation (besides EOS); their text is not returned.
    ignore_eos: keep generating past EOS (benchmarks).
    logprobs: None = none; k = the sampled token's logprob and the k most likely (0 <= k <= 20).
    n: completions per prompt (the engine forks the request; see Sampler.new_state's sample_index).
    skip_special_tokens: drop special tokens when detokenizing.
    structured_outputs: constrain the output to a JSON schema, regex or grammar (dayzero.structured;
        the engine compiles it at validation and the sampler masks the logits: docs/structured.md).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)

    @property
    def greedy(self) -> bool:
        return _is_number(self.temperature) and self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError (a ValueError) listing every invalid field with its value and the
        allowed range; its `param` is the first."""
        problems: list[str] = []

        def bad(name: str, allowed: str):
            value = getattr(self, name)
            problems.append(f"{name}={value!r} ({type(value).__name__}) is invalid: {allowed}")

        def check_number(name: str, ok, allowed: str):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or not ok(value):
                bad(name, allowed)

        def check_int(name: str, ok, allowed: str, optional: bool = False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if not _is_int(value) or not ok(value):
                bad(name, allowed)

        check_int("max_tokens", lambda v: v >= 1, "expected an integer >= 1 or None", optional=True)
        check_number("temperature", lambda v: v >= 0, "expected a number >= 0 (0 = greedy)")
        check_number("top_p", lambda v: 0 < v <= 1, "expected a number in (0, 1] (1 = off)")
        check_int("top_k", lambda v: v >= -1, "expected an integer >= 1, or -1 or 0 for off")
        check_number("min_p", lambda v: 0 <= v <= 1, "expected a number in [0, 1] (0 = off)")
        check_number("repetition_penalty", lambda v: v > 0, "expected a number > 0 (1 = off)")
        check_number("presence_penalty", lambda v: -2 <= v <= 2, "expected a number in [-2, 2] (0 = off)")
        check_number("frequency_penalty", lambda v: -2 <= v <= 2, "expected a number in [-2, 2] (0 = off)")
        check_int("seed", lambda v: _SEED_RANGE[0] <= v < _SEED_RANGE[1],
                  "expected None or an integer in [-2**63, 2**64)", optional=True)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "expected a list of non-empty strings")
        top = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab_size)"
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size) for t in self.stop_token_ids
        ):
            bad("stop_token_ids", f"expected a list of token ids in {top}")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "expected True or False")
        check_int("logprobs", lambda v: 0 <= v <= MAX_LOGPROBS,
                  f"expected None or an integer in [0, {MAX_LOGPROBS}]", optional=True)
        check_int("n", lambda v: v >= 1, "expected an integer >= 1")
        if not isinstance(self.skip_special_tokens, bool):
            bad("skip_special_tokens", "expected True or False")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            bad("structured_outputs", "expected None or a dayzero.structured.StructuredOutputs")
        if problems:
            raise InvalidRequestError("invalid sampling parameters: " + "; ".join(problems), problems[0].split("=")[0])


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------------
# The sampler


@dataclass
class SamplingState:
    """What the sampler needs of one request across steps. The engine appends each sampled token to
    `output_token_ids` (it may share the list with its own request object).

    With penalties the state keeps its output-token counts on the device (`counts` float32 [V], and
    `prompt_seen` bool [V] for the repetition penalty), built once and then updated in place: the
    sampler adds each token it samples for the row (on the device, before the host has the id), and
    tokens appended to output_token_ids beyond `counted` (the ones it did not sample) at the next call.
    So a step's work does not grow with the output, and async scheduling can sample with penalties
    while the previous ids are still on their way."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator
    counts: torch.Tensor | None = None
    prompt_seen: torch.Tensor | None = None
    counted: int = 0  # output tokens included in counts
    grammar: Grammar | None = None  # structured outputs: the matcher the engine advances with every appended token


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token under the raw model distribution (log_softmax of the logits)."""

    token_id: int
    logprob: float
    rank: int  # 1 + the number of tokens with a strictly higher logprob
    top: list[tuple[int, float]]  # the k most likely (token id, logprob), most likely first


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


class Sampler:
    """Samples one token per row of a [B, V] logits batch, each row with its own params and state.

    seed: the global seed; requests without their own seed get one drawn from it in admission order.
    """

    def __init__(self, vocab_size: int, seed: int = 0, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._seeds = random.Random(seed)
        self._bitmask: TokenBitmask | None = None  # created at the first constrained row

    def new_state(self, params: SamplingParams, prompt_token_ids: list[int], sample_index: int = 0,
                  output_token_ids: list[int] | None = None) -> SamplingState:
        """Validate params and create a request's state. For n > 1 the engine creates one state per
        completion, sample_index 0..n-1; a seeded request's completion i uses seed + i, so the n
        completions differ and each is reproducible."""
        params.validate(self.vocab_size)
        if params.seed is None:
            seed = self._seeds.getrandbits(63)
        else:
            seed = (params.seed + sample_index) % 2**64
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return SamplingState(params, list(prompt_token_ids),
                             output_token_ids if output_token_ids is not None else [], generator)

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [batch, vocab] with one row per state; got {tuple(logits.shape)} "
                             f"for {len(states)} states")
        raw = logits.float()
        constrained = [i for i, s in enumerate(states) if s.grammar is not None and s.grammar.active]
        if constrained:  # grammar masks first: raw logprobs, penalties and sampling all see the masked logits
            if self._bitmask is None:
                self._bitmask = TokenBitmask(logits.shape[1], logits.device)
            masks = self._bitmask.fill([states[i].grammar for i in constrained])
            raw = raw.clone() if raw is logits else raw
            apply_token_bitmask(raw, torch.tensor(constrained, device=raw.device), masks)
        params = [s.params for s in states]
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        logits = apply_penalties(raw, states)  # brings the penalised rows' counts up to date
        token_ids = logits.argmax(-1)  # greedy rows keep this: the lowest token id among ties
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = sampling_probs(logits[rows], [params[i] for i in random_rows])
            uniform = torch.cat([torch.rand(1, generator=states[i].generator, device=probs.device, dtype=torch.float64)
                                 for i in random_rows])
            token_ids[rows] = inverse_cdf_sample(probs, uniform)
        for i in penalised:  # this step's token, counted on the device
            s = states[i]
            s.counts.index_add_(0, token_ids[i:i + 1], torch.ones(1, device=raw.device))
            s.counted += 1
        return SamplerOutput(token_ids, _gather_logprobs(raw, token_ids, params))


def inverse_cdf_sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One draw per row from the categorical probs [B, V] (unnormalised, >= 0) given uniform [B] in
    [0, 1): the token i with cdf[i-1] <= u * total < cdf[i], so a zero-probability token is never
    drawn. The cumulative sum runs in float64 so a vocabulary of 10^5+ tokens keeps its small
    probabilities."""
    cdf = probs.double().cumsum(-1)
    target = (uniform.double() * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _sync_counts(state: SamplingState, vocab_size: int, device) -> None:
    """Make state.counts (and prompt_seen) cover its output tokens: built at the first call, then
    only the tokens appended beyond `counted`."""
    if state.counts is None or state.counts.device != torch.device(device):
        state.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        state.counted = 0
        state.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if state.prompt_token_ids:
            state.prompt_seen[torch.tensor(state.prompt_token_ids, device=device)] = True
    new = state.output_token_ids[state.counted:]
    if new:
        state.counts.index_add_(0, torch.tensor(new, dtype=torch.long, device=device), torch.ones(len(new), device=device))
        state.counted += len(new)


def apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, then frequency and presence over output tokens.
    Returns a new tensor; rows without penalties are unchanged."""
    params = [s.params for s in states]
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    vocab, dev = logits.shape[1], logits.device
    for i in rows:
        _sync_counts(states[i], vocab, dev)
    index = torch.tensor(rows, device=dev)
    counts = torch.stack([states[i].counts for i in rows])  # [P, V]
    sub = logits[index]
    rep = [params[i].repetition_penalty for i in rows]
    if any(r != 1.0 for r in rep):
        seen = torch.stack([states[i].prompt_seen for i in rows]) | (counts > 0)
        r = torch.tensor(rep, device=dev).unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    f = torch.tensor([params[i].frequency_penalty for i in rows], device=dev).unsqueeze(1)
    p = torch.tensor([params[i].presence_penalty for i in rows], device=dev).unsqueeze(1)
    sub = sub - f * counts - p * (counts > 0).float()
    out = logits.clone()
    out[index] = sub
    return out


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a non-greedy row samples from: temperature, top-k, top-p, min-p, softmax."""
    dev = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=dev)
    logits = logits / temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
    probs = torch.softmax(logits, -1)
    min_p = [p.min_p for p in params]
    if any(min_p):
        threshold = torch.tensor(min_p, device=dev).unsqueeze(1) * probs.amax(-1, keepdim=True)
        probs = torch.where(probs >= threshold, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k, then outside its top-p (see module doc)."""
    vocab = logits.shape[1]
    use_k = any(0 < k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not use_k and not use_p:
        return logits
    dev = logits.device
    sorted_logits = logits.sort(-1, descending=True).values
    if use_k:
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, -math.inf)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
    if use_p:
        p = torch.tensor(top_p, device=dev).unsqueeze(1)
        sorted_probs = torch.softmax(sorted_logits, -1)
        # Probability of the tokens ranked above each one; a cumsum of non-negative values never
        # decreases, so `kept` is a prefix of the sorted row and always holds the first token.
        mass_before = torch.cat([torch.zeros_like(sorted_probs[:, :1]), sorted_probs.cumsum(-1)[:, :-1]], 1)
        kept = (mass_before < p) | (p >= 1.0)
        last_kept = kept.sum(-1, keepdim=True) - 1
        # Compare logits, not probabilities: a permutation leaves logits bit-exact, so tokens tied
        # with the last kept one are kept too.
        threshold = sorted_logits.gather(1, last_kept)
        logits = logits.masked_fill(logits < threshold, -math.inf)
    return logits


def _gather_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]):
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    index = torch.tensor(rows, device=raw.device)
    logprobs = torch.log_softmax(raw[index], -1)
    chosen_ids = token_ids[index]
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1))
    rank = (logprobs > chosen).sum(-1) + 1
    k = max(params[i].logprobs for i in rows)
    top_lp, top_ids = logprobs.topk(min(k, raw.shape[1]), -1)
    chosen, rank, top_lp, top_ids, chosen_ids = (t.tolist() for t in (chosen, rank, top_lp, top_ids, chosen_ids))
    for j, i in enumerate(rows):
        want = params[i].logprobs
        top = [(t, v) for t, v in zip(top_ids[j][:want], top_lp[j][:want]) if v != -math.inf]  # a grammar's masked tokens
        out[i] = TokenLogprobs(chosen_ids[j], chosen[j][0], rank[j], top)
    return out


# ---------------------------------------------------------------------------------------------------
# Stop conditions


@dataclass
class StopDecision:
    finish_reason: str | None  # None = continue; "stop" (EOS, stop token, stop string) or "length"
    stop_reason: int | str | None  # the stop token id or stop string matched; None for EOS and length
    length: int  # characters of the output text to return: before a matched stop string or the stopping token's text


class StopChecker:
    """Decides, after each sampled token, whether a request is finished (OpenAI/vLLM semantics).

    One per request. Call `check` once per new token with the text that token made final (the
    detokenizer's piece, possibly empty: dayzero/engine/detokenizer.py), so the output text only
    ever grows by appending. Checks, in order: EOS (unless ignore_eos), stop_token_ids, stop strings
    (which may span several tokens: the search covers the new text plus the last longest-stop-string
    - 1 characters before it, which the checker keeps, so each character is searched once and a
    call's work does not grow with the output), then max_tokens. A stop string wins over max_tokens
    when both happen at the same token. The decision's `length` ends before the earliest matched
    stop string; a stopping EOS or stop token contributes no text.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: int | list[int] | set[int] | None):
        self.params = params
        if eos_token_ids is None or params.ignore_eos:
            self.eos = frozenset()
        elif isinstance(eos_token_ids, int):
            self.eos = frozenset([eos_token_ids])
        else:
            self.eos = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.length = 0  # characters of output text seen so far
        self.tail = ""  # its last max_stop_len - 1 characters

    def check(self, new_text: str, new_token_id: int, num_output_tokens: int) -> StopDecision:
        previous = self.length
        self.length += len(new_text)
        window, window_start = self.tail + new_text, previous - len(self.tail)
        keep = self.max_stop_len - 1
        self.tail = window[max(len(window) - keep, 0):] if keep > 0 else ""
        if new_token_id in self.eos:
            return StopDecision("stop", None, previous)
        if new_token_id in self.stop_token_ids:
            return StopDecision("stop", new_token_id, previous)
        if self.params.stop and new_text:
            matches = [(i, s) for s in self.params.stop if (i := window.find(s)) >= 0]
            if matches:
                index, stop = min(matches)
                return StopDecision("stop", stop, window_start + index)
        if self.params.max_tokens is not None and num_output_tokens >= self.params.max_tokens:
            return StopDecision("length", None, self.length)
        return StopDecision(None, None, self.length)

    def streamable_length(self) -> int:
        """How much of a not-yet-stopped output is safe to stream: all of it but a trailing part that
        could still grow into a stop string (the longest suffix that is a proper prefix of one)."""
        hold = 0
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(self.tail)), hold, -1):
                if self.tail.endswith(stop[:n]):
                    hold = n
                    break
        return self.length - hold
