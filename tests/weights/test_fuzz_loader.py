"""The loader under hypothesis: real tiny checkpoints (the demo: DeepSeek-V4, FP8 + FP4 with E8M0 scales,
two shards and an index; DeepSeek-V3: FP8 with float32 scales; gpt-oss: MXFP4 with byte scales) broken
the ways downloads and disks break them: truncated shards, bytes of a header overwritten, a wrong header
length, a tensor stored with another dtype or shape or left out, NaN / infinite / negative / 0xFF
block scales, index entries missing, pointing elsewhere or garbled. `load_model` either raises a
WeightsError naming the file (and the tensor, where one tensor is at fault), or loads weights equal bit
for bit to the intact checkpoint's: never another exception, never silently wrong weights.
Derandomized in CI (DAYZERO_FULL_TESTS=1: 10x more examples)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from dayzero.models import load_model
from dayzero.weights import Checkpoint, InvalidValuesError, WeightsError

EXAMPLES = 400 if os.environ.get("DAYZERO_FULL_TESTS") == "1" else 40
KINDS = ["truncate", "header_byte", "header_length", "scale", "dtype", "shape", "drop", "index"]
FAMILIES = ["demo", "deepseek_v3", "gpt_oss"]
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _build(name: str, tmp: Path) -> Path:
    if name == "demo":
        from dayzero.demo import demo_checkpoint

        return demo_checkpoint()
    if name == "deepseek_v3":
        from tests.models.deepseek_checkpoints import build_deepseek_v3_checkpoint

        return build_deepseek_v3_checkpoint(tmp, mtp=False, num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
                                            n_group=2, topk_group=1)
    from tests.models.gpt_oss_checkpoints import build_gpt_oss_checkpoint

    return build_gpt_oss_checkpoint(tmp)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}


def _scales(checkpoint: Checkpoint) -> list[str]:
    """The block scales of quantized weights, by what is stored (independent of the model code): E8M0
    tensors, MXFP4 byte scales, float scales beside an FP8 weight."""
    names = []
    for name, info in checkpoint.tensors.items():
        stem = name.rsplit(".", 1)[0]
        beside_fp8 = any(checkpoint.tensors.get(f"{stem}.{w}", None) is not None and
                         checkpoint.tensors[f"{stem}.{w}"].dtype == "F8_E4M3" for w in ("weight",))
        if (info.dtype == "F8_E8M0" or (info.dtype == "U8" and name.endswith("_scales"))
                or (info.dtype == "F32" and (name.endswith("weight_scale_inv") or (name.endswith(".scale") and beside_fp8)))):
            names.append(name)
    return names


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (the intact checkpoint's path, its catalogue, the weights it loads)."""
    out = {}
    for name in FAMILIES:
        path = _build(name, tmp_path_factory.mktemp(name))
        out[name] = path, Checkpoint.open(path), _state(load_model(path, dtype=torch.float32, progress=False))
    return out


# -- breaking a copy --------------------------------------------------------------------------------------
def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _rewrite(file: Path, change) -> None:
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _file_of(ck_path: Path, checkpoint: Checkpoint, tensor: str) -> Path:
    return ck_path / checkpoint.tensors[tensor].file.name


