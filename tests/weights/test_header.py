import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero.weights import (DTYPES, Checkpoint, CorruptCheckpointError, WeightsError,
                             load_state_dict, read_header)

# (safetensors code, torch dtype) for every dtype safetensors writes that torch can hold.
TORCH_DTYPES = [(code, d.torch_dtype) for code, d in DTYPES.items() if d.torch_dtype is not None]


def random_tensor(dtype: torch.dtype, shape=(4, 6)) -> torch.Tensor:
    """Fresh random bits of `dtype` (for 1-byte float formats: any byte, NaN patterns included)."""
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.randn(shape).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, dtype=torch.bool)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("code,dtype", TORCH_DTYPES, ids=[c for c, _ in TORCH_DTYPES])
def test_round_trip_every_dtype(tmp_path, code, dtype):
    tensors = {"w": random_tensor(dtype), "empty": random_tensor(dtype, (0, 3))}
    if code != "F4":  # a lone 4-bit value is half a byte
        tensors["scalar"] = random_tensor(dtype, ())
    save_file(tensors, tmp_path / "model.safetensors")

    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.tensors["w"].dtype == code
    assert checkpoint.tensors["w"].torch_dtype == dtype
    loaded = load_state_dict(tmp_path)
    cast = load_state_dict(tmp_path, dtype=torch.float32)  # must not touch non-floats
    reference = load_file(tmp_path / "model.safetensors")
    for name, tensor in tensors.items():
        assert same_bits(loaded[name], tensor), name
        assert same_bits(reference[name], tensor), name
        if code in ("F16", "BF16", "F32", "F64"):
            assert cast[name].dtype == torch.float32
            assert torch.equal(cast[name], tensor.float())
        else:
            assert same_bits(cast[name], tensor), name


def test_packed_quantized_tensors_keep_their_bits(tmp_path):
    tensors = {
        "experts.w1.blocks": random_tensor(torch.uint8, (8, 16, 4)),  # MXFP4 packed in U8
        "experts.w1.scales": random_tensor(torch.float8_e8m0fnu, (8, 16, 1)),
        "q_proj.weight": random_tensor(torch.float8_e4m3fn, (16, 32)),
        "q_proj.weight_int8": random_tensor(torch.int8, (16, 32)),
        "down.fp4": random_tensor(torch.float4_e2m1fn_x2, (16, 8)),
        "norm.weight": torch.randn(32, dtype=torch.bfloat16),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.tensors["down.fp4"].shape == (16, 16)  # header counts 4-bit values
    assert checkpoint.tensors["down.fp4"].torch_shape == (16, 8)

    loaded = load_state_dict(tmp_path, dtype=torch.float16)
    for name in tensors:
        if name == "norm.weight":
            assert loaded[name].dtype == torch.float16
        else:
            assert same_bits(loaded[name], tensors[name]), name


def test_catalogue_offsets_match_file(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(0, 7), "c": torch.randn(2).half()}
    save_file(tensors, tmp_path / "x.safetensors")
    header = read_header(tmp_path / "x.safetensors")
    assert header.size == (tmp_path / "x.safetensors").stat().st_size
    assert header.tensors["a"].nbytes == 60 and header.tensors["b"].nbytes == 0
    assert header.tensors["c"].shape == (2,)
    data = (tmp_path / "x.safetensors").read_bytes()
    a = header.tensors["a"]
    assert data[a.start:a.end] == tensors["a"].numpy().tobytes()
    assert max(t.end for t in header.tensors.values()) == header.size


def test_f6_is_catalogued_but_not_loadable(tmp_path, raw_safetensors):
    raw_safetensors(tmp_path / "model.safetensors",
                    {"w": {"dtype": "F6_E2M3", "shape": [4, 32], "data_offsets": [0, 96]}},
                    bytes(96))
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.bytes_by_dtype() == {"F6_E2M3": 96}
    with pytest.raises(WeightsError, match="F6_E2M3 has no torch equivalent"):
        load_state_dict(tmp_path)


def corrupt(tmp_path, match: str):
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        Checkpoint.open(tmp_path)
    assert "model.safetensors" in str(info.value)
    assert info.value.file == tmp_path / "model.safetensors"
    return info.value


def test_truncated_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(16), "b": torch.randn(16)}, path)
    path.write_bytes(path.read_bytes()[:-10])
    error = corrupt(tmp_path, "truncated")
    assert error.tensor == "b" and "'b'" in str(error)


def test_garbage_bytes(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(torch.randint(0, 256, (4096,)).byte().numpy().tobytes())
    corrupt(tmp_path, "header")


def test_file_shorter_than_length_prefix(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    corrupt(tmp_path, "too short")


def test_header_length_larger_than_file(tmp_path, raw_safetensors):
    raw_safetensors(tmp_path / "model.safetensors", {}, b"", header_len=10_000)
    corrupt(tmp_path, "header length 10000 bytes is larger than the file")


def test_bad_json(tmp_path):
    raw = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]'  # no closing braces
    (tmp_path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(4))
    corrupt(tmp_path, "not valid JSON")


def test_duplicate_key_in_header(tmp_path):
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    raw = f'{{"a": {entry}, "a": {entry}}}'.encode()
    (tmp_path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(4))
    corrupt(tmp_path, "'a' appears twice")


def test_unknown_dtype(tmp_path, raw_safetensors):
    raw_safetensors(tmp_path / "model.safetensors",
                    {"w": {"dtype": "F7", "shape": [4], "data_offsets": [0, 4]}}, bytes(4))
    assert corrupt(tmp_path, "unknown dtype 'F7'").tensor == "w"


def test_byte_length_not_matching_shape(tmp_path, raw_safetensors):
    raw_safetensors(tmp_path / "model.safetensors",
                    {"w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 16]}}, bytes(16))
    assert corrupt(tmp_path, r"hold 16 bytes but BF16 \[4, 4\] needs 32").tensor == "w"


def test_overlapping_tensors(tmp_path, raw_safetensors):
    raw_safetensors(tmp_path / "model.safetensors", {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }, bytes(24))
    error = corrupt(tmp_path, "'a' and 'b' overlap")
    assert error.tensor == "b"


@pytest.mark.parametrize("entry,match", [
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "shape"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, "data_offsets"),
    ({"dtype": "F32", "shape": [1]}, "data_offsets"),
    ("not an object", "expected an object"),
])
def test_malformed_entries(tmp_path, raw_safetensors, entry, match):
    raw_safetensors(tmp_path / "model.safetensors", {"w": entry}, bytes(4))
    assert corrupt(tmp_path, match).tensor == "w"
