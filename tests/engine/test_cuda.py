"""The engine on a CUDA device: paged cache, batched decode and prefix reuse give the CPU engine's
greedy tokens (float32); bf16 runs through the Triton kernels. Skipped where no CUDA device exists."""

import pytest
import torch

from dayzero.engine import SamplingParams
from dayzero.engine.llm import LLM
from tests.engine.test_llm import FAMILIES, _assert_pool_free, _prompts
from tests.models.kimi_k3_checkpoints import build_kimi_k3_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


# every family, Kimi K3 too (KDA chunk 64, as Kimi Linear's lengths)
WITH_K3 = {**FAMILIES, "kimi_k3": (build_kimi_k3_checkpoint, FAMILIES["kimi_linear"][1])}


@pytest.mark.parametrize("name", sorted(WITH_K3))
def test_engine_on_cuda_gives_the_cpu_engines_tokens(name, tmp_path):
    """Prompts past each family's thresholds (index_topk, windows, compression ratios, the KDA chunk), then a
    second turn reusing the cached prefix (and the saved KDA / compressor state)."""
    builder, lengths = WITH_K3[name]
    path = builder(tmp_path)
    cpu, gpu = LLM(path, dtype="float32"), LLM(path, dtype="float32", device="cuda")
    prompts = _prompts(cpu.vocab_size, lengths[::2])
    assert [o.token_ids for o in gpu.generate(prompts, GREEDY)] == [o.token_ids for o in cpu.generate(prompts, GREEDY)]
    second = prompts[-1] + [1, 2, 3]  # a turn that extends the longest prompt: reused from the cache
    cached = gpu.scheduler.num_prefix_cached_tokens
    assert gpu.generate([second], GREEDY)[0].token_ids == cpu.generate([second], GREEDY)[0].token_ids
    assert gpu.scheduler.num_prefix_cached_tokens > cached
    _assert_pool_free(gpu)


EXPECTED_KERNELS = {"deepseek_v32": {"paged_index_topk@triton", "paged_sparse_mla_attention@triton",
                                     "linear_fp8_block@triton"},
                    "deepseek_v4": {"linear_fp8_block@triton", "hyper_connection@triton", "hyper_connection_post@triton", "kv_compressor@triton",
                                    "paged_v4_attention@triton", "paged_v4_index_topk@triton"}}  # gathered ops: probe only


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v4", "kimi_linear", "deepseek_v32"])
def test_bf16_engine_on_cuda_uses_the_kernels(name, tmp_path):
    from dayzero.ops import REGISTRY

    builder, lengths = FAMILIES[name]
    llm = LLM(builder(tmp_path), dtype="bfloat16", device="cuda", kv_cache_dtype="fp8_e4m3")
    with REGISTRY.record_calls(by_backend=True) as calls:
        outs = llm.generate(_prompts(llm.vocab_size, lengths), GREEDY)
    assert all(len(o.token_ids) == 6 for o in outs)
    assert any(k.endswith("@triton") for k in calls), calls
    assert EXPECTED_KERNELS.get(name, set()) <= set(calls), calls
    _assert_pool_free(llm)


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v32"])
def test_a_decode_step_never_synchronizes_the_host(name, tmp_path):
    """The runner's packed decode step (metadata transfer, forward, logits) under
    torch.cuda.set_sync_debug_mode("error"): any .item(), .tolist(), bool(tensor) or blocking copy
    raises. The sampled ids' one device-to-host copy happens after, in the engine."""
    builder, _ = FAMILIES[name]
    llm = LLM(builder(tmp_path), dtype="bfloat16", device="cuda", async_scheduling=False)  # no pending inputs
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(_prompts(llm.vocab_size, [5, 20, 40])):
        engine.add_request(f"r{i}", *engine.validate(p, params))
    for _ in range(3):  # prefills, then decodes (kernels compiled, graphs captured)
        engine.step()
    out = engine.scheduler.schedule()
    assert all(s.num_new_tokens == 1 for s in out.scheduled)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rids, logits = engine.runner.execute(out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(rids) == 3 and logits.shape[0] == 3 and torch.isfinite(logits).all()
