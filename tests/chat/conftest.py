import pytest
from transformers import AutoTokenizer

from tests.chat.families import FAMILIES, write_family_tokenizer


@pytest.fixture(scope="session")
def family_tokenizers(tmp_path_factory):
    """{family: tokenizer} of tests/chat/families.py, written once per session."""
    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(family)
        write_family_tokenizer(family, d)
        out[family] = AutoTokenizer.from_pretrained(d)
    return out
