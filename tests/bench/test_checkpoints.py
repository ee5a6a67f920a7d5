"""bench/checkpoints.py: the DeepSeek-V4-Flash shape is the published one in the release layout, its
default layer count is the most that fits FIT_FRACTION of an H200, and what the script writes (here at
shrunken dimensions: one real layer is 3.3 GiB) is a checkpoint dayzero loads, byte for byte as planned."""

import json
import math

import pytest
import torch
from safetensors import safe_open

from bench import checkpoints as ck
from dayzero.inspect import build_report
from dayzero.models import load_model
from dayzero.plan import weight_bytes
from dayzero.spec import load_spec
from tests.demo.test_checkpoint import expected_layout
from tests.spec.fullsize_configs import config as published

# DeepSeek-V4-Flash's structure at test size: every dimension <= 128 or a multiple of 128 (FP8 blocks)
# and a multiple of 32 (FP4 blocks)
SMALL_V4 = dict(vocab_size=256, hidden_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
                q_lora_rank=128, o_groups=2, o_lora_rank=128, index_n_heads=4, index_head_dim=32, index_topk=4,
                n_routed_experts=8, moe_intermediate_size=64, num_experts_per_tok=2, sliding_window=16)
SMALL_GPT_OSS = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
SMALL_V32 = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                 qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                 index_n_heads=4, index_head_dim=32, index_topk=8, first_k_dense_replace=1,
                 max_position_embeddings=256)
CODE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "I64": 8}


def test_the_flash_config_is_the_published_one():
    ours, theirs = ck.DEEPSEEK_V4_FLASH, published("deepseek-v4-flash")
    for field, value in theirs.items():
        if field == "compress_ratios":  # the published list ends with the MTP layer's entry
            assert ours[field] == value[:ours["num_hidden_layers"]]
        elif field != "num_nextn_predict_layers":  # the benchmark checkpoint ships no MTP layer
            assert ours[field] == value, field
    from transformers import DeepseekV4Config

    defaults = DeepseekV4Config()  # its defaults are V4-Flash's (checkpoint deepseek-ai/DeepSeek-V4-Flash-Base)
    for field in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads", "head_dim",
                  "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "o_groups", "o_lora_rank",
                  "index_n_heads", "index_head_dim", "index_topk", "sliding_window", "hc_mult", "swiglu_limit"):
        assert ours[field] == getattr(defaults, field), field
    assert ours["num_hidden_layers"] == defaults.num_hidden_layers == 43


@pytest.mark.parametrize("layers", [1, 4, 26])
def test_the_plan_is_the_release_layout(layers):
    config = ck.config_for("deepseek-v4-flash", layers)
    plan = ck.deepseek_v4_plan(config)
    layout = expected_layout(config)  # the demo checkpoint test's own table of the release layout
    assert {t.name: (ck.CODES[t.dtype], t.shape) for t in plan} == layout
    per_layer = ck.layer_bytes(plan, "layers.")
    for i, size in enumerate(per_layer):
        want = sum(CODE_BYTES[code] * math.prod(shape) for name, (code, shape) in layout.items()
                   if name.startswith(f"layers.{i}."))
        assert size == want, i
    experts = 256 * 3 * 2048 * 4096 * (1 / 2 + 1 / 32)  # FP4 values and one scale byte per 32
    assert all(experts < size < experts + 0.2 * 2**30 for size in per_layer)


def test_the_default_layer_count_is_the_most_that_fits():
    budget = ck.FIT_FRACTION * ck.H200_BYTES

    def total(layers):
        return sum(t.nbytes for t in ck.deepseek_v4_plan(ck.config_for("deepseek-v4-flash", layers)))

    n = ck.fit_layers()
    assert ck.config_for("deepseek-v4-flash")["num_hidden_layers"] == n
    assert total(n) <= budget < total(n + 1)
    assert 24 <= n <= 28  # 3.3 GiB a layer within 65% of 139 GiB


def test_the_v32_config_is_the_published_one_and_its_plan_the_release_layout(tmp_path):
    """The published config (no MTP layer); the plan at test size names, types and shapes every tensor as
    the model tests' real-layout V3.2 checkpoint does (tests/models/deepseek_checkpoints.py)."""
    from dayzero.weights import Checkpoint
    from tests.models.deepseek_checkpoints import build_deepseek_v32_checkpoint

    ours, theirs = ck.config_for("deepseek-v3.2"), published("deepseek-v3.2")
    assert {k: v for k, v in ours.items() if k not in theirs} == {"torch_dtype": "bfloat16", "eos_token_id": 1,
                                                                 "bos_token_id": 0}
    assert {k for k in theirs if ours[k] != theirs[k]} == {"num_hidden_layers", "num_nextn_predict_layers"}
    assert ours["num_hidden_layers"] == ck.V32_LAYERS and ours["num_nextn_predict_layers"] == 0
    tiny = build_deepseek_v32_checkpoint(tmp_path, mtp=False)
    dims = {k: v for k, v in json.loads((tiny / "config.json").read_text()).items() if isinstance(v, int)}
    plan = ck.deepseek_v32_plan(ck.config_for("deepseek-v3.2", dims["num_hidden_layers"], **dims))
    release = Checkpoint.open(tiny).tensors
    assert {t.name: (ck.CODES[t.dtype], t.shape) for t in plan} == {
        name: (t.dtype, tuple(t.torch_shape)) for name, t in release.items()}
    per_layer = ck.layer_bytes(ck.deepseek_v32_plan(ours), "model.layers.")
    experts = 257 * 3 * 2048 * 7168  # FP8: a byte a value (256 routed + 1 shared), 128 x 128 scales aside
    assert experts < per_layer[3] < experts + 0.2 * 2**30 and all(size < 0.6 * 2**30 for size in per_layer[:3])


