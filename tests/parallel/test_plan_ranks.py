"""The per-GPU memory plan (dayzero.split_plan, dayzero.rank_weights) against what the ranks allocate.

Every rank of a tiny model of each family, at tp 2, ep 2 and tp 2 x ep 2, is built in this process with its
`Parallel` (no process group: every collective is a no-op, as in a job of one), so that its parameters and
buffers and the cache layout it writes (checked_layout's probe forward) can be counted: exactly the planned
bytes, category by category, on every rank; dims drawn at random per seed. Then `dayzero inspect --layout`
on the full-size DeepSeek-V4 and Kimi K3 configs: self-consistent numbers, and no fewer GPUs fit.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from dayzero.cache.paged import checked_layout
from dayzero.cli import main
from dayzero.models import model_class, read_config
from dayzero.parallel import state
from dayzero.parallel.state import Parallel
from dayzero import settings
from dayzero.kernels import moe as moe_kernels
from dayzero.plan import GIB, memory_plan
from dayzero.rank_weights import CATEGORIES, rank_weights
from dayzero.spec import load_spec
from dayzero.split_plan import CAPACITY_CONTEXTS, rank_plan, splits
from dayzero.units import format_bytes, format_gib
from tests.models.deepseek_v4_checkpoints import tiny_v4_config
from tests.parallel.test_tensor_parallel import V3_TP_DIMS
from tests.spec.fullsize_configs import config as published
from tests.spec.tiny_configs import QUANT, make_config, save_config, tiny_k3_config

SPLITS = ((1, 1), (2, 1), (1, 2), (2, 2))
SEEDS = (0, 1, 2)


# -- tiny configs, dims drawn per seed (what the model files run; some splits then invalid); the seed picks
# the storage format: odd seeds bf16, even ones the quantized release format ------------------------


def _gpt_oss(rng: random.Random, seed: int, d: Path) -> Path:
    heads = rng.choice([2, 4, 8])
    cfg = make_config("gpt_oss", num_attention_heads=heads, num_key_value_heads=rng.choice([2, heads]),
                      head_dim=rng.choice([8, 16, 32]), hidden_size=rng.choice([32, 64, 96]),
                      intermediate_size=rng.choice([32, 64]), num_local_experts=3 if seed == 0 else rng.choice([2, 4, 6]),
                      vocab_size=2 * rng.randint(40, 150), num_hidden_layers=rng.randint(2, 4),
                      sliding_window=rng.choice([4, 8, 16]))
    return save_config(cfg, d, None if seed % 2 else QUANT["mxfp4"])


def _mla_dims(rng: random.Random) -> dict:
    return dict(num_attention_heads=rng.choice([2, 4, 6]), q_lora_rank=rng.choice([None, 16, 24]),
                kv_lora_rank=rng.choice([8, 16, 32]), qk_nope_head_dim=rng.choice([8, 16]),
                qk_rope_head_dim=rng.choice([4, 8]), v_head_dim=rng.choice([8, 16]), hidden_size=rng.choice([32, 64]),
                intermediate_size=rng.choice([48, 96]), moe_intermediate_size=rng.choice([32, 64]),
                n_routed_experts=rng.choice([4, 8]), vocab_size=2 * rng.randint(40, 150))


def _deepseek_v3(rng: random.Random, seed: int, d: Path) -> Path:
    if seed % 2:  # bf16
        dims = _mla_dims(rng)
        dims["num_key_value_heads"] = dims["num_attention_heads"]
        return save_config(make_config("deepseek_v3", **dims), d)
    # FP8 block-scaled: shares of 128-blocks at tp 2 with 4 heads (2 heads: o_proj's 64 columns are not)
    dims = dict(V3_TP_DIMS, num_attention_heads=2 if seed == 0 else 4, intermediate_size=rng.choice([256, 512]),
                q_lora_rank=rng.choice([None, 24]))
    dims["num_key_value_heads"] = dims["num_attention_heads"]
    return save_config(make_config("deepseek_v3", **dims), d, QUANT["fp8"])


def _deepseek_v32(rng: random.Random, seed: int, d: Path) -> Path:
    dims = dict(_mla_dims(rng), q_lora_rank=rng.choice([16, 24]), index_n_heads=rng.choice([1, 2, 4]),
                index_head_dim=rng.choice([8, 16]), index_topk=rng.choice([2, 4]))
    dims["num_key_value_heads"] = dims["num_attention_heads"]
    return save_config(make_config("deepseek_v32", **dims), d)


def _write(cfg: dict, d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _deepseek_v4(rng: random.Random, seed: int, d: Path) -> Path:
    heads = (2, 4, 8)[seed % 3]  # FP8 wq_b at tp 2: 2 heads of 64 leave a rank 64 rows, not a 128-block
    layers = rng.randint(3, 5)
    cfg = tiny_v4_config(num_attention_heads=heads, o_groups=rng.choice([g for g in (2, 4) if heads % g == 0]),
                         n_routed_experts=rng.choice([4, 8]), hc_mult=rng.choice([2, 4]), num_hidden_layers=layers,
                         num_hash_layers=rng.randint(0, 2), vocab_size=2 * rng.randint(40, 150),
                         compress_ratios=[rng.choice([0, 4, 128]) for _ in range(layers)])
    if seed % 2:  # an unquantized export
        del cfg["quantization_config"], cfg["expert_dtype"]
    return _write(cfg, d)


def _kimi_linear(rng: random.Random, seed: int, d: Path) -> Path:
    heads = rng.choice([2, 4])
    kda = {**make_config("kimi_linear").linear_attn_config, "num_heads": rng.choice([2, 3, 4]),
           "head_dim": rng.choice([8, 16])}
    cfg = make_config("kimi_linear", num_attention_heads=heads, num_key_value_heads=heads,
                      hidden_size=rng.choice([32, 64]), num_experts=rng.choice([4, 8]),
                      moe_intermediate_size=rng.choice([16, 32]), kv_lora_rank=rng.choice([8, 16]),
                      vocab_size=2 * rng.randint(40, 150), linear_attn_config=kda)
    return save_config(cfg, d)


def _kimi_k3(rng: random.Random, seed: int, d: Path) -> Path:
    cfg = tiny_k3_config()
    text = cfg["text_config"]
    heads = rng.choice([2, 4])
    text.update(num_attention_heads=heads, num_key_value_heads=heads, num_experts=rng.choice([4, 8]),
                moe_intermediate_size=rng.choice([32, 64]), routed_expert_hidden_size=rng.choice([32, 64]),
                vocab_size=2 * rng.randint(40, 150))
    text["linear_attn_config"] = {**text["linear_attn_config"], "num_heads": rng.choice([2, 4])}
    return _write(cfg, d)


FAMILIES = {"gpt_oss": _gpt_oss, "deepseek_v3": _deepseek_v3, "deepseek_v32": _deepseek_v32,
            "deepseek_v4": _deepseek_v4, "kimi_linear": _kimi_linear, "kimi_k3": _kimi_k3}


# -- a rank's model, counted ---------------------------------------------------------------------


def _build_rank(folder: Path, p: Parallel, monkeypatch):
    """The model rank p builds (bf16, CPU; weights drawn, not loaded), its derived tensors made (post_load)."""
    spec = load_spec(folder)
    monkeypatch.setattr(state, "_current", p)  # what init_process sets; the modules read it when built
    model = model_class(spec)(spec, read_config(folder), dtype=torch.bfloat16, device="cpu")
    g = torch.Generator().manual_seed(p.rank)
    for t in [*model.parameters(), *model.buffers()]:  # finite values for the probe forward; ids in range
        t.data.normal_(0, 0.02, generator=g) if t.dtype.is_floating_point and t.element_size() > 1 else t.data.zero_()
    model.post_load()
    return model


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    """These forwards are of a token through a tiny model: on 2 cores the thread pool's hand-offs cost 50x
    the arithmetic (0.5 s a probe forward, 6 ms on one thread); oneDNN's bf16 matmuls are set up per shape."""
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _category(name: str, persistent: bool) -> str:
    """rank_weights' category of a model tensor, from its name (dayzero/rank_weights.py's docstring)."""
    if not persistent:
        return "derived"
    if re.match(r"(model\.)?(embed_tokens|embed|lm_head|head)\.", name):
        return "vocabulary"
    if re.search(r"(^|\.)experts\.", name):
        return "experts"
    if re.search(r"\.(self_attn|attn)\.", name):
        return "attention"
    if re.search(r"\.(mlp|ffn|block_sparse_moe)\.", name) and not re.search(r"\.(gate|router)\.", name):
        return "mlp"
    return "other"


