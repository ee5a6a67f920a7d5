"""`dayzero inspect` lists, per model, the ops it needs; check that against the ops each model
actually calls (recorded by the registry) on a prompt long enough to reach every path."""

import pytest
import torch

from dayzero.models import load_model
from dayzero.ops import REGISTRY
from dayzero.ops import requirements as req
from dayzero.ops.requirements import model_ops
from tests.models.deepseek_checkpoints import build_deepseek_v3_checkpoint, build_deepseek_v32_checkpoint
from tests.models.deepseek_v4_checkpoints import build_deepseek_v4_checkpoint
from tests.models.glm4_moe_checkpoints import build_glm4_moe_checkpoint
from tests.models.gpt_oss_checkpoints import build_gpt_oss_checkpoint
from tests.models.kimi_k25_checkpoints import build_kimi_k25_checkpoint, random_image
from tests.models.kimi_linear_checkpoints import build_kimi_linear_checkpoint
from tests.models.qwen3_5_moe_checkpoints import build_qwen3_5_moe_checkpoint

BUILDERS = {
    "deepseek_v3": build_deepseek_v3_checkpoint,
    "deepseek_v32": build_deepseek_v32_checkpoint,
    "deepseek_v4": build_deepseek_v4_checkpoint,
    "gpt_oss": build_gpt_oss_checkpoint,
    "kimi_linear": build_kimi_linear_checkpoint,
    "glm4_moe": build_glm4_moe_checkpoint,
    # the text tower alone: a qwen3_5_moe checkpoint also declares its (not yet built) vision encoder
    "qwen3_5_moe": lambda d: build_qwen3_5_moe_checkpoint(d, model_type="qwen3_5_moe_text"),
    "kimi_k25": build_kimi_k25_checkpoint,
}
# activations applied inside the routed-experts op (a kernel fuses them) are declared but not called directly
FUSED_INTO_EXPERTS = {req.SWIGLU, req.SWIGLU_CLAMPED}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_every_op_a_model_calls_is_declared(family, tmp_path):
    path = BUILDERS[family](tmp_path)
    model = load_model(path, dtype=torch.float32, progress=False)
    long_len = 300 if family == "deepseek_v4" else 48  # past the DSA top-k, windows, compression ratios
    with REGISTRY.record_calls() as calls, torch.no_grad():
        for prompt_len in (4, long_len):  # short prompts take the dense paths (DSA below index_topk)
            ids = torch.randint(0, model.spec.vocab_size, (1, prompt_len))
            cache = model.new_cache(1)
            model(ids, torch.arange(prompt_len)[None], cache)
            model(ids[:, :1], torch.tensor([[prompt_len]]), cache)
        if hasattr(model, "encode_images"):  # the vision tower: an image, prefilled at its placeholders
            from dayzero.multimodal.processor import ImageProcessor

            image = ImageProcessor.from_checkpoint(path, model.spec.vision).preprocess(random_image(28, 56))
            features = torch.cat(model.encode_images(image.pixels, (image.grid,)))
            ids = torch.full((1, image.num_tokens), model.image_token_id)
            model(ids, torch.arange(image.num_tokens)[None], model.new_cache(1), image_features=features)
    declared = set(model_ops(model.spec))
    assert set(calls) <= declared, f"called but not declared: {sorted(set(calls) - declared)}"
    assert declared - set(calls) <= FUSED_INTO_EXPERTS, f"declared but never called: {sorted(declared - set(calls) - FUSED_INTO_EXPERTS)}"
