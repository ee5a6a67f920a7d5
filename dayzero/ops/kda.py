"""Kimi Delta Attention (KDA, Kimi Linear arXiv 2510.26692): short convolutions, the forget gate,
the delta-rule recurrence in its chunked (prefill) and token-by-token (decode) forms, and the gated
RMSNorm on its output.

Per head, with q, k L2-normalised (dk channels) and v (dv channels), the state S [dk, dv] evolves as
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t
g_t [dk] is the per-channel log decay (<= 0) from `kda_gate`; beta_t a per-head scalar in (0, 1).
Equivalently: S' = Diag(exp(g_t)) S_{t-1};  u_t = beta_t (v_t - S'^T k_t);  S_t = S' + k_t u_t^T.

The state a request keeps between steps (vLLM's `kda_state_shape`):
    recurrent state   float32 [B, H, dk, dv]
    conv state        [B, D, K-1] per short convolution (q, k, v): its last K-1 inputs
Both fixed-size, whatever the sequence length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.ops.registry import reference_op

L2NORM_EPS = 1e-6  # FLA's l2norm: x / sqrt(sum x^2 + eps), the constant of the reference kernels


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


@reference_op("short_conv1d")
def short_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                 activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution over time, continuing from `state`.

    x [B, T, D]; weight [D, K] (channel d's taps, oldest input first: y[t] = sum_j w[d, j] *
    x[t - K + 1 + j]); state [B, D, K-1], the K-1 inputs before x (None: zeros, a fresh sequence).
    activation: "silu" or None. Computed in float32.
    Returns (y [B, T, D] in x.dtype, new state [B, D, K-1] in x.dtype: the last K-1 inputs)."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"short_conv1d: x must be [batch, tokens, channels] and weight [channels, kernel]; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    b, t, d = x.shape
    width = weight.shape[1] - 1
    if state is None:
        state = x.new_zeros(b, d, width)
    elif state.shape != (b, d, width):
        raise ValueError(f"short_conv1d: state must be [batch={b}, channels={d}, kernel-1={width}], got {tuple(state.shape)}")
    if activation not in ("silu", None):
        raise ValueError(f"short_conv1d: activation must be 'silu' or None, got {activation!r}")
    window = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=2)  # [B, D, K-1+T]
    y = F.conv1d(window.float(), weight.float()[:, None, :], groups=d)  # [B, D, T]
    if activation == "silu":
        y = F.silu(y)
    return y.transpose(1, 2).to(x.dtype), window[:, :, window.shape[2] - width:].contiguous()


@reference_op("short_conv1d_varlen")
def short_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, query_start: torch.Tensor,
                        state: torch.Tensor | None = None, activation: str | None = "silu"
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`short_conv1d` of B sequences packed in one row (a step's prompt chunks of different lengths).

    x [N, D] the sequences' tokens one after another; query_start int [B + 1] (device) where each starts;
    state [B, D, K-1] each sequence's K-1 inputs before its tokens (None: zeros). Every window is
    gathered at once (token t of a sequence reads its inputs t - K + 1 ... t, the ones before the
    sequence's first from its state): no loop over the sequences and no host synchronisation.
    Returns (y [N, D] in x.dtype, new states [B, D, K-1] in x.dtype)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"short_conv1d_varlen: x must be [tokens, channels] and weight [channels, kernel]; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if query_start.dim() != 1 or query_start.shape[0] < 2:
        raise ValueError(f"short_conv1d_varlen: query_start must be [batch + 1], got {tuple(query_start.shape)}")
    if activation not in ("silu", None):
        raise ValueError(f"short_conv1d_varlen: activation must be 'silu' or None, got {activation!r}")
    n, d = x.shape
    b, width = query_start.shape[0] - 1, weight.shape[1] - 1
    if state is None:
        state = x.new_zeros(b, d, width)
    elif state.shape != (b, d, width):
        raise ValueError(f"short_conv1d_varlen: state must be [batch={b}, channels={d}, kernel-1={width}], "
                         f"got {tuple(state.shape)}")
    starts = query_start.long()
    # rows of ext: every sequence's state (K-1 rows each, oldest first), then the packed tokens
    ext = torch.cat([state.to(x.dtype).transpose(1, 2).reshape(b * width, d), x])

    def rows(seq: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """ext rows of local times `local` [M, K'] (negative: the state's) of sequences `seq` [M]."""
        token = starts[seq][:, None] + local
        return torch.where(local >= 0, b * width + token, seq[:, None] * width + width + local)

    taps = torch.arange(width + 1, device=x.device)
    seq = torch.searchsorted(starts[1:], torch.arange(n, device=x.device), right=True)
    local = (torch.arange(n, device=x.device) - starts[seq])[:, None] - width + taps[None, :]  # [N, K]
    window = ext[rows(seq, local)].float()  # [N, K, D]
    y = (window * weight.float().t()[None]).sum(1)
    if activation == "silu":
        y = F.silu(y)
    every = torch.arange(b, device=x.device)
    last = (starts[1:] - starts[:-1])[:, None] - width + taps[None, :width]  # its last K-1 inputs
    new_state = ext[rows(every, last)].transpose(1, 2).contiguous()  # [B, D, K-1]
    return y.to(x.dtype), new_state


@reference_op("kda_gate")
def kda_gate(raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor | None = None,
             lower_bound: float | None = None) -> torch.Tensor:
    """Per-channel log decay g of KDA from the raw gate projection f_b(f_a(x)).

    raw [..., H, dk]; a_log [H] (checkpoint `A_log` [1, 1, H, 1] flattened); dt_bias [H, dk] or None.
        plain (Kimi Linear):        g = -exp(A_log) * softplus(raw + dt_bias)     (softplus linear past 20)
        lower-bounded (Kimi K3):    g = lower_bound * sigmoid(exp(A_log) * (raw + dt_bias))
    The bounded form is FLA's `safe_gate` (fla-org/flash-linear-attention chunk_kda `lower_bound`:
    "lower_bound * sigmoid(exp(A_log) * (g + dt_bias))", -5 <= lower_bound < 0; vLLM kda.py and
    llama.cpp's K3 port compute the same); it keeps g in (lower_bound, 0).
    Returns float32 [..., H, dk]; raw is cast to float32 before the bias is added."""
    if raw.dim() < 2:
        raise ValueError(f"kda_gate: raw must be [..., heads, head_dim], got {tuple(raw.shape)}")
    h, dk = raw.shape[-2:]
    if a_log.numel() != h:
        raise ValueError(f"kda_gate: A_log must hold one value per head ({h}), got shape {tuple(a_log.shape)}")
    x = raw.float()
    if dt_bias is not None:
        if dt_bias.numel() != h * dk:
            raise ValueError(f"kda_gate: dt_bias must be [{h}, {dk}] (heads x head_dim), got {tuple(dt_bias.shape)}")
        x = x + dt_bias.float().reshape(h, dk)
    a = a_log.float().reshape(h, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(x, beta=1.0, threshold=20.0)
    if not lower_bound < 0:
        raise ValueError(f"kda_gate: lower_bound must be negative, got {lower_bound}")
    return lower_bound * torch.sigmoid(a * x)


def _check_kda(q, k, v, g, beta, state, name: str) -> tuple[int, int, int, int, int]:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{name}: q and k must be [batch, tokens, heads, dk] and v [batch, tokens, heads, dv] with "
                         f"equal batch, tokens and heads; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if g.shape != q.shape:
        raise ValueError(f"{name}: g must be [batch, tokens, heads, dk] = {tuple(q.shape)}, got {tuple(g.shape)}")
    if beta.shape != (b, t, h):
        raise ValueError(f"{name}: beta must be [batch, tokens, heads] = {(b, t, h)}, got {tuple(beta.shape)}")
    if state is not None and (state.shape != (b, h, dk, dv) or state.dtype != torch.float32):
        raise ValueError(f"{name}: state must be float32 [batch, heads, dk, dv] = {(b, h, dk, dv)}, "
                         f"got {state.dtype} {tuple(state.shape)}")
    return b, t, h, dk, dv


def _prepare(q, k, v, g, beta, state, l2norm_qk: bool):
    """float32, heads before tokens: q, k, v, g [B, H, T, d], beta [B, H, T]; the state copied."""
    q, k, v, g = (x.float().transpose(1, 2) for x in (q, k, v, g))
    if l2norm_qk:
        q, k = _l2norm(q), _l2norm(k)
    b, h, _, dk = k.shape
    s = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=q.device) if state is None else state.clone()
    return q, k, v, g, beta.float().transpose(1, 2), s


@reference_op("kda_recurrent")
def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor | None = None, scale: float | None = None,
                  l2norm_qk: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA one token at a time (decode): the recurrence of the module docstring, step by step.

    q, k [B, T, H, dk]; v [B, T, H, dv]; g float [B, T, H, dk] log decay (`kda_gate`); beta [B, T, H]
    in (0, 1); state float32 [B, H, dk, dv] (None: zeros); scale: None means dk^-0.5; l2norm_qk:
    L2-normalise q and k per head first (as Kimi Linear does, in float32).
    Returns (o [B, T, H, dv] in q.dtype, final state float32 [B, H, dk, dv])."""
    _, t, _, dk, _ = _check_kda(q, k, v, g, beta, state, "kda_recurrent")
    scale = dk**-0.5 if scale is None else scale
    out_dtype = q.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state, l2norm_qk)
    o = torch.empty_like(v)
    for i in range(t):
        s = s * g[:, :, i].exp()[..., None]
        u = beta[:, :, i, None] * (v[:, :, i] - torch.einsum("bhk,bhkv->bhv", k[:, :, i], s))
        s = s + k[:, :, i, :, None] * u[:, :, None, :]
        o[:, :, i] = scale * torch.einsum("bhk,bhkv->bhv", q[:, :, i], s)
    return o.transpose(1, 2).to(out_dtype), s


