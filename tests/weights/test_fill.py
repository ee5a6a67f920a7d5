"""fill_targets: reader threads over byte ranges, each tensor read once into its target.

Targets here are plain objects (what dayzero.models.base.WeightTarget is to the filler): `dest` for
the tensors read straight into memory, `assign` for the ones that are converted."""

import os
import threading
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from safetensors.torch import save_file

import dayzero.weights.fill as fill
from dayzero import settings
from dayzero.weights import Checkpoint, CorruptCheckpointError, MissingTensorError, fill_targets
from tests.weights.test_checkpoint import write_sharded
from tests.weights.test_header import random_tensor, same_bits


@dataclass
class Target:
    assign: Callable[[torch.Tensor], None]
    dest: torch.Tensor | None = None


def direct(param: torch.Tensor) -> Target:
    def refuse(t):
        raise AssertionError("assign called for a tensor that fits its dest")
    return Target(refuse, param)


def converted(param: torch.Tensor, convert=lambda t: t, calls=None) -> Target:
    def assign(t):
        if calls is not None:
            calls.append(threading.get_ident())
        param.copy_(convert(t))
    return Target(assign)


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(300, 64, generator=g).bfloat16(),  # 37.5 KiB: cut into pieces below
        "norm.weight": torch.randn(64, generator=g),
        "experts.blocks": torch.randint(-128, 128, (8, 64, 16), generator=g, dtype=torch.int8),
        "experts.scales": random_tensor(torch.float8_e8m0fnu, (8, 64, 2)),
        "dense.weight": random_tensor(torch.float8_e4m3fn, (128, 64)),
        "dense.scale": torch.rand(1, 1, generator=g),
    }


@pytest.fixture
def sharded(tmp_path, tensors):
    names = list(tensors)
    write_sharded(tmp_path, {f"model-0000{i}-of-00003.safetensors": {n: tensors[n] for n in names[i::3]}
                             for i in range(3)})
    return tmp_path


def model_params(tensors):
    """Fresh parameters: packed bytes as uint8, float weights bf16 (the norm casts from float32)."""
    return {
        "embed.weight": torch.empty(300, 64, dtype=torch.bfloat16),
        "norm.weight": torch.empty(64, dtype=torch.bfloat16),
        "experts.blocks": torch.empty(8, 64, 2, 8, dtype=torch.uint8),
        "experts.scales": torch.empty(8, 64, 2, dtype=torch.uint8),
        "dense.weight": torch.empty(128, 64, dtype=torch.float8_e4m3fn),
        "dense.scale": torch.empty(1, 1),
    }


