"""`dayzero verify` on real-layout tiny checkpoints: passes when dayzero is right, fails loudly
(non-zero exit, the first diverging step named) when dayzero's side computes something wrong."""

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
                cache.layers[0].clear()  # forget layer 0's keys and values before decode step 2
                cache.layers[0].update(model.new_cache(1).layers[0])
            return forward(input_ids, positions, cache)

        model.forward = forward_losing_the_cache_at_step_2
        return model

    monkeypatch.setattr(verify_mod, "load_dayzero", broken_cache)
    rc, result, err = _verify(capsys, gpt_oss_dir)
    assert rc == 1
    assert result["first_divergence"]["step"] == 2
    assert "first divergence at decode step 2" in err


def test_verify_rejects_bad_arguments(gpt_oss_dir, capsys):
    assert main(["verify", str(gpt_oss_dir), "--prompt-len", "0"]) == 2
    assert "--prompt-len must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k2", "deepseek_v32", "deepseek_v4", "kimi_linear"])
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
    else:
        path, prompt_len = build_deepseek_v3_checkpoint(tmp_path, model_type=family), "12"
    rc = main(["verify", str(path), "--json", "--prompt-len", prompt_len, "--decode-steps", "3"])
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert rc == 0, err
    assert result["model_type"] == family
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