@reference_op("kda_recurrent_slots")
def kda_recurrent_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        pool: torch.Tensor, slots: torch.Tensor, scale: float | None = None,
                        l2norm_qk: bool = True) -> torch.Tensor:
    """`kda_recurrent` of B requests whose states live in a state pool: request b continues from
    pool[slots[b]] and its final state is written back there, in place (a decode step updates its
    requests' slots without a gathered copy of their states).

    pool float32 [S, H, dk, dv]; slots int [B], distinct slot numbers < S; the rest as `kda_recurrent`.
    Returns o [B, T, H, dv] in q.dtype."""
    if pool.dim() != 4 or pool.dtype != torch.float32 or pool.shape[1:] != (q.shape[2], q.shape[3], v.shape[-1]):
        raise ValueError(f"kda_recurrent_slots: pool must be float32 [slots, heads, dk, dv] = [S, {q.shape[2]}, "
                         f"{q.shape[3]}, {v.shape[-1]}], got {pool.dtype} {tuple(pool.shape)}")
    if slots.dim() != 1 or slots.shape[0] != q.shape[0] or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kda_recurrent_slots: slots must be int [batch={q.shape[0]}], got {slots.dtype} "
                         f"{tuple(slots.shape)}")
    o, final = kda_recurrent(q, k, v, g, beta, pool[slots], scale, l2norm_qk)
    pool[slots] = final
    return o


