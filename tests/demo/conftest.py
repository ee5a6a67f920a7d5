import pytest

from dayzero.demo import demo_checkpoint


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    return demo_checkpoint(tmp_path_factory.mktemp("demo") / "checkpoint")
