import json

import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return AutoTokenizer.from_pretrained(demo_dir)


@pytest.mark.parametrize(
    "text",
    [
        "Hello, how are you today?",
        "The lighthouse keeper climbed 112 steps.\nThen she wrote the weather down.",
        "naïve café — 日本語 🙂 tabs\tand  double  spaces",
    ],
)
def test_text_round_trips(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_special_and_chat_tokens(tokenizer):
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<｜begin▁of▁sentence｜>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<｜end▁of▁sentence｜>", 1)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<｜▁pad▁｜>", 2)
    for token in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"):
        ids = tokenizer(token, add_special_tokens=False).input_ids
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids) == [token]


def test_vocab_size_covers_tokenizer(tokenizer, demo_dir):
    config = json.loads((demo_dir / "config.json").read_text())
    assert len(tokenizer) <= config["vocab_size"]
    assert max(tokenizer.get_vocab().values()) < config["vocab_size"]


def test_chat_template_renders_deepseek_v4_format(tokenizer):
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a story"},
    ]
    history = "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜>"
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == history + "<｜User｜>Tell me a story<｜Assistant｜></think>"
    thinking = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=True)
    assert thinking == history + "<｜User｜>Tell me a story<｜Assistant｜><think>"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids) == chat
