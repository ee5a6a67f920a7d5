"""load_model's parallel reader (dayzero.weights.fill) gives, bit for bit, what the sequential stream gives
(iter_tensors, one tensor at a time through each target's assign), for every family's tiny checkpoint in
its shipped formats (MXFP4 blocks and scales, FP8 with block scales, bf16), single-file and sharded;
a missing or damaged shard is named."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dayzero.weights.fill as fill
from dayzero.models import load_model, model_class, read_config
from dayzero.spec import load_spec, resolve_config
from dayzero.startup import StartupTimer
from dayzero.weights import Checkpoint, CorruptCheckpointError, iter_tensors, match_layout
from tests.models.deepseek_checkpoints import build_deepseek_v3_checkpoint, build_deepseek_v32_checkpoint
from tests.models.deepseek_v4_checkpoints import build_deepseek_v4_checkpoint
from tests.models.glm4_moe_checkpoints import build_glm4_moe_checkpoint
from tests.models.gpt_oss_checkpoints import build_gpt_oss_checkpoint
from tests.models.kimi_k3_checkpoints import build_kimi_k3_checkpoint
from tests.models.kimi_linear_checkpoints import build_kimi_linear_checkpoint
from tests.models.qwen3_5_moe_checkpoints import build_qwen3_5_moe_checkpoint

CHECKPOINTS = {
    "gpt_oss-mxfp4": lambda d: build_gpt_oss_checkpoint(d),
    "gpt_oss-bf16": lambda d: build_gpt_oss_checkpoint(d, expert_format="bf16"),
    "deepseek_v3-fp8": lambda d: build_deepseek_v3_checkpoint(d),
    "kimi_k2-fp8": lambda d: build_deepseek_v3_checkpoint(d, model_type="kimi_k2"),
    "deepseek_v32-fp8": lambda d: build_deepseek_v32_checkpoint(d),
    "deepseek_v4-mxfp4": lambda d: build_deepseek_v4_checkpoint(d, mtp=True),
    "deepseek_v4-fp8-experts": lambda d: build_deepseek_v4_checkpoint(d, expert_dtype="fp8", moe_intermediate_size=128),
    "deepseek_v4-bf16": lambda d: build_deepseek_v4_checkpoint(d, quantized=False),
    "kimi_linear": lambda d: build_kimi_linear_checkpoint(d),
    "kimi_k3-mxfp4": lambda d: build_kimi_k3_checkpoint(d),
    "glm4_moe": lambda d: build_glm4_moe_checkpoint(d),
    "qwen3_5_moe": lambda d: build_qwen3_5_moe_checkpoint(d),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> Path:
    return CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param))


def load_sequential(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The model filled the one-tensor-at-a-time way: iter_tensors, each tensor through its assign."""
    spec = load_spec(path)
    model = model_class(spec)(spec, resolve_config(read_config(path)), dtype=dtype, device="cpu")
    targets = model.weight_targets()
    expected = {name: t.spec for name, t in targets.items()}
    _, named = match_layout(Checkpoint.open(path), model.layouts(), expected, family=spec.model_type,
                            ignore_unexpected=model.ignore_patterns())
    for name, tensor in iter_tensors(named, expected=expected, ignore_unexpected=model.ignore_patterns(),
                                     progress=False):
        targets[name].assign(tensor)
    model.post_load()
    return model.eval()


def every_tensor(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, persistent or not (post_load derives some)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def assert_same_bits(got: torch.nn.Module, want: torch.nn.Module) -> None:
    a, b = every_tensor(got), every_tensor(want)
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (x, y)]
        assert torch.equal(*as_bytes), name


