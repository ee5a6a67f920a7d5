import pytest


@pytest.fixture(autouse=True, scope="session")
def _demo_cache_in_tmp(tmp_path_factory):
    """Keep the demo checkpoint cache (DAYZERO_CACHE) inside pytest's temp dir, not the user's home."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DAYZERO_CACHE", str(tmp_path_factory.mktemp("dayzero-cache")))
    yield
    mp.undo()
