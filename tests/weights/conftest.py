import json
import struct

import pytest
import torch


def write_raw_safetensors(path, header: dict, data: bytes, header_len: int | None = None) -> None:
    """Write a .safetensors file by hand, to build files safetensors itself refuses to write."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    length = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + raw + data)


@pytest.fixture
def raw_safetensors():
    return write_raw_safetensors


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A real transformers checkpoint, sharded: (directory, model state dict)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path, max_shard_size="20KB")
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}
