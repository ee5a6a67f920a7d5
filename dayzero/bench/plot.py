"""The PNG beside the JSON: throughput and latency against concurrency (matplotlib, Agg backend, so
no display is needed). matplotlib is optional (`pip install "dayzero[bench]"`); require_matplotlib()
says so before a run starts rather than after it."""

from __future__ import annotations

from pathlib import Path

PLOT_DPI = 100


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--output-file also writes a PNG plot, which needs matplotlib: pip install matplotlib "
                         '(or pip install "dayzero[bench]")') from None


def write_plot(path: Path, runs: list[dict], baseline: list[dict] | None = None, title: str = "") -> None:
    """runs: RunResult.summary() per level; baseline: BaselineResult.summary() per level, or None.
    x: the level's concurrency (its max_concurrency, or the request count when unset)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    x = [r["max_concurrency"] or r["completed"] + r["failed"] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(x, [r["output_throughput"] for r in runs], "o-", label="output tok/s")
    left.plot(x, [r["total_token_throughput"] for r in runs], "s--", label="total tok/s")
    if baseline:
        left.plot(x, [b["output_throughput"] for b in baseline], "^:", label="transformers output tok/s")
    left.set_ylabel("tokens / s")
    left.set_title("throughput")
    for stat, metric, style in (("median", "ttft", "o-"), ("p99", "ttft", "o:"), ("median", "tpot", "s-"),
                                ("median", "itl", "^-"), ("p99", "itl", "^:")):
        points = [(c, r[f"{stat}_{metric}_ms"]) for c, r in zip(x, runs) if r[f"{stat}_{metric}_ms"] is not None]
        if points:
            right.plot(*zip(*points), style, label=f"{stat} {metric.upper()}")
    right.set_ylabel("ms")
    right.set_title("latency")
    for ax in (left, right):
        ax.set_xlabel("max concurrency")
        if len(set(x)) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(x)), [str(c) for c in sorted(set(x))])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
