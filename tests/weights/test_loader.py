import inspect

import pytest
import torch
from safetensors.torch import save_file

import dayzero.weights.loader as loader
from dayzero.weights import (Checkpoint, CorruptCheckpointError, MissingTensorError, TensorSpec,
                             iter_tensors, load_state_dict)


@pytest.fixture
def tensors():
    return {
        "a.weight": torch.randn(64, 32).bfloat16(),
        "b.weight": torch.randn(32, 64),
        "b.qweight": torch.randint(-128, 128, (32, 16), dtype=torch.int8),
        "c.weight": torch.randn(16, 16).to(torch.float8_e4m3fn),
    }


@pytest.fixture
def path(tmp_path, tensors):
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


@pytest.fixture
def reads(monkeypatch):
    """Names of tensors read from disk, in order."""
    names = []
    original = loader.read_tensor

    def read_tensor(f, info):
        names.append(info.name)
        return original(f, info)
    monkeypatch.setattr(loader, "read_tensor", read_tensor)
    return names


def test_streams_one_tensor_at_a_time(path, tensors, reads):
    stream = iter_tensors(path, progress=False)
    assert inspect.isgenerator(stream)
    assert reads == []
    name, tensor = next(stream)
    assert len(reads) == 1 and name == reads[0]
    assert torch.equal(tensor.view(torch.uint8), tensors[name].view(torch.uint8))
    rest = dict(stream)
    assert len(reads) == len(tensors)
    assert set(rest) | {name} == set(tensors)


def test_reads_in_file_order(path, reads):
    checkpoint = Checkpoint.open(path)
    list(iter_tensors(checkpoint))
    starts = [checkpoint.tensors[n].start for n in reads]
    assert starts == sorted(starts)


def test_cast_applies_only_to_plain_floats(path, tensors):
    loaded = load_state_dict(path, dtype=torch.float16)
    assert loaded["a.weight"].dtype == torch.float16
    assert loaded["b.weight"].dtype == torch.float16
    torch.testing.assert_close(loaded["b.weight"], tensors["b.weight"].half())
    assert loaded["b.qweight"].dtype == torch.int8
    assert torch.equal(loaded["b.qweight"], tensors["b.qweight"])
    assert loaded["c.weight"].dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="not a floating point dtype"):
        load_state_dict(path, dtype=torch.int32)


def test_names_selects_tensors(path, tensors, reads):
    got = dict(iter_tensors(path, names=["b.qweight", "a.weight"]))
    assert set(got) == {"a.weight", "b.qweight"} and set(reads) == set(got)
    with pytest.raises(MissingTensorError, match="d.weight") as info:
        iter_tensors(path, names=["a.weight", "d.weight"])
    assert info.value.tensor == "d.weight"


def test_device_argument(path):
    loaded = load_state_dict(path, device="meta")
    assert all(t.device.type == "meta" for t in loaded.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device(path, tensors):
    device = f"cuda:{torch.cuda.device_count() - 1}"
    loaded = load_state_dict(path, device=device, dtype=torch.float32)
    assert all(t.device == torch.device(device) for t in loaded.values())
    torch.testing.assert_close(loaded["a.weight"].cpu(), tensors["a.weight"].float())
    assert torch.equal(loaded["b.qweight"].cpu(), tensors["b.qweight"])


def test_no_progress_bar_without_tty(path, capsys):
    load_state_dict(path, progress=True)
    assert capsys.readouterr().err == ""


def test_summary(path, tensors):
    state_dict, summary = load_state_dict(
        path, expected={n: TensorSpec() for n in tensors}, return_summary=True)
    assert summary.num_tensors == len(tensors) == len(state_dict)
    assert summary.num_files == 1
    assert summary.bytes_by_dtype == {"F32": 32 * 64 * 4, "BF16": 64 * 32 * 2, "I8": 32 * 16,
                                      "F8_E4M3": 16 * 16}
    assert summary.total_bytes == Checkpoint.open(path).total_bytes
    assert summary.seconds > 0
    assert "Loaded 4 tensors" in str(summary)


def test_file_truncated_after_open(path):
    checkpoint = Checkpoint.open(path)
    file = checkpoint.files[0]
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="truncated after opening") as info:
        load_state_dict(checkpoint)
    assert info.value.file == file
    assert info.value.tensor == list(checkpoint.tensors)[-1]
