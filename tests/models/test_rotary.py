"""Our rope tables against transformers' own rope initialisation."""

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dayzero.models.rotary import rope_from_config

CASES = [
    ("deepseek_v3", dict(qk_rope_head_dim=64, rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                                               beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
                         max_position_embeddings=163840, rope_theta=10000), 64),
    ("gpt_oss", dict(head_dim=64, rope_scaling=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                                     beta_fast=32.0, beta_slow=1.0, truncate=False), rope_theta=150000), 64),
    ("deepseek_v3", dict(qk_rope_head_dim=16, rope_scaling=dict(type="yarn", factor=4, original_max_position_embeddings=512,
                                                               mscale=0.707, mscale_all_dim=1.0),
                         max_position_embeddings=2048), 16),
]


@pytest.mark.parametrize("model_type, overrides, dim", CASES)
def test_yarn_matches_transformers(model_type, overrides, dim):
    cfg = AutoConfig.for_model(model_type, **overrides)
    cfg.standardize_rope_params()
    params = cfg.rope_parameters
    inv_ref, scale_ref = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    rope = rope_from_config(params, dim, params["rope_theta"], cfg.max_position_embeddings)
    torch.testing.assert_close(rope.inv_freq, inv_ref.float(), rtol=0, atol=0)
    assert rope.attention_scaling == pytest.approx(scale_ref, rel=1e-12)


def test_default_and_errors():
    rope = rope_from_config(None, 8, 10000.0)
    torch.testing.assert_close(rope.inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    cos, sin = rope.cos_sin(torch.tensor([[0, 3]]))
    assert cos.shape == (1, 2, 4) and torch.equal(cos[0, 0], torch.ones(4))
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        rope_from_config({"rope_type": "dynamic", "factor": 2.0}, 8, 10000.0)
