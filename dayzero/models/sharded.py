"""Modules split over tensor-parallel ranks (dayzero.parallel): each rank holds its slice of the weight as
shipped and the loader reads only that slice (`WeightTarget.shard`). At tensor-parallel size 1 each is
the plain module of dayzero/models/layers.py, with the same checkpoint names.

    ColumnLinear     output features split: rank r holds rows [r * out / tp, (r + 1) * out / tp) of W
                     (and of the bias); its output is its share of the features (gather=True: all of
                     them, gathered in rank order, as the lm_head does)
    RowLinear        input features split: rank r holds columns [r * in / tp, ...) of W and reads its
                     share of x; the partial products are summed over ranks (all-reduce), the bias added
                     once after
    VocabEmbedding   vocabulary rows split: each rank looks up the ids in its range, zeros elsewhere, and
                     the rows are summed over ranks
    ExpertShard      the routed experts [start, stop) an expert-parallel rank holds (dim 0 of every stacked
                     expert tensor) and `run`, which gets every token its routed output over the ranks
                     holding the others (dayzero/parallel/dispatch.py: all-reduce or all-to-all)

FP8 block-scaled weights split on whole scale blocks: a rank's share of the split dimension must be a
multiple of the block (else the error names the projection and the sizes).
"""

from __future__ import annotations

import torch

from dayzero import ops
from dayzero.models.base import WeightTarget, collect_weight_targets
from dayzero.models.layers import Embedding, Linear
from dayzero.parallel import comm
from dayzero.parallel.dispatch import run_experts
from dayzero.parallel.state import Parallel, current
from dayzero.weights import FLOAT_DTYPES, TensorSpec
from dayzero.weights.values import SCALES, ValueCheck


def shard_target(param: torch.Tensor, full_shape: tuple[int, ...], dim: int, start: int, stop: int,
                 check: ValueCheck | None = None) -> WeightTarget:
    """A target holding [start, stop) along dim of a stored tensor of full_shape, copied into param; check:
    what its values may not be (dayzero/weights/values.py)."""
    spec = TensorSpec(tuple(full_shape), FLOAT_DTYPES if param.dtype in FLOAT_DTYPES else param.dtype)

    def assign(tensor: torch.Tensor) -> None:
        with torch.no_grad():
            param.copy_(tensor)

    return WeightTarget(spec, assign, shard=(dim, start, stop), check=check)


