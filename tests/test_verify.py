"""`dayzero verify` on real-layout tiny checkpoints: passes when dayzero is right, fails loudly
(non-zero exit, the first diverging step named) when dayzero's side computes something wrong, and
checks its oracle: transformers' cached generate against its full forward, the inconsistency
reported at its step and dayzero judged against the full forward."""

import json

import pytest
import torch

import dayzero.verify as verify_mod
from dayzero.cli import main
from tests.models.gpt_oss_checkpoints import build_gpt_oss_checkpoint


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return build_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss"))


def _verify(capsys, path, *extra):
    rc = main(["verify", str(path), "--json", "--prompt-len", "12", "--decode-steps", "3", *extra])
    out, err = capsys.readouterr()
    return rc, json.loads(out), err


def test_verify_passes_and_reports_the_contract_keys(gpt_oss_dir, capsys):
    rc, result, err = _verify(capsys, gpt_oss_dir)
    assert rc == 0, err
    assert result["model_type"] == "gpt_oss"
    assert len(result["prompt_ids"]) == 12
    assert len(result["greedy_tokens"]) == 4 and result["decode_steps"] == 3
    assert result["tokens_match"] is True and result["passed"] is True
    assert result["max_rel_err"] <= 1e-4
    assert len(result["decode_rel_err"]) == 3
    assert result["oracle"] == "transformers full forward (no cache)"
    assert result["reference_consistent"] is True and result["reference_inconsistency"] is None
    for step in result["steps"]:  # both errors per step, and the oracle's own check
        assert step["rel_err"] == step["rel_err_vs_full"] <= 1e-4
        assert step["rel_err_vs_cached"] <= 1e-4 and step["reference_rel_err"] <= 1e-4
        assert step["cached_token"] == step["reference_token"] == step["token"]