@reference_op("kda_chunk")
def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor | None = None, scale: float | None = None, l2norm_qk: bool = True,
              chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over a whole prompt (prefill), chunk by chunk; the same function as `kda_recurrent`.

    Arguments and result as `kda_recurrent`; chunk_size: tokens per chunk (the last may be shorter).
    Within a chunk of L tokens starting from state S0, with G_t = sum_{s<=t} g_s (per channel) and
    D_ts = exp(G_t - G_s) for s <= t (each <= 1, so nothing overflows):
        u = (I + A)^-1 beta * (v - (exp(G) * k) S0),  A_ts = beta_t sum_c k_tc k_sc D_tsc for s < t
        o_t = scale * ((exp(G_t) * q_t) S0 + sum_{s<=t} (sum_c q_tc k_sc D_tsc) u_s)
        S_L = exp(G_L) * S0 + sum_s (exp(G_L - G_s) * k_s) u_s^T
    u_t is the delta-rule update beta_t (v_t - S'_t^T k_t) of token t; the unit lower-triangular
    system is solved exactly (a triangular solve), not by a truncated series."""
    _, t, _, dk, _ = _check_kda(q, k, v, g, beta, state, "kda_chunk")
    if chunk_size < 1:
        raise ValueError(f"kda_chunk: chunk_size must be >= 1, got {chunk_size}")
    scale = dk**-0.5 if scale is None else scale
    out_dtype = q.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state, l2norm_qk)
    o = torch.empty_like(v)
    for start in range(0, t, chunk_size):
        end = min(start + chunk_size, t)
        qc, kc, vc, bc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], beta[:, :, start:end]
        cum = g[:, :, start:end].cumsum(dim=2)  # G [B, H, L, dk]
        n = end - start
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        diff = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # G_t - G_s [B, H, L(t), L(s), dk]
        decay = diff.masked_fill(~causal[:, :, None], float("-inf")).exp()  # 0 where s > t
        kk = torch.einsum("bhtc,bhtsc,bhsc->bhts", kc, decay, kc)
        a = (bc[..., None] * kk).tril(diagonal=-1) + torch.eye(n, device=q.device)
        rhs = bc[..., None] * (vc - (kc * cum.exp()) @ s)
        u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        qk = torch.einsum("bhtc,bhtsc,bhsc->bhts", qc, decay, kc)
        o[:, :, start:end] = scale * ((qc * cum.exp()) @ s + qk @ u)
        last = cum[:, :, -1:]  # G_L [B, H, 1, dk]
        s = last.transpose(-1, -2).exp() * s + (kc * (last - cum).exp()).transpose(-1, -2) @ u
    return o.transpose(1, 2).to(out_dtype), s


@reference_op("kda_chunk_varlen")
def kda_chunk_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     query_start: torch.Tensor, query_start_host: tuple[int, ...], pool: torch.Tensor,
                     slots: torch.Tensor, scale: float | None = None, l2norm_qk: bool = True,
                     chunk_size: int = 64) -> torch.Tensor:
    """`kda_chunk` of B prompt chunks of different lengths packed in one row, each continuing from its
    request's state pool[slots[b]] and leaving its final state there (a step's prefills in one call).

    q, k [N, H, dk]; v [N, H, dv]; g float [N, H, dk]; beta [N, H]; query_start int [B + 1] on the
    device and query_start_host the same on the host; pool float32 [S, H, dk, dv]; slots int [B].
    The reference runs `kda_chunk` sequence by sequence. Returns o [N, H, dv] in q.dtype."""
    if q.dim() != 3 or len(query_start_host) != slots.shape[0] + 1 or query_start_host[-1] != q.shape[0]:
        raise ValueError(f"kda_chunk_varlen: q must be [tokens, heads, dk] with query_start_host ending at its "
                         f"{q.shape[0]} tokens, one slot a sequence; got q {tuple(q.shape)}, "
                         f"{len(query_start_host) - 1} sequences, {slots.shape[0]} slots")
    if pool.dim() != 4 or pool.dtype != torch.float32 or pool.shape[1:] != (q.shape[1], q.shape[2], v.shape[-1]):
        raise ValueError(f"kda_chunk_varlen: pool must be float32 [slots, heads, dk, dv] = [S, {q.shape[1]}, "
                         f"{q.shape[2]}, {v.shape[-1]}], got {pool.dtype} {tuple(pool.shape)}")
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for i, (a, e) in enumerate(zip(query_start_host, query_start_host[1:])):
        part = [t[a:e][None] for t in (q, k, v, g, beta)]
        out, final = kda_chunk(*part, pool[slots[i:i + 1]], scale, l2norm_qk, chunk_size)
        o[a:e] = out[0]
        pool[slots[i:i + 1]] = final
    return o


GATE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "silu": F.silu}


@reference_op("gated_rms_norm")
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                   activation: str = "sigmoid") -> torch.Tensor:
    """RMSNorm(x) * weight * act(gate) over the last dim, all in float32 (the weight is not cast
    down first, as FLA's FusedRMSNormGated), returned in x.dtype.

    x, gate [..., d]; weight [d] (KDA: `o_norm.weight`, one per head channel, shared by heads).
    activation: "sigmoid" (KDA) or "silu" (Gated DeltaNet's output gate, Qwen3.5)."""
    if gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} must equal x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)} be [{x.shape[-1]}]")
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"gated_rms_norm: activation must be one of {', '.join(GATE_ACTIVATIONS)}, got {activation!r}")
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * GATE_ACTIVATIONS[activation](gate.float())).to(x.dtype)