class _Sharded:
    """What ColumnLinear and RowLinear share: the split dimension of W (0 rows, 1 columns) and its range."""

    dim: int

    def _split(self, full: int, p: Parallel, name: str) -> tuple[int, int]:
        start, stop = p.split(full, f"{name}: {'out' if self.dim == 0 else 'in'}_features")
        if p.tp_size > 1 and self.fmt == "fp8" and (stop - start) % self.block[self.dim]:
            raise ValueError(f"{name}: a rank's {stop - start} {'rows' if self.dim == 0 else 'columns'} are not whole "
                             f"FP8 scale blocks of {self.block[self.dim]}; choose a --tp that keeps them whole")
        return start, stop

    def _targets(self, prefix: str, full_in: int, full_out: int, bias_split: bool) -> dict[str, WeightTarget]:
        if self.parallel.tp_size == 1:
            return Linear.weight_targets(self, prefix)
        d, (start, stop) = self.dim, self.range
        full = (full_out, full_in)
        targets = {prefix + "weight": shard_target(self.weight, full, d, start, stop)}
        if self.fmt == "fp8":
            b = self.block[d]
            scale = getattr(self, self.scale_name)
            grid = (-(-full_out // self.block[0]), -(-full_in // self.block[1]))
            targets[prefix + self.scale_name] = shard_target(scale, grid, d, start // b, stop // b, check=SCALES)
        if self.bias is not None:
            targets[prefix + "bias"] = (shard_target(self.bias, (full_out,), 0, start, stop) if bias_split
                                        else shard_target(self.bias, (full_out,), 0, 0, full_out))
        return targets


class ColumnLinear(_Sharded, Linear):
    dim = 0

    def __init__(self, in_features: int, out_features: int, *, gather: bool = False, name: str = "projection",
                 parallel: Parallel | None = None, **kwargs):
        p = parallel or current()
        self.parallel, self.fmt, self.block = p, kwargs.get("fmt", "bf16"), tuple(kwargs.get("block", (128, 128)))
        self.range = self._split(out_features, p, name)
        super().__init__(in_features, self.range[1] - self.range[0], **kwargs)
        self.full_out, self.gather = out_features, gather

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return self._targets(prefix, self.in_features, self.full_out, bias_split=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return comm.all_gather(y, dim=-1) if self.gather else y


class RowLinear(_Sharded, Linear):
    dim = 1

    def __init__(self, in_features: int, out_features: int, *, name: str = "projection",
                 parallel: Parallel | None = None, **kwargs):
        p = parallel or current()
        self.parallel, self.fmt, self.block = p, kwargs.get("fmt", "bf16"), tuple(kwargs.get("block", (128, 128)))
        self.range = self._split(in_features, p, name)
        super().__init__(self.range[1] - self.range[0], out_features, **kwargs)
        self.full_in = in_features

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return self._targets(prefix, self.full_in, self.out_features, bias_split=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in / tp] (this rank's share of the features) -> [N, out], summed over ranks."""
        if self.parallel.tp_group is None:
            return super().forward(x)
        if self.parallel.tp_size == 1:  # a group of one: the unsplit kernels (bias inside the matmul), then the sum
            return comm.all_reduce(super().forward(x))
        if self.fmt == "fp8":
            y = ops.linear_fp8_block(x, self.weight, getattr(self, self.scale_name), None, self.block)
        else:
            y = ops.linear(x, self.weight, None)
        y = comm.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabEmbedding(Embedding):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype = torch.float32, device=None,
                 parallel: Parallel | None = None):
        self.parallel = p = parallel or current()
        self.range = p.split(vocab, "vocab_size")
        super().__init__(self.range[1] - self.range[0], dim, dtype, device)
        self.full_vocab = vocab

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        if self.parallel.tp_size == 1:
            return collect_weight_targets(self, prefix)
        start, stop = self.range
        return {prefix + "weight": shard_target(self.weight, (self.full_vocab, self.weight.shape[1]), 0, start, stop)}

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_group is None:
            return super().forward(token_ids)
        start, stop = self.range
        mine = (token_ids >= start) & (token_ids < stop)
        rows = ops.embedding(torch.where(mine, token_ids - start, 0), self.weight)
        return comm.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))


class ExpertShard:
    def __init__(self, num: int, parallel: Parallel | None = None):
        self.parallel = p = parallel or current()
        self.num = num
        self.start, self.stop = p.split_experts(num)

    @property
    def num_local(self) -> int:
        return self.stop - self.start

    def target(self, param: torch.Tensor, full_shape: tuple[int, ...], convert=lambda t: t,
               check: ValueCheck | None = None) -> WeightTarget:
        """param's target: experts [start, stop) of the stored [num, ...] tensor, converted by `convert`;
        check: what its stored values may not be."""
        dtype = FLOAT_DTYPES if param.dtype in FLOAT_DTYPES else param.dtype

        def assign(tensor: torch.Tensor) -> None:
            with torch.no_grad():
                param.copy_(convert(tensor))

        shard = None if self.parallel.ep_size == 1 else (0, self.start, self.stop)
        return WeightTarget(TensorSpec(tuple(full_shape), dtype), assign, shard=shard, check=check)

    def run(self, op, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *args) -> torch.Tensor:
        """x [T, H], the model's top-k ids / weights [T, k] -> sum_k weights * expert(x) [T, H], every token's,
        the experts' op `op(x, local ids, weights, *args)` running over this rank's experts."""
        return run_experts(self.parallel, self.start, self.num_local, op, x, ids, weights, *args)


def other_ranks_experts(num: int, parallel: Parallel | None = None, where: str = r"\.experts\.") -> tuple[str, ...]:
    """The loader's ignore pattern for the per-expert tensors (`{where}{j}.`) other expert-parallel ranks hold
    (none in a job of one)."""
    p = parallel or current()
    if p.ep_size == 1:
        return ()
    start, stop = p.split_experts(num)
    return (rf"{where}(?:{'|'.join(str(j) for j in range(num) if not start <= j < stop)})\.",)
