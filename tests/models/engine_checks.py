"""transformers' step logits through the offline LLM API and through the server, for a checkpoint.

Each decode step's top logprobs (the LLM's `logprobs=k`, the server's SGLang `/generate` with
`return_logprob`) are log_softmax of dayzero's logits; they must equal log_softmax of transformers'
full forward (no cache, the oracle `dayzero verify` uses) over the prompt and dayzero's tokens, within
`tolerance` x max |logits| of the step, and every greedy token must be the oracle's argmax.

    assert_llm_matches_transformers(path, lengths, hf) -> the LLM (a batch of prompts, then a second turn
        that extends the longest with its answer and reuses its cached prefix)
    assert_server_matches_transformers(path, lengths, hf)
hf: transformers' float32 model of the checkpoint (dayzero.verify.load_reference).
"""

from __future__ import annotations

import httpx
import torch

from dayzero.engine import SamplingParams
from dayzero.engine.llm import LLM
from tests.models.helpers import random_prompt

NEW_TOKENS, TOP = 6, 5


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    return [random_prompt(1, n, vocab, seed + i)[0].tolist() for i, n in enumerate(lengths)]


def assert_steps_match(hf, prompt: list[int], tokens: list[int], tops: list[list[tuple[int, float]]],
                       tolerance: float = 1e-4) -> None:
    """tokens: dayzero's greedy tokens; tops[k]: its (token id, logprob) of step k, most likely first."""
    assert len(tokens) == len(tops) == NEW_TOKENS
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].double()
    for k, (token, top) in enumerate(zip(tokens, tops)):
        ref = torch.log_softmax(logits[k], -1)
        assert token == int(logits[k].argmax()), f"step {k}: token {token}, transformers {int(logits[k].argmax())}"
        err = max(abs(lp - float(ref[t])) for t, lp in top) / float(logits[k].abs().max())
        assert err <= tolerance, f"step {k}: logprobs differ by {err:.2e} x max |logits|"


def assert_llm_matches_transformers(path, lengths, hf, tolerance: float = 1e-4, **llm_kwargs) -> LLM:
    llm = LLM(path, dtype="float32", **llm_kwargs)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    prompts = _prompts(llm.vocab_size, lengths)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert_steps_match(hf, prompt, out.token_ids, [lp.top for lp in out.outputs[0].logprobs], tolerance)
    second = prompts[-1] + outs[-1].token_ids + _prompts(llm.vocab_size, [7], seed=99)[0]
    cached = llm.scheduler.num_prefix_cached_tokens
    out = llm.generate([second], params)[0]
    assert llm.scheduler.num_prefix_cached_tokens > cached  # the first turn's blocks were reused
    assert_steps_match(hf, second, out.token_ids, [lp.top for lp in out.outputs[0].logprobs], tolerance)
    return llm


def assert_server_matches_transformers(path, lengths, hf, tolerance: float = 1e-4) -> None:
    from tests.server.conftest import start_server, stop_server

    running = start_server({"model": str(path), "dtype": "float32"})
    try:
        prompts = _prompts(running.llm.vocab_size, lengths, seed=5)
        body = {"input_ids": prompts, "return_logprob": True, "top_logprobs_num": TOP,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
        reply = httpx.post(running.url + "/generate", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        for prompt, result in zip(prompts, reply.json()):
            tops = [[(t, v) for v, t, _ in step] for step in result["meta_info"]["output_top_logprobs"]]
            assert_steps_match(hf, prompt, result["output_ids"], tops, tolerance)
    finally:
        stop_server(running)
