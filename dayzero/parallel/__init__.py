"""Tensor and expert parallelism over torch.distributed: one process per device, NCCL on GPUs and gloo on
the CPU, no transport of our own.

    state.py   this process's place in the job (`Parallel`: tensor- and expert-parallel ranks and sizes,
               their process groups), set once per process by `init_process`; `current()` elsewhere
    comm.py    the collectives the model files call (all-reduce, all-gather over the tensor-parallel
               group; the experts' all-reduce; broadcast of a step's host objects from rank 0), no-ops
               where a group is one process
    dispatch.py  how the routed experts' tokens cross the expert-parallel ranks: all-reduce or all-to-all
    spec.py    a rank's share of a ModelSpec (its attention heads), from which its cache is planned

The sharded modules (column / row parallel projections, vocabulary-parallel embedding and lm_head) are
model code: dayzero/models/sharded.py. Weight loading reads only a rank's slice of each sharded tensor
(dayzero.weights.fill, `WeightTarget.shard`).
"""

from dayzero.parallel.state import Parallel, current, init_process, shutdown

__all__ = ["Parallel", "current", "init_process", "shutdown"]