def model_targets(params):
    """Every tensor read straight into its parameter except the norm: float32 -> bf16 goes through assign."""
    targets = {name: direct(p) for name, p in params.items() if name != "norm.weight"}
    targets["norm.weight"] = converted(params["norm.weight"])
    return targets


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("piece_bytes", [1000, 1 << 20])
def test_every_tensor_lands_bit_for_bit(sharded, tensors, threads, piece_bytes):
    params = model_params(tensors)
    targets = model_targets(params)
    summary = fill_targets(Checkpoint.open(sharded), targets, device="cpu", threads=threads,
                           piece_bytes=piece_bytes, progress=False)
    for name, t in tensors.items():
        want = t.bfloat16() if name == "norm.weight" else t
        got = params[name]
        assert same_bits(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    assert summary.num_tensors == len(tensors) and summary.num_files == 3
    assert summary.total_bytes == Checkpoint.open(sharded).total_bytes
    assert summary.threads == min(threads, len(fill._work_items(
        sorted(Checkpoint.open(sharded).tensors.values(), key=lambda i: (str(i.file), i.start)),
        targets, piece_bytes)))


def test_large_tensors_are_cut_into_pieces_in_file_order(sharded, tensors):
    checkpoint = Checkpoint.open(sharded)
    params = model_params(tensors)
    targets = model_targets(params)
    infos = sorted(checkpoint.tensors.values(), key=lambda i: (str(i.file), i.start))
    items = fill._work_items(infos, targets, 1000)
    reads = [r for item in items for r in item]
    embed = [r for r in reads if r.info.name == "embed.weight"]
    assert len(embed) == -(-300 * 64 * 2 // 1000) and all(len(item) == 1 for item in items if item[0] in embed)
    assert [(r.lo, r.hi) for r in embed] == [(lo, min(lo + 1000, 300 * 64 * 2)) for lo in range(0, 38400, 1000)]
    assert [r.info.name for r in reads if r.lo == 0] == [i.name for i in infos]  # every tensor once, in file order
    assert all(len({r.info.file for r in item}) == 1 for item in items)  # an item never spans files
    assert not next(r for r in reads if r.info.name == "norm.weight").direct
    assert next(r for r in reads if r.info.name == "experts.blocks").direct  # int8 into uint8: the same bytes


def test_assign_gets_the_stored_tensor_on_the_device(sharded, tensors):
    seen = {}

    def recorder(name):
        return Target(lambda t: seen.__setitem__(name, t.clone()))  # a copy: the loader reuses its buffer

    fill_targets(Checkpoint.open(sharded), {n: recorder(n) for n in tensors}, device="cpu", threads=2, progress=False)
    assert seen.keys() == tensors.keys()
    for name, t in tensors.items():
        assert same_bits(seen[name], t) and seen[name].device.type == "cpu", name


def test_a_dest_that_does_not_fit_goes_through_assign(sharded, tensors):
    params = model_params(tensors)
    calls = []

    def through_assign(name, dest, param):
        return Target(lambda t: (calls.append(name), param.copy_(t)), dest)

    fp16 = torch.empty(300, 64, dtype=torch.float16)  # bf16 bytes are never taken as another float format
    strided = torch.empty(64, 128, dtype=torch.float8_e4m3fn).t()  # not contiguous
    targets = {name: direct(p) for name, p in params.items()}
    targets["embed.weight"] = through_assign("embed", fp16, fp16)
    targets["norm.weight"] = through_assign("norm", torch.empty(256, dtype=torch.uint8), params["norm.weight"])
    targets["dense.weight"] = through_assign("dense", strided, strided)
    fill_targets(Checkpoint.open(sharded), targets, device="cpu", threads=2, progress=False)
    assert sorted(calls) == ["dense", "embed", "norm"]
    assert torch.equal(fp16, tensors["embed.weight"].half())
    assert same_bits(params["norm.weight"], tensors["norm.weight"].bfloat16())
    assert same_bits(strided.contiguous(), tensors["dense.weight"])


def test_assign_converts_in_the_reading_threads(sharded, tensors):
    params = model_params(tensors)
    calls = []
    interleave = lambda t: torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)  # noqa: E731 (gpt-oss's gate/up rows)
    def packed(p):  # single-byte packed data: the same bytes under the parameter's dtype and shape
        return lambda t: t.view(p.dtype).reshape(p.shape) if p.element_size() == 1 else t

    targets = {name: converted(p, packed(p), calls) for name, p in params.items()}
    targets["embed.weight"] = converted(params["embed.weight"], interleave, calls)
    fill_targets(Checkpoint.open(sharded), targets, device="cpu", threads=3, progress=False)
    assert torch.equal(params["embed.weight"], interleave(tensors["embed.weight"]))
    assert same_bits(params["experts.scales"], tensors["experts.scales"].view(torch.uint8))
    assert threading.get_ident() not in calls and len(calls) == len(tensors)


def test_the_default_thread_count_is_the_setting(sharded, tensors):
    params = model_params(tensors)
    with settings.override(load_threads=1):
        one = fill_targets(Checkpoint.open(sharded), model_targets(params), device="cpu", piece_bytes=1000,
                           progress=False)
    with settings.override(load_threads=0):
        auto = fill.resolve_threads(None)
    assert one.threads == 1 and auto == min(fill.MAX_AUTO_THREADS, os.cpu_count())
    with pytest.raises(ValueError, match="load threads must be >= 0"):
        fill.resolve_threads(-1)


def test_a_missing_tensor_is_named(sharded, tensors):
    params = model_params(tensors)
    targets = {n: direct(p) for n, p in params.items()}
    targets["lm_head.weight"] = direct(torch.empty(3))
    with pytest.raises(MissingTensorError, match="lm_head.weight") as info:
        fill_targets(Checkpoint.open(sharded), targets, device="cpu", progress=False)
    assert info.value.tensor == "lm_head.weight"


@pytest.mark.parametrize("threads", [1, 3])
def test_a_shard_truncated_after_opening_names_file_and_tensor(sharded, tensors, threads):
    checkpoint = Checkpoint.open(sharded)
    last = max(checkpoint.tensors.values(), key=lambda i: (str(i.file), i.end))
    last.file.write_bytes(last.file.read_bytes()[:-10])
    params = model_params(tensors)
    targets = model_targets(params)
    with pytest.raises(CorruptCheckpointError, match="truncated after opening") as info:
        fill_targets(checkpoint, targets, device="cpu", threads=threads, piece_bytes=1000, progress=False)
    assert info.value.file == last.file and info.value.tensor == last.name
    assert str(last.file) in str(info.value)


def test_no_progress_bar_without_tty(sharded, tensors, capsys):
    params = model_params(tensors)
    targets = model_targets(params)
    fill_targets(Checkpoint.open(sharded), targets, device="cpu", progress=True)
    assert capsys.readouterr().err == ""


def test_one_file_two_threads(tmp_path, tensors):
    """A single file is read by several threads too (pieces at different offsets of one descriptor)."""
    save_file(tensors, tmp_path / "model.safetensors")
    params = model_params(tensors)
    targets = model_targets(params)
    summary = fill_targets(Checkpoint.open(tmp_path), targets, device="cpu", threads=2, piece_bytes=512, progress=False)
    assert summary.threads == 2 and summary.num_files == 1
    assert same_bits(params["embed.weight"], tensors["embed.weight"])
    assert same_bits(params["dense.weight"], tensors["dense.weight"])


@dataclass
class ShardTarget:
    assign: Callable[[torch.Tensor], None]
    shard: tuple[int, int, int]
    dest: torch.Tensor | None = None


@pytest.mark.parametrize("threads", [1, 3])
def test_a_shard_reads_only_its_slice_along_any_dim(sharded, tensors, threads):
    """A tensor-parallel rank's targets: random slices along dims 0, 1 and 2 (packed and float dtypes);
    each assign gets exactly the stored tensor's slice, and the bytes read are the slices' alone."""
    import random

    rng = random.Random(threads)
    checkpoint = Checkpoint.open(sharded)
    got, want, targets, expected_bytes = {}, {}, {}, 0
    for name, t in tensors.items():
        if t.dim() == 0 or name == "dense.scale":
            continue
        dim = rng.randrange(t.dim())
        start = rng.randrange(t.shape[dim])
        stop = rng.randint(start + 1, t.shape[dim])
        want[name] = t.narrow(dim, start, stop - start)
        targets[name] = ShardTarget(lambda x, n=name: got.__setitem__(n, x.clone()), (dim, start, stop))
        expected_bytes += want[name].numel() * want[name].element_size()
    summary = fill_targets(checkpoint, targets, device="cpu", threads=threads, progress=False)
    assert set(got) == set(want)
    for name in want:
        assert same_bits(got[name], want[name]), name
    assert summary.total_bytes == expected_bytes


def test_a_shard_outside_the_tensor_is_named(sharded, tensors):
    checkpoint = Checkpoint.open(sharded)
    target = ShardTarget(lambda x: None, (1, 60, 70))
    with pytest.raises(ValueError, match=r"embed\.weight.*\[60, 70\) along dim 1"):
        fill_targets(checkpoint, {"embed.weight": target}, device="cpu", threads=1, progress=False)