def test_text_report_names_the_oracle(gpt_oss_dir, capsys):
    assert main(["verify", str(gpt_oss_dir), "--prompt-len", "12", "--decode-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "oracle: transformers full forward (no cache)" in out
    assert "vs full" in out and "vs cached" in out and "the reference is consistent" in out
    assert out.rstrip().endswith("PASSED")


def test_verify_is_reproducible_per_seed(gpt_oss_dir, capsys):
    _, a, _ = _verify(capsys, gpt_oss_dir, "--seed", "7")
    _, b, _ = _verify(capsys, gpt_oss_dir, "--seed", "7")
    _, c, _ = _verify(capsys, gpt_oss_dir, "--seed", "8")
    assert a["prompt_ids"] == b["prompt_ids"] != c["prompt_ids"]


def test_a_weight_perturbed_in_dayzero_only_fails_at_prefill(gpt_oss_dir, capsys, monkeypatch):
    load = verify_mod.load_dayzero

    def perturbed(*args, **kwargs):
        model = load(*args, **kwargs)
        name, param = next((n, p) for n, p in model.named_parameters() if n.endswith("o_proj.weight"))
        with torch.no_grad():
            param.add_(torch.randn_like(param) * param.std())
        return model

    monkeypatch.setattr(verify_mod, "load_dayzero", perturbed)
    rc, result, err = _verify(capsys, gpt_oss_dir)
    assert rc == 1
    assert result["passed"] is False and result["max_rel_err"] > 1e-2
    assert result["first_divergence"]["step"] == 0
    assert "first divergence at prefill" in err


def test_a_decode_only_bug_is_named_by_its_step(gpt_oss_dir, capsys, monkeypatch):
    load = verify_mod.load_dayzero

    def broken_cache(*args, **kwargs):
        model = load(*args, **kwargs)
        forward = model.forward

        def forward_losing_the_cache_at_step_2(input_ids, positions, cache=None):
            if cache is not None and input_ids.shape[1] == 1 and int(positions[0, 0]) == 13:
                cache.storage.streams[0, "k"].zero_()  # forget layer 0's keys before decode step 2
                cache.storage.streams[0, "v"].zero_()
            return forward(input_ids, positions, cache)

        model.forward = forward_losing_the_cache_at_step_2
        return model

    monkeypatch.setattr(verify_mod, "load_dayzero", broken_cache)
    rc, result, err = _verify(capsys, gpt_oss_dir)
    assert rc == 1
    assert result["first_divergence"]["step"] == 2
    assert "first divergence at decode step 2" in err


def _cached_path_broken_at_step_2(monkeypatch):
    """transformers' cached generate made wrong from decode step 2 on (its full forward untouched)."""
    cached = verify_mod.reference_cached_logits

    def broken(model, prompt, tokens):
        logits = cached(model, prompt, tokens)
        logits[2:] += torch.randn_like(logits[2:]) * logits.abs().max()
        return logits

    monkeypatch.setattr(verify_mod, "reference_cached_logits", broken)


def test_an_inconsistent_reference_is_reported_and_the_full_forward_judges(gpt_oss_dir, capsys, monkeypatch):
    _cached_path_broken_at_step_2(monkeypatch)
    rc, result, err = _verify(capsys, gpt_oss_dir)
    assert rc == 0, err  # dayzero agrees with the full forward
    assert result["passed"] is True and result["max_rel_err"] <= 1e-4
    assert result["reference_consistent"] is False
    assert result["reference_inconsistency"]["step"] == 2
    assert "the reference is inconsistent at step 2" in result["reference_inconsistency"]["message"]
    assert "judged against the full forward" in result["reference_inconsistency"]["message"]
    steps = result["steps"]
    assert all(s["reference_rel_err"] <= 1e-4 and s["rel_err_vs_cached"] <= 1e-4 for s in steps[:2])
    assert all(s["reference_rel_err"] > 1e-2 and s["rel_err_vs_cached"] > 1e-2 for s in steps[2:])
    assert main(["verify", str(gpt_oss_dir), "--prompt-len", "12", "--decode-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "the reference is inconsistent at step 2" in out and "<-- reference inconsistent" in out


def test_a_dayzero_bug_fails_against_an_inconsistent_reference_too(gpt_oss_dir, capsys, monkeypatch):
    _cached_path_broken_at_step_2(monkeypatch)
    load = verify_mod.load_dayzero

    def perturbed(*args, **kwargs):
        model = load(*args, **kwargs)
        forward = model.forward

        def wrong_at_step_3(input_ids, positions, cache=None):
            logits = forward(input_ids, positions, cache)
            return logits * 1.1 if int(positions[0, -1]) == 14 else logits  # the prompt is 12 tokens

        model.forward = wrong_at_step_3
        return model

    monkeypatch.setattr(verify_mod, "load_dayzero", perturbed)
    rc, result, err = _verify(capsys, gpt_oss_dir)
    assert rc == 1
    assert result["reference_inconsistency"]["step"] == 2 and result["first_divergence"]["step"] == 3
    assert "first divergence at decode step 3" in err and "transformers full forward" in err


@pytest.fixture(scope="module")
def tied_v32_dir(tmp_path_factory):
    """One indexer head and index_topk 4 under a 12-token prompt: the indexer's scores tie exactly
    (ReLU zeros) at the top-k boundary."""
    from tests.models.deepseek_checkpoints import build_deepseek_v32_checkpoint

    return build_deepseek_v32_checkpoint(tmp_path_factory.mktemp("v32"), fp8=False, mtp=False, index_n_heads=1,
                                         index_topk=4)


def test_v32_with_tied_scores_passes_against_the_ranked_reference(tied_v32_dir, capsys):
    rc, result, err = _verify(capsys, tied_v32_dir)
    assert rc == 0, err
    assert result["reference_ties"] == "index" and result["reference_consistent"] is True
    assert result["max_rel_err"] <= 1e-4 and max(s["rel_err_vs_cached"] for s in result["steps"]) <= 1e-4


def test_transformers_as_installed_is_an_inconsistent_reference_on_tied_scores(tied_v32_dir, capsys):
    """torch.topk's pick among tied scores depends on the row length: transformers' cached generate
    and its full forward disagree (docs/models.md). If this fails, transformers changed its ties."""
    rc, result, _ = _verify(capsys, tied_v32_dir, "--reference-ties", "torch")
    assert result["reference_ties"] == "torch"
    assert result["reference_consistent"] is False and result["reference_inconsistency"]["rel_err"] > 1e-2
    assert rc == 1  # dayzero ranks ties by key index, the full forward by torch.topk's order


def test_verify_rejects_bad_arguments(gpt_oss_dir, capsys):
    assert main(["verify", str(gpt_oss_dir), "--prompt-len", "0"]) == 2
    assert "--prompt-len must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["verify", str(gpt_oss_dir), "--reference-ties", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--reference-ties 'random' is not supported"):
        verify_mod.verify_checkpoint(gpt_oss_dir, reference_ties="random")


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k2", "deepseek_v32", "deepseek_v4", "kimi_linear", "glm4_moe",
                                    "qwen3_5_moe"])
def test_verify_passes_on_every_deepseek_family(family, tmp_path, capsys):
    from tests.models.deepseek_checkpoints import build_deepseek_v3_checkpoint, build_deepseek_v32_checkpoint
    from tests.models.deepseek_v4_checkpoints import build_deepseek_v4_checkpoint

    if family == "deepseek_v32":
        path, prompt_len = build_deepseek_v32_checkpoint(tmp_path), "20"  # past index_topk (8): sparse path
    elif family == "deepseek_v4":
        path, prompt_len = build_deepseek_v4_checkpoint(tmp_path), "40"  # past the window and a few CSA entries
    elif family == "kimi_linear":
        from tests.models.kimi_linear_checkpoints import build_kimi_linear_checkpoint

        path, prompt_len = build_kimi_linear_checkpoint(tmp_path), "70"  # past one KDA chunk (64)
    elif family == "glm4_moe":
        from tests.models.glm4_moe_checkpoints import build_glm4_moe_checkpoint

        path, prompt_len = build_glm4_moe_checkpoint(tmp_path, seed=5), "24"
    elif family == "qwen3_5_moe":
        from tests.models.qwen3_5_moe_checkpoints import build_qwen3_5_moe_checkpoint

        path, prompt_len = build_qwen3_5_moe_checkpoint(tmp_path, seed=3, model_type="qwen3_5_moe_text"), "66"
    else:
        path, prompt_len = build_deepseek_v3_checkpoint(tmp_path, model_type=family), "12"
    rc = main(["verify", str(path), "--json", "--prompt-len", prompt_len, "--decode-steps", "3"])
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert rc == 0, err
    assert result["model_type"] == ("qwen3_5_moe_text" if family == "qwen3_5_moe" else family)
    assert result["tokens_match"] and result["max_rel_err"] <= 1e-4


def test_verify_runs_on_the_demo_checkpoint_by_default(capsys):
    rc = main(["verify", "--prompt-len", "16", "--decode-steps", "2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "deepseek_v4" in out and "PASSED" in out


def test_fp8_checkpoint_with_dims_off_the_block_grid_is_verified_with_dequantized_weights(tmp_path, capsys):
    """kv_a_proj_with_mqa of 160 + 32 = 192 rows (a real one has 576): two 128-row scale blocks.
    transformers' own CPU loader derives a block of 192 / 2 = 96 rows from the scale grid and
    dequantizes wrongly; the oracle is then built from weights dequantized by dayzero.formats.fp8."""
    from dayzero.verify import load_reference, rel_err
    from tests.models.deepseek_checkpoints import build_deepseek_v3_checkpoint

    path = build_deepseek_v3_checkpoint(tmp_path, kv_lora_rank=160)
    rc, result, err = _verify(capsys, path)
    assert rc == 0, err
    assert result["tokens_match"] and result["max_rel_err"] <= 1e-4
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        good = load_reference(path, torch.float32, "cpu")(ids).logits
        try:
            naive = load_reference(path, torch.float32, "cpu", dequantize=False)(ids).logits
        except Exception:  # a transformers version that refuses the off-grid shape instead
            naive = None
    assert naive is None or rel_err(naive, good) > 1e-3


def test_verify_with_images(tmp_path, capsys, monkeypatch):
    """`--image FILE` (repeatable): the images' placeholders in the prompt, both sides reading the same
    pixels; a perturbed vision weight on dayzero's side fails at prefill."""
    from tests.models.kimi_k25_checkpoints import build_kimi_k25_checkpoint, random_image

    path = build_kimi_k25_checkpoint(tmp_path, seed=5)
    files = []
    for i, size in enumerate([(28, 56), (150, 100)]):
        files.append(tmp_path / f"{i}.png")
        random_image(*size, seed=i).save(files[-1])
    argv = ["verify", str(path), "--json", "--prompt-len", "8", "--decode-steps", "2"]
    assert main(argv + [arg for f in files for arg in ("--image", str(f))]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and out["num_images"] == 2 and out["max_rel_err"] < 1e-4
    assert len(out["prompt_ids"]) == 8 + 2 + 24  # the random tokens and the two images' placeholders
    load = verify_mod.load_dayzero

    def perturbed(*args, **kwargs):
        model = load(*args, **kwargs)
        with torch.no_grad():
            model.vision_tower.encoder.blocks[1].mlp.fc1.weight.mul_(1.5)
        return model

    monkeypatch.setattr(verify_mod, "load_dayzero", perturbed)
    assert main(argv + ["--image", str(files[0])]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["first_divergence"]["step"] == 0 and out["max_rel_err"] > 1e-3


def test_float32_references_run_transformers_torch_definitions(monkeypatch):
    """A function transformers takes from an installed kernel package (its `use_kernel_func_from_hub_with_
    fallback`: functools.wraps over the torch definition, e.g. fla's chunk_kda, TF32 products in float32)
    is its torch definition while a float32 verify runs, and the package's again after; bf16 keeps it."""
    import functools
    import sys
    import types

    from dayzero.verify import _full_precision

    module = types.ModuleType("transformers.models.fake_fla.modeling_fake_fla")

    def chunk_rule(x):
        return "torch"
    chunk_rule.__module__ = module.__name__

    @functools.wraps(chunk_rule)
    def from_package(x):
        return "package"
    module.chunk_rule = from_package
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with _full_precision(torch.bfloat16, "fake_fla"):
        assert module.chunk_rule(0) == "package"
    with _full_precision(torch.float32, "fake_fla"):
        assert module.chunk_rule(0) == "torch" and not torch.backends.cudnn.allow_tf32
    assert module.chunk_rule(0) == "package"
