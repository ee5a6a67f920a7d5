"""dayzero/settings.py: every DAYZERO_* variable parsed once into a frozen Settings, with errors that name
the variable; in-process overrides; and docs/settings.md kept equal to the declarations."""

from pathlib import Path

import pytest

from dayzero import settings

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def test_defaults_and_parsing():
    s = settings.from_environ({})
    assert s == settings.Settings() and s.backend is None and s.variants == () and s.pdl
    env = {"DAYZERO_BACKEND": "reference", "DAYZERO_VARIANT": " moe_experts_mxfp4=wgmma , moe_experts_bf16=mma",
           "DAYZERO_CACHE": "/tmp/dz", "DAYZERO_MOE_GRAPH_MAX_TOKENS": "8", "DAYZERO_MOE_B_MIN_TOKENS": "2",
           "DAYZERO_MOE_B_MAX_TOKENS": "9", "DAYZERO_FP8_WORKSPACE_GIB": "1.5", "DAYZERO_FP8_PREFETCH": "0",
           "DAYZERO_PDL": "false", "HOME_OF_SOMETHING_ELSE": "x"}
    s = settings.from_environ(env)
    assert s.backend == "reference" and s.variant("moe_experts_mxfp4") == "wgmma" and s.variant("rms_norm") is None
    assert s.variants == (("moe_experts_bf16", "mma"), ("moe_experts_mxfp4", "wgmma"))
    assert (s.cache_dir, s.moe_graph_max_tokens, s.moe_b_min_tokens, s.moe_b_max_tokens) == (Path("/tmp/dz"), 8, 2, 9)
    assert (s.fp8_workspace_gib, s.fp8_prefetch, s.pdl) == (1.5, False, False)
    assert hash(s) == hash(settings.from_environ(env))  # frozen and hashable: the kernel choice caches on it


@pytest.mark.parametrize("name,raw,match", [
    ("DAYZERO_MOE_B_MAX_TOKENS", "lots", "DAYZERO_MOE_B_MAX_TOKENS must be a whole number, got 'lots'"),
    ("DAYZERO_MOE_GRAPH_MAX_TOKENS", "-1", "DAYZERO_MOE_GRAPH_MAX_TOKENS must not be negative"),
    ("DAYZERO_FP8_WORKSPACE_GIB", "big", "DAYZERO_FP8_WORKSPACE_GIB must be a number of GiB"),
    ("DAYZERO_PDL", "maybe", "DAYZERO_PDL must be 0 or 1"),
    ("DAYZERO_VARIANT", "wgmma", "DAYZERO_VARIANT must be op=variant pairs"),
    ("DAYZERO_VARIANT", "a=b,a=c", "names op 'a' twice"),
])
def test_bad_values_name_the_variable(name, raw, match):
    with pytest.raises(ValueError, match=match):
        settings.from_environ({name: raw})


def test_override_nests_and_restores():
    base = settings.get()
    with settings.override(moe_graph_max_tokens=0, variants={"moe_experts_mxfp4": "mma"}) as s:
        assert settings.get() is s and s.moe_graph_max_tokens == 0 and s.variant("moe_experts_mxfp4") == "mma"
        with settings.override(pdl=False):
            assert settings.get().moe_graph_max_tokens == 0 and not settings.get().pdl
        assert settings.get().pdl == base.pdl
        with settings.override():  # equal to the one below it: leaving it must not drop that one
            pass
        assert settings.get() is s
    assert settings.get() == base
    with pytest.raises(TypeError, match="unknown setting"):
        with settings.override(moe_path="b"):
            pass


def test_reload_reads_the_environment_again(monkeypatch):
    monkeypatch.setenv("DAYZERO_MOE_GRAPH_MAX_TOKENS", "4")
    assert settings.reload().moe_graph_max_tokens == 4
    monkeypatch.delenv("DAYZERO_MOE_GRAPH_MAX_TOKENS")
    assert settings.reload().moe_graph_max_tokens == 32


def test_every_variable_is_declared_once():
    envs = [f.metadata["env"] for f in settings.fields()]
    assert len(envs) == len(set(envs)) and all(e.startswith("DAYZERO_") for e in envs)
    assert all(f.metadata["doc"] for f in settings.fields())


def test_the_doc_lists_every_setting():
    """docs/settings.md holds the table `python -m dayzero.settings` prints."""
    assert settings.markdown_table() in DOC.read_text(), "regenerate with: python -m dayzero.settings"
