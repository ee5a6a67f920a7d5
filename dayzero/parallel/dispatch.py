"""How tokens reach the routed experts of an expert-parallel job, and their outputs come back.

The ranks of one expert-parallel group (`Parallel.ep_group`: the same tensor-parallel rank in every ep
group) all hold every token of the step (attention is replicated over the ep groups) and the experts
[start, start + n) of their ep rank. `run_experts(op, x, ids, weights, ...)` returns, on every rank, the
routed output of every token: sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), the experts' op being
`op(x, local_ids, weights, *args)` over this rank's experts. Two ways (`Parallel.expert_dispatch`):

    all_reduce   every rank runs its experts on every token, a slot routed to another rank's expert
                 becoming local expert 0 with weight 0, and the outputs are summed over the group (one
                 all-reduce of [T, H]; what vLLM and SGLang do for expert parallelism without
                 data-parallel attention). No host sync: decode steps capture as CUDA graphs.
    all_to_all   each rank owns a contiguous share of the tokens (rank j: [j c, (j + 1) c), c = ceil(T /
                 ep)) and sends each (token, slot) pair of its share to the rank holding that expert
                 (all_to_all_single, the counts exchanged first); a rank runs its experts only on the pairs
                 it receives, each one expert with weight 1; the outputs go back the same way, the owner
                 weights and sums its tokens' slots (in float32), and the shares are gathered so that
                 every rank has every token again. Each pair is computed once, on its expert's rank (the
                 all-reduce's ranks also run every other rank's pairs through their expert 0 at weight
                 0). The split sizes reach the host (one sync per layer), so decode steps run eagerly.
                 With data-parallel attention (not built) the final gather is what goes away.

The two agree to float32 rounding (all_to_all rounds each expert's output to the model's dtype before
the weighted sum: bf16 results differ in the last bits).
"""

from __future__ import annotations

import torch

from dayzero.parallel import comm
from dayzero.parallel.state import Parallel


def run_experts(p: Parallel, start: int, num_local: int, op, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, *args) -> torch.Tensor:
    """x [T, H], ids / weights [T, k] (the model's expert ids; rank r's experts are [r n, (r + 1) n) with
    n = num_local, this rank's from `start`) -> [T, H], every token's routed output, on every rank."""
    if p.ep_size == 1:  # every expert here (a joined job of one still runs its all-reduce, to measure it)
        return comm.all_reduce_experts(op(x, ids, weights, *args))
    if p.expert_dispatch == "all_to_all" and p.ep_group is not None:
        return _all_to_all(p, start, num_local, op, x, ids, weights, *args)
    mine = (ids >= start) & (ids < start + num_local)
    return comm.all_reduce_experts(op(x, torch.where(mine, ids - start, 0), torch.where(mine, weights, 0), *args))


def cuda_graph_blocker(p: Parallel) -> str | None:
    """Why a step of this job cannot be captured as a CUDA graph, or None."""
    if p.ep_size > 1 and p.expert_dispatch == "all_to_all":
        return "the all-to-all expert dispatch sizes its messages on the host (--expert-dispatch all_to_all)"
    return None


def _all_to_all(p: Parallel, start: int, num_local: int, op, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, *args) -> torch.Tensor:
    ep, t, k = p.ep_size, ids.shape[0], ids.shape[1]
    share = -(-t // ep)
    lo, hi = min(p.ep_rank * share, t), min((p.ep_rank + 1) * share, t)
    pair_ids = ids[lo:hi].reshape(-1)  # this rank's tokens' (token, slot) pairs, token-major
    dest = torch.div(pair_ids, num_local, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)  # pairs grouped by the rank holding their expert
    send = torch.bincount(dest, minlength=ep)
    recv = comm.all_to_all_experts(send)
    send_splits, recv_splits = send.tolist(), recv.tolist()  # the one host sync
    token = torch.arange(lo, hi, device=x.device).repeat_interleave(k)[order]
    got_x = comm.all_to_all_experts(x[token], recv_splits, send_splits)
    got_ids = comm.all_to_all_experts(pair_ids[order], recv_splits, send_splits) - start
    if got_x.shape[0]:
        ones = torch.ones((got_x.shape[0], 1), dtype=weights.dtype, device=weights.device)
        y = op(got_x, got_ids.view(-1, 1), ones, *args)
    else:  # no pair of any rank's share routed here
        y = got_x
    back = comm.all_to_all_experts(y, send_splits, recv_splits)
    pairs = torch.empty_like(back)
    pairs[order] = back
    out = (pairs.view(hi - lo, k, x.shape[1]).float() * weights[lo:hi, :, None].float()).sum(1).to(x.dtype)
    padded = out.new_zeros((share, x.shape[1]))
    padded[:hi - lo] = out
    return comm.all_gather_experts(padded)[:t]