@pytest.mark.parametrize("kind,layers", [("deepseek-v4-flash", None), ("deepseek-v4-flash", 43), ("gpt-oss-20b", None),
                                         ("deepseek-v3.2", None), ("deepseek-v3.2", 61), ("kimi-k2.5", None)])
def test_the_config_reads_through_spec_and_inspect(tmp_path, kind, layers):
    config = ck.config_for(kind, layers)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = load_spec(tmp_path)
    assert len(spec.layers) == (config.get("text_config") or config)["num_hidden_layers"]
    planned = sum(t.nbytes for t in ck.KINDS[kind](config))
    estimate = weight_bytes(spec)
    assert sum(estimate.values()) == pytest.approx(planned, rel=0.01)  # dayzero.plan's count from the config
    if kind == "deepseek-v4-flash":
        assert spec.experts.format == "mxfp4" and spec.experts.num == 256 and spec.hidden_size == 4096
        experts = sum(t.nbytes for t in ck.KINDS[kind](config) if ".experts." in t.name and "shared" not in t.name)
        assert estimate["mxfp4"] == experts
        kinds = {layer.attention.kind for layer in spec.layers}
        assert len(kinds) == 3 if config["num_hidden_layers"] > 3 else 2  # sliding, CSA, HCA
    report = build_report(tmp_path)
    assert report["memory"]["weights_gib"] == pytest.approx(planned / 2**30, rel=0.01)


@pytest.mark.parametrize("kind,small,layers", [("deepseek-v4-flash", SMALL_V4, 4), ("gpt-oss-20b", SMALL_GPT_OSS, 2),
                                               ("deepseek-v3.2", SMALL_V32, 3)])
def test_a_written_checkpoint_is_the_plan_and_loads(tmp_path, monkeypatch, kind, small, layers):
    monkeypatch.setattr(ck, "SHARD_BYTES", 64 << 10)  # several shards even at this size
    path = ck.write_checkpoint(kind, tmp_path, "cpu", layers, **small)
    config = json.loads((path / "config.json").read_text())
    plan = ck.KINDS[kind](config)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == {t.name for t in plan}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in plan)
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) == len(set(index["weight_map"].values())) > 1
    data = 0
    for shard in shards:
        with safe_open(shard, "pt") as f:  # the safetensors library reads what the script wrote
            for name in f.keys():
                t = f.get_tensor(name)
                planned = next(p for p in plan if p.name == name)
                assert (t.dtype, tuple(t.shape)) == (planned.dtype, planned.shape)
                assert index["weight_map"][name] == shard.name
                data += t.numel() * t.element_size()
        header = int.from_bytes(shard.read_bytes()[:8], "little")
        assert shard.stat().st_size == 8 + header + sum(p.nbytes for p in plan if index["weight_map"][p.name] == shard.name)
    assert data == sum(t.nbytes for t in plan)

    model = load_model(path, dtype=torch.float32, progress=False)
    ids = torch.randint(0, config["vocab_size"], (1, 8))
    with torch.no_grad():
        logits = model(ids, torch.arange(8)[None])
    assert logits.shape == (1, 8, config["vocab_size"]) and torch.isfinite(logits).all()
    assert logits.std() > 0.1  # random weights at realistic scales: not vanishing


def test_layers_outside_the_schedule_are_refused():
    with pytest.raises(SystemExit, match=r"--layers must be in \[1, 43\]"):
        ck.config_for("deepseek-v4-flash", 44)
    with pytest.raises(SystemExit, match=r"--layers must be in \[1, 61\]"):
        ck.config_for("deepseek-v3.2", 62)


def test_the_kimi_k25_checkpoint_reads_images(tmp_path):
    """MoonViT at test size over a two-layer K2 text model: it loads, and an image's features and the logits
    after it are finite and not vanishing."""
    from dayzero.multimodal.processor import ImageProcessor
    from tests.models.kimi_k25_checkpoints import random_image

    big = ck.kimi_k25_config()
    text = {k: v for k, v in SMALL_V32.items() if not k.startswith("index_")}
    small = {"text_config": {**big["text_config"], **text, "n_group": 1, "topk_group": 1},
             "vision_config": {**big["vision_config"], "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2,
                               "intermediate_size": 64, "pos_emb_height": 8, "pos_emb_width": 8},
             "projection_hidden_size": 32, "image_token_id": 255}
    path = ck.write_checkpoint("kimi-k2.5", tmp_path, "cpu", None, **small)
    model = load_model(path, dtype=torch.float32, progress=False)
    image = ImageProcessor.from_checkpoint(path, model.spec.vision).preprocess(random_image(56, 84))
    with torch.no_grad():
        features = torch.cat(model.encode_images(image.pixels, (image.grid,)))
        ids = torch.tensor([[1, 2] + [255] * image.num_tokens + [3]])
        logits = model(ids, torch.arange(ids.shape[1])[None], image_features=features)
    assert features.shape == (6, 128) and torch.isfinite(logits).all() and features.std() > 0.1 and logits.std() > 0.1