def _apply(kind: str, path: Path, checkpoint: Checkpoint, draw) -> tuple[str | None, type | None]:
    """Break the copy at `path`; returns (the tensor the error must name or None, the error type required or None)."""
    files = _files(path)
    if kind == "truncate":
        f = draw(st.sampled_from(files))
        data = f.read_bytes()
        f.write_bytes(data[:draw(st.integers(0, len(data) - 1))])
        return None, None
    if kind == "header_byte":
        f = draw(st.sampled_from(files))
        data = bytearray(f.read_bytes())
        n = struct.unpack("<Q", data[:8])[0]
        data[8 + draw(st.integers(0, n - 1))] = draw(st.integers(0, 255))
        f.write_bytes(bytes(data))
        return None, None
    if kind == "header_length":
        f = draw(st.sampled_from(files))
        data = f.read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        new = draw(st.sampled_from([0, 1, n - 1, n + 1, n + 8, len(data), 2**63, 2**64 - 1]))
        f.write_bytes(struct.pack("<Q", new) + data[8:])
        return None, None
    names = sorted(checkpoint.tensors)
    if kind == "scale":
        name = draw(st.sampled_from(_scales(checkpoint)))

        def poison(tensors):
            t = tensors[name]
            flat = t.view(-1) if t.dtype == torch.float32 else t.view(torch.uint8).view(-1)
            i = draw(st.integers(0, flat.numel() - 1))
            flat[i] = 0xFF if t.dtype != torch.float32 else draw(st.sampled_from([float("nan"), float("inf"), -1.0]))
        _rewrite(_file_of(path, checkpoint, name), poison)
        return name, InvalidValuesError
    name = draw(st.sampled_from(names))
    if kind == "dtype":
        def retype(tensors):
            t = tensors[name]
            tensors[name] = t.view(torch.uint8).to(torch.int32) if t.is_floating_point() else t.to(torch.float32)
        _rewrite(_file_of(path, checkpoint, name), retype)
    elif kind == "shape":
        def reshape(tensors):
            t = tensors[name]
            tensors[name] = torch.cat([t, t[:1]]) if t.dim() else t.reshape(1, 1)
        _rewrite(_file_of(path, checkpoint, name), reshape)
    elif kind == "drop":
        _rewrite(_file_of(path, checkpoint, name), lambda tensors: tensors.pop(name))
    elif kind == "index":
        index = path / "model.safetensors.index.json"
        if not index.exists():
            return None, None
        doc = json.loads(index.read_text())
        action = draw(st.sampled_from(["forget", "elsewhere", "missing_shard", "garble"]))
        if action == "garble":
            index.write_text(index.read_text()[:draw(st.integers(0, 40))])
            return None, None
        if action == "forget":  # the shard still holds it: it loads, as the files are what is read
            doc["weight_map"].pop(name)
            name = None
        else:
            other = [f.name for f in files if f.name != doc["weight_map"][name]]
            doc["weight_map"][name] = other[0] if action == "elsewhere" and other else "model-99999-of-99999.safetensors"
        index.write_text(json.dumps(doc))
    return name, None


def test_a_broken_checkpoint_is_an_error_naming_file_and_tensor_or_loads_the_same_weights(families, tmp_path):
    @FUZZ
    @given(family=st.sampled_from(FAMILIES), kind=st.sampled_from(KINDS), data=st.data(), threads=st.sampled_from([1, 3]))
    def run(family, kind, data, threads):
        path, checkpoint, want = families[family]
        copy = tmp_path / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(path, copy)
        tensor, required = _apply(kind, copy, checkpoint, data.draw)
        try:
            model = load_model(copy, dtype=torch.float32, progress=False, threads=threads)
        except WeightsError as err:
            message = str(err)
            assert err.file is not None and (str(err.file) in message or err.file.name in message), message
            if required is not None:
                assert isinstance(err, required), message
            if tensor is not None:
                assert err.tensor is not None and tensor in message, message
            return
        assert required is None, f"{kind}: loaded without the {required.__name__} expected"
        got = _state(model)
        assert got.keys() == want.keys()
        for k, v in want.items():  # bit for bit (NaN included)
            assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), f"{kind}: {k} loaded differently"

    run()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_scale_of_every_family_is_checked(families, family, tmp_path):
    """All scales poisoned at once: one error lists each of them (none is loaded unchecked)."""
    path, checkpoint, _ = families[family]
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    scales = _scales(checkpoint)
    assert scales
    for f in _files(copy):
        def poison(tensors):
            for s in scales:
                if s in tensors:
                    t = tensors[s]
                    (t.view(-1) if t.dtype == torch.float32 else t.view(torch.uint8).view(-1))[-1] = (
                        float("nan") if t.dtype == torch.float32 else 0xFF)
        _rewrite(f, poison)
    with pytest.raises(InvalidValuesError) as info:
        load_model(copy, dtype=torch.float32, progress=False)
    assert len(info.value.problems) == len(scales), str(info.value)[:2000]
