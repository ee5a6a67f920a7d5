"""The models on a CUDA device (reference ops, or kernels where registered) against transformers on
the same device, through `dayzero verify`. Skipped where no CUDA device exists."""

import pytest
import torch

from dayzero.verify import verify_checkpoint
from tests.models.deepseek_checkpoints import build_deepseek_v3_checkpoint, build_deepseek_v32_checkpoint
from tests.models.deepseek_v4_checkpoints import build_deepseek_v4_checkpoint
from tests.models.glm4_moe_checkpoints import build_glm4_moe_checkpoint
from tests.models.gpt_oss_checkpoints import build_gpt_oss_checkpoint
from tests.models.kimi_linear_checkpoints import build_kimi_linear_checkpoint
from tests.models.qwen3_5_moe_checkpoints import build_qwen3_5_moe_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = {  # family: (builder, prompt length past its windows / top-k / chunk size)
    "deepseek_v3": (build_deepseek_v3_checkpoint, 40),
    "deepseek_v32": (build_deepseek_v32_checkpoint, 40),
    "deepseek_v4": (build_deepseek_v4_checkpoint, 300),
    "gpt_oss": (build_gpt_oss_checkpoint, 40),
    "kimi_linear": (build_kimi_linear_checkpoint, 150),
    "glm4_moe": (build_glm4_moe_checkpoint, 40),
    "qwen3_5_moe": (build_qwen3_5_moe_checkpoint, 150),  # past two Gated DeltaNet chunks
}


# transformers keeps FP8 weights quantized on a GPU and then needs the `kernels` package, which fetches
# its kernels from the Hub: offline it cannot run the FP8 checkpoints there (on CPU it dequantizes).
FP8_FAMILIES = ("deepseek_v3", "deepseek_v32", "deepseek_v4")


@pytest.mark.parametrize("family", sorted(set(CASES) - set(FP8_FAMILIES)))
def test_verify_on_cuda_float32(family, tmp_path):
    builder, prompt_len = CASES[family]
    result = verify_checkpoint(builder(tmp_path), prompt_len=prompt_len, decode_steps=8, device="cuda")
    assert result.passed, result.first_divergence


@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_fp8_models_on_cuda_equal_the_cpu_run(family, tmp_path):
    """The CPU run of these checkpoints is verified against transformers by the CPU tests; on CUDA the
    same model (reference ops in float32) must compute the same logits, prefill and decode."""
    from dayzero.models import load_model
    from dayzero.spec import load_spec
    from dayzero.verify import rel_err

    builder, prompt_len = CASES[family]
    path = builder(tmp_path)
    ids = torch.randint(0, load_spec(path).vocab_size, (1, prompt_len + 2))
    outs = {}
    for device in ("cpu", "cuda"):
        model = load_model(path, dtype=torch.float32, device=device, progress=False)
        cache = model.new_cache(1)
        x = ids.to(device)
        with torch.no_grad():
            prefill = model(x[:, :prompt_len], torch.arange(prompt_len, device=device)[None], cache)
            steps = [model(x[:, p:p + 1], torch.tensor([[p]], device=device), cache) for p in (prompt_len, prompt_len + 1)]
        outs[device] = torch.cat([prefill] + steps, dim=1).cpu()
    assert rel_err(outs["cuda"], outs["cpu"]) < 1e-4


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v4"])
def test_models_use_the_mxfp4_kernel_in_bfloat16(family, tmp_path):
    """In bfloat16 on CUDA the registry picks the Triton routed-expert kernel; the model's logits stay
    within bf16 noise of the same model forced onto the reference ops. bf16 rounding differences
    flip a few tokens' expert choice in a random tiny model (transformers' own bf16 run does the
    same against float32), so the bound is on the median position and on argmax agreement."""
    from dayzero.models import load_model
    from dayzero.ops import REGISTRY
    from dayzero.verify import rel_err

    builder, prompt_len = CASES[family]
    model = load_model(builder(tmp_path), dtype=torch.bfloat16, device="cuda", progress=False)
    ids = torch.randint(0, model.spec.vocab_size, (1, prompt_len), device="cuda")
    positions = torch.arange(prompt_len, device="cuda")[None]
    with torch.no_grad():
        with REGISTRY.record_calls(by_backend=True) as calls:
            fast = model(ids, positions)
        with REGISTRY.force_backend("reference"):
            reference = model(ids, positions)
    assert calls.get("moe_experts_mxfp4@triton"), calls
    per_position = [rel_err(a, b) for a, b in zip(fast[0], reference[0])]
    assert sorted(per_position)[len(per_position) // 2] < 5e-2, per_position
    agree = (fast[0].argmax(-1) == reference[0].argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree


def test_kimi_k25_with_images_on_cuda(tmp_path):
    """dayzero verify --image on the GPU against transformers there: float32 (the encoder's attention as
    SDPA per image) and bfloat16 (torch's varlen FlashAttention kernel, one launch for the images)."""
    from dayzero.ops import REGISTRY
    from tests.models.kimi_k25_checkpoints import build_kimi_k25_checkpoint, random_image

    path = build_kimi_k25_checkpoint(tmp_path)
    files = []
    for i, size in enumerate([(56, 42), (150, 100)]):
        files.append(tmp_path / f"{i}.png")
        random_image(*size, seed=i).save(files[-1])
    result = verify_checkpoint(path, prompt_len=16, decode_steps=4, device="cuda", images=files)
    assert result.passed, result.first_divergence
    with REGISTRY.record_calls(by_backend=True) as calls:
        result = verify_checkpoint(path, prompt_len=16, decode_steps=4, device="cuda", dtype="bfloat16", images=files)
    assert calls.get("varlen_attention@torch", 0) > 0
    assert result.max_rel_err < 5e-2


def test_kimi_k25_engine_on_cuda_equals_the_cpu(tmp_path):
    """The engine on the GPU (async scheduling, the encoder step) gives the CPU engine's greedy tokens for
    prompts with images, float32 (MLA has no float32 kernel: its decode runs eagerly); in bf16 the decode
    steps after the image prompts replay CUDA graphs."""
    from dayzero import LLM, SamplingParams
    from tests.models.kimi_k25_checkpoints import IMAGE_PLACEHOLDER, build_kimi_k25_checkpoint, random_image

    path = build_kimi_k25_checkpoint(tmp_path)
    prompts = [{"prompt": f"a {IMAGE_PLACEHOLDER} b", "multi_modal_data": {"image": random_image(56, 42, seed=1)}},
               {"prompt": f"{IMAGE_PLACEHOLDER} c {IMAGE_PLACEHOLDER}",
                "multi_modal_data": {"image": [random_image(150, 100, seed=2), random_image(28, 28, seed=3)]}},
               "no image"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for device in ("cpu", "cuda"):
        llm = LLM(path, device=device)
        tokens[device] = [o.token_ids for o in llm.generate(prompts, params)]
        if device == "cuda":
            assert llm.engine.async_scheduling
    assert tokens["cuda"] == tokens["cpu"]
    llm = LLM(path, device="cuda", dtype="bfloat16")
    outs = llm.generate(prompts, params)
    assert llm.runner.num_graph_steps > 0 and all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert llm.engine.feature_cache.num_encoded == 3
