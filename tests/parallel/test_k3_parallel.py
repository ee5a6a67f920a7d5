"""Kimi K3 split over processes on the CPU (gloo): a tiny random K3 (seeded random dims; KDA and gated MLA,
latent MoE with MXFP4 experts, attention residuals) at tp 2 and at ep 2 gives the unsplit model's prefill and
decode logits, in the release layout and transformers' save; each rank holds half of the attention (tp) or
of the routed experts (ep); through the LLM API at tp 2 x ep 2 one process's greedy tokens and logprobs."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import tests.parallel.test_tensor_parallel as tensor_parallel
from dayzero.models import load_model
from dayzero.parallel import state
from tests.models.kimi_k3_checkpoints import build_kimi_k3_checkpoint
from tests.parallel.test_tensor_parallel import _logits, _prompt, _run_split


def _k3(tmp_path, seed: int, **fixed):
    """A tiny K3 whose dims are drawn from `seed`: every split dimension even (tp 2), the experts' widths whole
    MXFP4 blocks of 32, the experts a multiple of 2 (ep 2)."""
    g = torch.Generator().manual_seed(seed)

    def pick(*choices):
        return choices[int(torch.randint(len(choices), (1,), generator=g))]

    kda_dim = pick(16, 32)
    dims = dict(hidden_size=pick(64, 96), intermediate_size=pick(64, 96), num_hidden_layers=pick(4, 5),
                num_attention_heads=pick(2, 4), q_lora_rank=pick(None, 32), kv_lora_rank=pick(16, 32),
                qk_nope_head_dim=pick(8, 16), qk_rope_head_dim=pick(4, 8), v_head_dim=pick(8, 16),
                num_experts=pick(4, 8), num_shared_experts=pick(1, 2), moe_intermediate_size=pick(32, 64),
                routed_expert_hidden_size=pick(32, 64), attn_res_block_size=pick(1, 2, 3),
                linear_attn_config=dict(num_heads=pick(2, 4), head_dim=kda_dim))
    dims["num_key_value_heads"] = dims["num_attention_heads"]
    dims.update(fixed)
    return build_kimi_k3_checkpoint(tmp_path / "release", seed=seed, **dims)


def _transformers_save(release):
    """The release checkpoint as transformers' kimi_linear saves it: the dense MLP under `block_sparse_moe.`."""
    out = release.parent / "transformers"
    out.mkdir()
    shutil.copy(release / "config.json", out / "config.json")
    state_dict = {re.sub(r"\.mlp\.(gate|up|down)_proj\.", r".block_sparse_moe.\1_proj.", k): v
                  for k, v in load_file(release / "model.safetensors").items()}
    save_file(state_dict, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _expert_parallel_rank(rank, size, port, path, prompt, results) -> None:
    """test_tensor_parallel's rank, its `size` processes joined as expert-parallel ranks (tp 1, ep size)."""
    import dayzero.parallel as parallel

    join = parallel.init_process
    parallel.init_process = lambda tp, ep, *rest: join(ep, tp, *rest)
    tensor_parallel._rank(rank, size, port, path, prompt, results)


def _bytes(model, where: str = "") -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if where in n)


@pytest.mark.parametrize("layout,split,seed", [("release", "tp", 11), ("transformers", "tp", 12),
                                               ("release", "ep", 13)])
def test_k3_split_gives_the_unsplit_models_logits(tmp_path, monkeypatch, layout, split, seed):
    path = _k3(tmp_path, seed)
    if layout == "transformers":
        path = _transformers_save(path)
    if split == "ep":  # _run_split spawns its processes on `_rank`: here they join as expert-parallel ranks
        monkeypatch.setattr(tensor_parallel, "_rank", _expert_parallel_rank)
    prompt = _prompt(256, 9, seed)
    whole = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    want = _logits(whole, prompt)
    got = _run_split(path, prompt)
    errors = {(rank, step): ((g - w).norm() / w.norm()).item() for rank, (logits, _) in got.items()
              for step, (g, w) in enumerate(zip(logits, want, strict=True))}  # prefill, then each decode step
    assert max(errors.values()) < 1e-5, errors
    halved = _bytes(whole, "self_attn") if split == "tp" else _bytes(whole, ".experts.")
    for rank, (_, held) in got.items():  # tp: half of every attention projection (and the vocab); ep: of the experts
        assert held <= _bytes(whole) - halved // 2 + 1024, (rank, held)


def test_k3_split_through_the_llm_api_gives_one_processs_tokens_and_logprobs(tmp_path):
    from dayzero.engine.llm import LLM
    from dayzero.engine.sampling import SamplingParams

    path = _k3(tmp_path, 14, num_experts=8, num_attention_heads=4, num_key_value_heads=4)
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 21)]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    kwargs = dict(dtype="float32", max_num_batched_tokens=16, max_num_seqs=2)  # the 21-token prompt chunked

    def run(llm):
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]

    want_tokens, want_logprobs = run(LLM(path, **kwargs))
    split = LLM(path, tensor_parallel_size=2, expert_parallel_size=2, **kwargs)
    try:
        tokens, logprobs = run(split)
        assert split.workers is not None and split.workers.size == 4
        layers = split.model.model.layers
        assert layers[-1].block_sparse_moe.routed.experts.num == 4 and layers[-1].self_attn.heads == 2
    finally:
        split.close()
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_k3_heads_that_do_not_split_are_refused_naming_the_field_and_the_flag(tmp_path, monkeypatch):
    from dayzero.models.kimi_linear import KimiLinearForCausalLM

    KimiLinearForCausalLM.check_parallel("kimi_k3", 2, 2)  # K3 splits both ways
    path = build_kimi_k3_checkpoint(tmp_path, num_attention_heads=3, num_key_value_heads=3)
    monkeypatch.setattr(state, "_current", state.Parallel(tp_size=2))  # rank 0 of tp 2, building only
    with pytest.raises(ValueError, match=r"num_attention_heads = 3 does not split over tensor-parallel size 2; "
                                         r"choose a --tp that divides it"):
        load_model(path, device="cpu", dtype=torch.float32, progress=False)
