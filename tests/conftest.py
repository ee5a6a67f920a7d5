import pytest


@pytest.fixture(autouse=True, scope="session")
def _demo_cache_in_tmp(tmp_path_factory):
    """Keep the demo checkpoint cache (DAYZERO_CACHE) inside pytest's temp dir, not the user's home: in the
    environment (for subprocesses) and in the settings, which read it once."""
    from dayzero import settings

    mp = pytest.MonkeyPatch()
    mp.setenv("DAYZERO_CACHE", str(tmp_path_factory.mktemp("dayzero-cache")))
    settings.reload()
    yield
    mp.undo()
    settings.reload()


@pytest.fixture(autouse=True)
def _seeded_torch():
    """Every test starts from the same global torch seed, so its random inputs do not depend on which
    tests ran before it (a tolerance is then checked on the same draw every run)."""
    import torch

    torch.manual_seed(0)
