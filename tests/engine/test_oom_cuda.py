"""Real GPU out-of-memory (skipped without CUDA): a burst of long prompts over a deliberately small KV pool
with a large token budget, on a device made small. The test measures what a step of the whole budget
allocates and what a step of a quarter of it allocates, then caps the caching allocator between the two
(torch.cuda.set_per_process_memory_fraction: allocations past it raise torch.OutOfMemoryError, as on a
full device). The engine must catch it, retry the step's requests within a smaller budget and finish
every request with the tokens of the uncapped run; memory returns to where it was. The demo (DeepSeek-V4:
recurrent state: its requests are preempted) and a gpt-oss with
wider layers (no recurrent state, async scheduling: the step in flight is resolved first). float32, so
that other chunkings give the same greedy tokens. Prints the figures RELIABILITY.md records:

    python -m pytest -q -s tests/engine/test_oom_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from dayzero.engine import SamplingParams
from dayzero.engine.llm import LLM
from tests.engine.test_llm import _assert_pool_free, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BUDGET = 16384  # tokens per step (--chunked-prefill-size)
PROMPT, BURST = 3000, 8  # a burst of 8 prompts of 3000 tokens: 24000 prompt tokens, steps of the whole budget
MIB = 2**20


def _model(name: str, tmp_path):
    if name == "demo":
        return None
    from tests.models.gpt_oss_checkpoints import build_gpt_oss_checkpoint

    return build_gpt_oss_checkpoint(tmp_path, hidden_size=1024, intermediate_size=1024, num_attention_heads=16,
                                    num_key_value_heads=4, head_dim=64, num_hidden_layers=2)


def _peak(llm, prompts, params) -> tuple[list, int]:
    """The outputs and the most the step loop allocated above what was allocated before it (bytes)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    return outs, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("name", ["demo", "gpt_oss"])
def test_a_burst_of_long_prompts_out_of_device_memory_is_retried_to_the_same_tokens(name, tmp_path):
    # prefix caching off: the capped run's prompts are the measured runs' (on the H100, 2026-12-06, with it on
    # they hit the cache, the capped run's steps were small and no step ran out of memory)
    llm = LLM(_model(name, tmp_path), device="cuda", dtype="float32", max_num_batched_tokens=BUDGET,
              max_num_seqs=BURST, max_model_len=4096, num_kv_blocks=BURST * PROMPT // 16 // 2,  # half the burst fits
              enable_prefix_caching=False)
    engine = llm.engine
    prompts = _prompts(llm.vocab_size, [PROMPT] * BURST, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    outs, peak_full = _peak(llm, prompts, params)
    want = [(o.token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
    llm.scheduler.max_num_batched_tokens = BUDGET // 4
    _, peak_quarter = _peak(llm, prompts[:2], params)
    llm.scheduler.max_num_batched_tokens = BUDGET
    assert peak_full > peak_quarter + 64 * MIB, (peak_full, peak_quarter)  # room to put the cap between them

    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    reserved = torch.cuda.memory_reserved()
    cap = reserved + (peak_full + peak_quarter) // 2
    allocated_before = torch.cuda.memory_allocated()
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        got = llm.generate(prompts, params)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.synchronize()
    print(f"\n[oom] {name}: a step of {BUDGET} tokens allocates {peak_full / MIB:.0f} MiB, of {BUDGET // 4} tokens "
          f"{peak_quarter / MIB:.0f} MiB; allocator capped at {(cap - reserved) / MIB:.0f} MiB above the "
          f"{reserved / MIB:.0f} MiB reserved; {engine.num_oom_retries} OOM retries, token budget now "
          f"{llm.scheduler.token_budget}, {llm.scheduler.num_preemptions} preemptions; async scheduling "
          f"{engine.async_scheduling}; on {torch.cuda.get_device_name(0)}")
    assert engine.num_oom_retries >= 1 and engine.num_failed_steps == engine.num_oom_retries
    assert all(o.finish_reason == "length" for o in got)
    assert [o.token_ids for o in got] == [w[0] for w in want]
    for o, (_, lps) in zip(got, want):
        assert [lp.logprob for lp in o.outputs[0].logprobs] == pytest.approx(lps, abs=1e-3)
    _assert_pool_free(llm)
    assert torch.cuda.memory_allocated() <= allocated_before + 16 * MIB  # what the failed steps allocated is free