def split_into_shards(src: Path, dst: Path, shards: int) -> Path:
    """`src`'s model.safetensors rewritten as `shards` files (tensors dealt round-robin, so each file
    holds pieces of every layer) with a model.safetensors.index.json; config.json copied."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, dst / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.fixture
def small_pieces(monkeypatch):
    """Work items of 4 KiB: the tiny checkpoints' larger tensors are read in pieces by several threads."""
    monkeypatch.setattr(fill, "PIECE_BYTES", 4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_parallel_load_equals_sequential(checkpoint, dtype, small_pieces):
    want = load_sequential(checkpoint, dtype)
    timer = StartupTimer()
    got = load_model(checkpoint, dtype=dtype, progress=False, threads=3, startup=timer)
    assert_same_bits(got, want)
    assert "3 thread(s)" in timer.get("weights").detail


def test_sharded_checkpoint_loads_in_parallel(checkpoint, tmp_path, small_pieces):
    sharded = split_into_shards(checkpoint, tmp_path / "sharded", 3)
    timer = StartupTimer()
    got = load_model(sharded, dtype=torch.float32, progress=False, threads=4, startup=timer)
    assert_same_bits(got, load_sequential(checkpoint, torch.float32))
    weights = timer.get("weights")
    assert "3 file(s)" in weights.detail and weights.bytes == Checkpoint.open(sharded).total_bytes - _ignored_bytes(
        sharded)


def _ignored_bytes(path: Path) -> int:
    """Bytes of the tensors the model skips (MTP layers)."""
    spec = load_spec(path)
    model = model_class(spec)(spec, resolve_config(read_config(path)), dtype=torch.float32, device="meta")
    targets = model.weight_targets()
    _, named = match_layout(Checkpoint.open(path), model.layouts(), {n: t.spec for n, t in targets.items()},
                            family=spec.model_type, ignore_unexpected=model.ignore_patterns())
    return sum(i.nbytes for n, i in named.tensors.items() if n not in targets)


@pytest.fixture(scope="module")
def sharded_v4(tmp_path_factory) -> Path:
    src = build_deepseek_v4_checkpoint(tmp_path_factory.mktemp("v4"))
    return split_into_shards(src, tmp_path_factory.mktemp("v4-sharded"), 4)


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_missing_shard_is_named(sharded_v4, tmp_path):
    copy = copy_dir(sharded_v4, tmp_path / "copy")
    missing = copy / "model-00003-of-00004.safetensors"
    missing.unlink()
    with pytest.raises(CorruptCheckpointError, match="does not exist; the download is incomplete") as info:
        load_model(copy, dtype=torch.float32, progress=False, threads=4)
    assert info.value.file == missing and str(missing) in str(info.value)


def test_a_truncated_shard_is_named(sharded_v4, tmp_path):
    copy = copy_dir(sharded_v4, tmp_path / "copy")
    damaged = copy / "model-00002-of-00004.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-1000])
    with pytest.raises(CorruptCheckpointError, match=r"truncated \(re-download it\)") as info:
        load_model(copy, dtype=torch.float32, progress=False, threads=4)
    assert info.value.file == damaged and str(damaged) in str(info.value)


def test_packed_and_fp8_weights_are_read_straight_into_the_model(checkpoint, monkeypatch):
    """Every MXFP4 block and scale, FP8 weight and scale lands in the model's memory with no buffer in
    between (dest), except where a model file converts it (gpt-oss: interleaved gate/up rows)."""
    through_assign = []
    original = fill._Reader._read_assign

    def record(self, r):
        through_assign.append(r.info)
        original(self, r)

    monkeypatch.setattr(fill._Reader, "_read_assign", record)
    load_model(checkpoint, dtype=torch.bfloat16, progress=False, threads=2)
    packed = [i.name for i in through_assign if i.dtype in ("U8", "I8", "F8_E4M3", "F8_E8M0")]
    if load_spec(checkpoint).model_type == "gpt_oss":
        assert all(".mlp.experts." in n for n in packed)  # its model file passes no dest for the experts
    else:
        assert packed == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_parallel_load_to_cuda_equals_sequential_on_cpu(checkpoint, small_pieces):
    """The CUDA path (pinned buffers per thread, pieces copied into the parameters, conversions on the
    device) gives the CPU stream's bits."""
    want = load_sequential(checkpoint, torch.bfloat16)
    got = load_model(checkpoint, device="cuda", dtype=torch.bfloat16, progress=False, threads=3)
    assert_same_bits(got.cpu(), want)