def _tensors(model) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (category, shape, bytes) of every parameter and buffer the model holds."""
    out = {}
    for prefix, module in model.named_modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            persistent = name not in module._non_persistent_buffers_set
            full = f"{prefix}.{name}" if prefix else name
            out[full] = (_category(full, persistent), tuple(t.shape), t.numel() * t.element_size())
    return out


def _by_category(tensors: dict, keep=lambda name: True) -> dict[str, int]:
    held = dict.fromkeys(CATEGORIES, 0)
    for name, (category, _, nbytes) in tensors.items():
        if keep(name):
            held[category] += nbytes
    return held


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_rank_holds_the_planned_weights_and_cache(tmp_path, monkeypatch, family, seed):
    folder = FAMILIES[family](random.Random(f"{family}-{seed}"), seed, tmp_path / family)
    spec = load_spec(folder)
    whole = _tensors(_build_rank(folder, Parallel(), monkeypatch))
    valid = 0
    for tp, ep in SPLITS:
        try:
            plan = rank_plan(spec, tp, ep)
            plan_fp8 = rank_plan(spec, tp, ep, kv_dtype="fp8")
        except ValueError as planned:  # the model refuses the same split, naming the same field (experts: the
            # same count and size; the plan names the family's own field, the model DeepSeek's)
            why = str(planned)
            field = why.split(" = ", 1)[1] if "expert-parallel" in why else re.match(r"(layer \d+: )?([\w.]+)", why)[2]
            with pytest.raises(ValueError, match=re.escape(field)):
                _build_rank(folder, Parallel(tp_size=tp, ep_size=ep), monkeypatch)
            continue
        valid += 1
        for rank in range(tp * ep):
            p = Parallel(tp_size=tp, tp_rank=rank % tp, ep_size=ep, ep_rank=rank // tp)
            model = _build_rank(folder, p, monkeypatch)
            tensors = _tensors(model)
            planned = rank_weights(spec, p)
            where = (family, seed, tp, ep, rank)
            assert _by_category(tensors) == {c: planned.bytes(c) for c in CATEGORIES}, where
            assert planned.total == plan.weights_gib_per_gpu * GIB
            if tp > 1 and ep > 1:  # what every rank holds whole: the unsplit model's tensor, the same shape
                same = lambda name: whole[name][1] == tensors[name][1]  # noqa: E731
                assert _by_category(tensors, same) == planned.whole, where
            layout = checked_layout(model)  # what the rank's engine allocates its pool from (block size 16)
            for kv, want in (("auto", plan), ("fp8_e4m3", plan_fp8)):
                got = layout.with_kv_cache_dtype(kv).sequence_bytes(16)
                assert got == (want.cache_bytes_per_token_per_gpu, want.cache_fixed_gib_per_gpu * GIB), (where, kv)
    assert valid >= 2, (family, seed)  # the job of one and at least one split


# -- dayzero inspect on full-size configs --------------------------------------------------------


def _inspect(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _row(section: str, label: str) -> str:
    """The line of a text table whose first column is `label`."""
    return next(line for line in section.splitlines() if line.strip().startswith(label + "  "))


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-pro", "kimi-k3"])
def test_inspect_layout_of_a_full_size_model_is_self_consistent_and_minimal(tmp_path, capsys, name):
    (tmp_path / "config.json").write_text(json.dumps(published(name)))
    rc, out, err = _inspect(capsys, str(tmp_path), "--layout", "--json")
    assert rc == 0, err
    layout = json.loads(out)["layout"]
    gpus, tp, ep, p = layout["gpus"], layout["tp"], layout["ep"], layout["plan"]
    context = layout["context"]
    assert context == 1048576 and gpus == tp * ep == p["gpus"] > 1 and p["context_fits"]
    spec = load_spec(tmp_path)
    model = rank_weights(spec, Parallel())  # the unsplit model
    # against the parameter counts (equal to transformers'): more only by the float32 tensors and the
    # load-time copies the counts leave out
    counted = memory_plan(spec).weights_gib * GIB
    assert counted < model.total < 1.005 * counted
    by_category = p["weights_by_category"]
    assert sum(c["gib"] for c in by_category.values()) == pytest.approx(p["weights_gib_per_gpu"], rel=1e-12)
    for category, c in by_category.items():  # each GPU: its share of what is split, all of what is not
        share = ep if category == "experts" else tp
        assert (c["gib"] - c["whole_gib"]) * share * GIB == pytest.approx(model.split[category], rel=1e-9), category
        assert c["whole_gib"] * GIB == pytest.approx(model.whole[category], rel=1e-9), category
    # over all GPUs: the model once, plus the copies of what is whole, of the experts on each tp rank and of
    # the tp-split parts in each expert-parallel group
    split_tp = sum(model.split[c] for c in CATEGORIES if c != "experts")
    copies = (gpus - 1) * sum(model.whole.values()) + (tp - 1) * model.split["experts"] + (ep - 1) * split_tp
    assert p["weights_gib_per_gpu"] * gpus * GIB == pytest.approx(model.total + copies, rel=1e-9)
    assert p["weights_gib_per_gpu"] * gpus * GIB >= model.total
    free = p["free_for_cache_gib_per_gpu"] * GIB
    per_token, fixed = p["cache_bytes_per_token_per_gpu"], p["cache_fixed_gib_per_gpu"] * GIB
    assert free == pytest.approx((p["gpu_mem_gib"] - p["weights_gib_per_gpu"] - p["expert_workspace_gib_per_gpu"]
                                  - p["activation_reserve_gib_per_gpu"]) * GIB)
    assert p["max_context_tokens"] == int((free - fixed) // per_token) >= context
    for tokens in CAPACITY_CONTEXTS:  # sequences of that length held at once
        n = p["sequences_at_context"][str(tokens)]
        assert n >= 1 and n * (tokens * per_token + fixed) <= free < (n + 1) * (tokens * per_token + fixed)
    # the FP8 workspace: the slots of the GPU's E / ep experts one step of 8192 tokens can activate, each
    # expert w13 [2I, K] and w2 [K, I] in e4m3 with a float32 scale per row per 128 of K; what the engine's
    # rank makes where the kernels convert (path B: CUDA other than sm_90)
    experts = spec.experts
    inter, k = experts.intermediate_size, experts.input_dim
    slot = 3 * inter * k + 4 * (2 * inter * -(-k // 128) + k * -(-inter // 128))
    workspace = min(experts.num // ep, experts.top_k * 8192) * slot
    path_b = moe_kernels.Device("cuda", (10, 0))
    assert p["expert_workspace_gib_per_gpu"] * GIB == workspace == moe_kernels.workspace_bytes(
        experts.format, experts.num // ep, experts.top_k, k, inter, 8192, path_b, settings.get())
    if experts.num % (2 * ep) == 0:  # twice the GPUs, the experts twice as thin: less per GPU, a longer context
        more = rank_plan(spec, tp, 2 * ep, context=context)
        assert more.weights_gib_per_gpu < p["weights_gib_per_gpu"] and more.max_context_tokens > p["max_context_tokens"]
    for other in layout["alternatives"]:  # the chosen split of these GPUs: the longest context
        assert other["max_context_tokens"] <= p["max_context_tokens"]
    for fewer in range(1, gpus):  # no split of fewer GPUs holds the context
        for t, e in splits(fewer):
            try:
                assert not rank_plan(spec, t, e, context=context).context_fits, (fewer, t, e)
            except ValueError:
                pass

    rc, text, err = _inspect(capsys, str(tmp_path), "--layout")
    assert rc == 0, err
    section = text[text.index("Layout:"):]
    assert f"{gpus} GPUs ({-(-gpus // 8)} node(s) of 8), tp {tp} x ep {ep}" in section
    assert format_gib(p["weights_gib_per_gpu"]) in _row(section, "weights")
    assert f"{experts.num // ep} of {experts.num} routed experts" in _row(section, "experts")
    assert format_gib(workspace / GIB) in _row(section, "expert workspace")
    assert format_gib(free / GIB) in _row(section, "free for cache")
    assert format_bytes(per_token) in _row(section, "cache per token")
    assert f"{p['max_context_tokens']:,} tokens" in _row(section, "longest context")
    for tokens in CAPACITY_CONTEXTS:
        assert f"{p['sequences_at_context'][str(tokens)]:,} sequence(s)" in _row(section, f"KV capacity at {tokens:,}")
    assert "fits" in _row(section, f"context {context:,}")


def test_inspect_a_split_chosen_given_or_invalid(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(published("kimi-k3")))
    rc, out, err = _inspect(capsys, str(tmp_path), "--gpus", "64", "--json")
    assert rc == 0, err
    split = json.loads(out)["split"]
    assert split["chosen"] and (split["plan"]["tp"], split["plan"]["ep"]) == (2, 32)
    assert "tp 64 x ep 1" in split["invalid"]  # 96 KDA heads over 64
    named = [f"tp {o['tp']} x ep {o['ep']}" for o in split["others"]]  # every split of 64: chosen, other or invalid
    assert sorted(["tp 2 x ep 32", *named, *split["invalid"]]) == sorted(f"tp {t} x ep {e}" for t, e in splits(64))
    assert all(o["max_context_tokens"] <= split["plan"]["max_context_tokens"] for o in split["others"])
    rc, text, _ = _inspect(capsys, str(tmp_path), "--gpus", "64")
    listed = text[text.index("other valid splits of 64 GPUs"):]
    assert rc == 0 and "(the valid split with the longest context)" in text and all(n in listed for n in named)
    rc, out, err = _inspect(capsys, str(tmp_path), "--gpus", "64", "--tp", "4", "--json")  # ep = 64 / 4
    assert rc == 0, err
    split = json.loads(out)["split"]
    assert not split["chosen"] and (split["plan"]["tp"], split["plan"]["ep"]) == (4, 16)
    rc, out, _ = _inspect(capsys, str(tmp_path), "--tp", "4", "--ep", "16")
    assert rc == 0 and "Memory plan per GPU: tp 4 x ep 16 on 64 GPUs" in out
    rc, _, err = _inspect(capsys, str(tmp_path), "--tp", "64")
    assert rc == 2 and "linear_attn_config.num_heads = 96 does not split over tensor-parallel size 64" in err
    rc, _, err = _inspect(capsys, str(tmp_path), "--gpus", "8", "--tp", "2", "--ep", "2")
    assert rc == 2 and "--gpus 8 is not --tp 2 x --ep 2 = 4 GPUs" in err
    rc, _, err = _inspect(capsys, str(tmp_path), "--gpus", "8", "--ep", "3")
    assert rc == 2 and "--gpus 8 is not a multiple of --ep 3" in err
    rc, _, err = _inspect(capsys, str(tmp_path), "--ep", "3")  # K3's own field, not DeepSeek's n_routed_experts
    assert rc == 2 and "num_experts = 896 does not split over expert-parallel size 3; choose a --ep" in err
    assert "Traceback" not in err
