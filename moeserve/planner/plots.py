"""PNG plots of planner answers; matplotlib is imported only when a plot is asked for."""

from __future__ import annotations

from pathlib import Path

from moeserve.planner.cuda_graphs import GraphPlan
from moeserve.planner.decode_roofline import DecodeReport


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_decode(report: DecodeReport, path: str | Path, title: str) -> Path:
    """TPS/GPU against TPS/user, one curve per mode, each point labelled with its batch size."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    curves = [("no MTP", report.rows)]
    if report.mtp_rows and report.mtp is not None:
        curves.append((f"MTP {report.mtp.draft_tokens}, accept {report.mtp.accept_length}", report.mtp_rows))
    for label, rows in curves:
        xs = [p.tps_per_user for p in rows]
        ys = [p.tps_per_gpu for p in rows]
        ax.plot(xs, ys, marker="o", label=label)
        for p in rows:
            ax.annotate(str(p.batch_size), (p.tps_per_user, p.tps_per_gpu), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("TPS/user (tokens/s per request)")
    ax.set_ylabel("TPS/GPU (tokens/s per GPU)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    out = Path(path)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_graphs(plan: GraphPlan, curve: list[float], path: str | Path) -> Path:
    """Minimum expected padding (`curve[k-1]` for k graphs) against graph count, seed 003's sets marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.plot(list(range(1, len(curve) + 1)), curve, label="optimal set for the distribution")
    for s in plan.sets:
        ax.scatter([s.num_graphs], [s.expected_padding], zorder=3)
        ax.annotate(s.name, (s.num_graphs, s.expected_padding), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("CUDA graphs captured")
    ax.set_ylabel("expected padded slots per decode step")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_title(f"padding vs graph count, {plan.distribution.source}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    out = Path(path)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
