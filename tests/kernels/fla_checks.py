"""The checks the "fla" backends of the linear-attention ops (KDA, Gated DeltaNet) share, each the op on fla
against the same call on the reference op, within `tolerance` (relative Frobenius error):
    assert_fla_matches_reference      the (o, final state) forms (`*_chunk`, `*_recurrent`)
    assert_fla_slots_match_reference  the forms whose states live in a pool's slots (`*_recurrent_slots`,
                                      `*_chunk_varlen`), the reference on a copy of the pool; outputs and the
                                      named slots compared, every other slot untouched"""

from __future__ import annotations

import torch

from dayzero import ops
from dayzero.ops.registry import REGISTRY


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def assert_fla_matches_reference(name: str, args: tuple, tolerance: float = 3e-2) -> None:
    with REGISTRY.force_backend("reference"):
        o_ref, s_ref = getattr(ops, name)(*args)
    with REGISTRY.record_calls(by_backend=True) as calls:
        o, s = getattr(ops, name)(*args)
    assert calls == {f"{name}@fla": 1}
    assert o.dtype == args[0].dtype and s.dtype == torch.float32 and s.shape == s_ref.shape
    for got, want in ((o, o_ref), (s, s_ref)):
        assert rel(got, want) < tolerance, f"{name}: relative error {rel(got, want):.2e}"


def assert_fla_slots_match_reference(name: str, args: tuple, pool: torch.Tensor, slots: torch.Tensor,
                                     tolerance: float = 3e-2) -> None:
    """ops.<name>(*args, pool, slots) on fla against the reference on a copy of the pool."""
    want_pool = pool.clone()
    with REGISTRY.force_backend("reference"):
        want = getattr(ops, name)(*args, want_pool, slots)
    with REGISTRY.record_calls(by_backend=True) as calls:
        got = getattr(ops, name)(*args, pool, slots)
    assert calls == {f"{name}@fla": 1}
    for a, b in ((got, want), (pool[slots], want_pool[slots])):
        assert rel(a, b) < tolerance, f"{name}: relative error {rel(a, b):.2e}"
    others = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    others[slots] = False
    assert torch.equal(pool[others], want_pool[others])
