"""PNG plots of the bench's results, when matplotlib is installed (it is never required).

``require()`` is called before any measurement when ``--plot`` is given, so a missing
matplotlib is reported at once with the command that installs it, not after a long sweep.  The
Agg backend is used (no display needed).  Files are written under a temporary name and renamed.
"""
import os

from .harness import BenchError
from .units import format_size

MISSING = "--plot needs matplotlib, which is not installed: pip install matplotlib " \
          "(or pip install 'shmtree[plot]')"


def require():
    """Import matplotlib with the Agg backend, or raise BenchError saying how to install it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError(MISSING) from None
    return plt


def _save(fig, path):
    tmp = f"{path}.tmp"
    try:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _size_axis(ax, sizes):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([format_size(s) for s in sizes], rotation=45, ha="right")
    ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.3)


def plot_sweep(path, rows, title):
    """Time and bus bandwidth against size, with the concurrent-copy time for reference."""
    plt = require()
    sizes = [r["size"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.loglog(sizes, [r["time_us"] for r in rows], "o-", label="shmtree allreduce")
    if all("copy_us" in r for r in rows):
        left.loglog(sizes, [r["copy_us"] for r in rows], "s--", label="concurrent copy")
    left.set_ylabel("time per call (us)")
    left.legend()
    right.plot(sizes, [r["busbw_gbs"] for r in rows], "o-", label="busbw")
    right.plot(sizes, [r["algbw_gbs"] for r in rows], "^:", label="algbw")
    right.set_ylabel("GB/s")
    right.legend()
    for ax in (left, right):
        _size_axis(ax, sizes)
    fig.suptitle(title)
    _save(fig, path)
    plt.close(fig)


def _time_lines(ax, sizes, series, ylabel):
    """Time against size on log-log axes, one line per label of {label: [time_us or None]}
    (missing points skipped)."""
    for label, times in series.items():
        points = [(s, t) for s, t in zip(sizes, times) if t is not None]
        if points:
            ax.loglog(*zip(*points), "o-", label=label)
    _size_axis(ax, sizes)
    ax.set_ylabel(ylabel)


def plot_compare(path, sizes, series, title):
    """Time against size, one line per method; series is {label: [time_us or None]}."""
    plt = require()
    fig, ax = plt.subplots(figsize=(8, 5))
    _time_lines(ax, sizes, series, "time per call (us)")
    ax.legend()
    ax.set_title(title)
    _save(fig, path)
    plt.close(fig)


def plot_numa(path, mat, sizes, series, title):
    """Left: the read-bandwidth matrix as a heatmap; right: allreduce time per knob."""
    plt = require()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    image = left.imshow(mat["read_gbs"], cmap="viridis")
    ticks = range(len(mat["nodes"]))
    left.set_xticks(ticks, [f"proc {n}" for n in mat["nodes"]])
    left.set_yticks(ticks, [f"mem {n}" for n in mat["nodes"]])
    for a in ticks:
        for b in ticks:
            left.text(b, a, f"{mat['read_gbs'][a][b]:.1f}", ha="center", va="center", color="w")
    fig.colorbar(image, ax=left, label="read GB/s")
    left.set_title(f"copy bandwidth, {format_size(mat['size'])}")
    _time_lines(right, sizes, series, "allreduce time per call (us)")
    right.legend(fontsize="small")
    fig.suptitle(title)
    _save(fig, path)
    plt.close(fig)
