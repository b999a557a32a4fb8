"""``compare``: shmtree beside the other ways of doing an allreduce, in one run, size by size.

Methods (columns), each measured with the same protocol (``measure.py``), sizes, dtype and op:

- ``shmtree``: ``comm.allreduce`` in ``shmtree.run`` workers (``sweep.py``), which also measure
- ``shared`` (``--shared``): the call on shared arrays (``comm.empty``): ``allreduce(x,
  out=x)``, ``broadcast(x, 0, out=x)``, ``reduce(x, op, 0, out=x on the root)``,
  ``allgather(x, out=shared)``, ``reduce_scatter(shared x)``, and alltoall, gather, scatter,
  scan, exscan of shared inputs into private outputs: the single-copy paths;
- ``copy``: every process copying the same bytes at once, the memory-copy floor;
- ``numpy_shm`` and ``pipe``: the hand-written loops of ``baselines.py``;
- one MPI column per interpreter (``--mpi-python``, default this one) through ``mpi.py``;
- ``mpi_shared`` (``--shared``): for a fair comparison with ``shared``, one more column per
  interpreter: the same collective on the same layouts in MPI-3 shared memory
  (``MPI.Win.Allocate_shared``), the single copy written with numpy between two MPI_Barrier
  calls (``mpi_worker --shared``), since MPI's own functions do not know the memory is shared;
- ``gloo``: torch.distributed (``gloo.py``).

``--collective`` (``run_all(..., collective=...)``) measures broadcast, reduce, allgather,
reduce_scatter, alltoall, alltoallv (alltoall with counts=), gather, scatter, scan or exscan
instead of allreduce: shmtree's call (``sweep.collective_call``) beside MPI's
(``mpi_worker.FUNCTIONS``: Bcast, Reduce, Allgather, Reduce_scatter_block, Alltoall, Alltoallv,
Gather, Scatter, Scan, Exscan, root 0) and the copy of the
whole buffer; numpy-shm, pipe and gloo are allreduce loops and are not offered for the others.
A size is the whole buffer, as in nccl-tests (``measure.layout``): allgather's and gather's
result, reduce_scatter's and scatter's input, alltoall's input, of P blocks, so the rows'
``size`` and ``count`` are those of that buffer, rounded down to P whole blocks.  A shmtree
without the collective's call (``comm.alltoall`` & co. are newer than the bench's other
collectives) shows "n/a (...)" in its columns (``missing_call``) instead of failing.

Every column's processes are pinned one per core when there are enough usable cores (shmtree's
default; ``pin=None`` in the harness, for numpy-shm, pipe, gloo and a standalone copy;
``--bind-to core`` for MPI), and left unpinned otherwise.

A method that cannot run says why in its cells: "n/a (not installed)" when its package is
missing, "error: ..." when it failed (the other columns still run); the lines below the table
(and the JSON's ``methods``) add how to get it: for MPI, ``pip install "shmtree[mpi]"`` (mpi4py
and MPICH) or ``--mpi-python PATH`` of an interpreter that has an MPI.  Ratios: every baseline's
time over shmtree's (how many times slower than shmtree it is) and shmtree's over the copy's.
"""
import sys

import numpy as np

from . import baselines, copylimit, gloo, mpi, report, sweep
from .measure import COLLECTIVES, layout, whole_bytes
from .mpi_worker import FUNCTIONS, SHARED_FUNCTIONS
from .units import format_size

ALL_METHODS = ("shmtree", "shared", "copy", "numpy_shm", "pipe", "mpi", "mpi_shared", "gloo")
ALLREDUCE_ONLY = ("numpy_shm", "pipe", "gloo")   # hand-written allreduce loops, gloo's
SHARED_COLLECTIVES = COLLECTIVES      # every collective has a shared-array measurement
OPT_IN = ("shared", "mpi_shared")     # measured when asked for (compare --shared, --methods)
SHARED_TWINS = {"shmtree": "shared", "mpi": "mpi_shared"}   # a method and its shared arrays


def methods_for(collective):
    """The methods that can measure `collective`, in display order."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}")
    return tuple(m for m in ALL_METHODS
                 if (collective == "allreduce" or m not in ALLREDUCE_ONLY)
                 and (m not in OPT_IN or collective in SHARED_COLLECTIVES))  # (all of them)


def default_methods(collective, shared=False):
    """What compare measures unless --methods says: every method for the collective, less
    the opt-in ones (shared arrays: with --shared)."""
    return tuple(m for m in methods_for(collective) if m not in OPT_IN or shared)


def with_shared(methods, shared):
    """--methods as given, plus with --shared the shared-array twin of each method that has one
    (shmtree: shared, mpi: mpi_shared), right after it."""
    out = []
    for m in methods:
        out += [m] + ([SHARED_TWINS[m]] if shared and m in SHARED_TWINS else [])
    return list(dict.fromkeys(out))


LABELS = {"shmtree": "shmtree", "shared": "shmtree shared", "mpi_shared": "MPI shared",
          "copy": "copy",
          "numpy_shm": "numpy-shm", "pipe": "pipe", "gloo": "gloo"}


class Column:
    """One method's results: {size: summary}, or a status that says why there are none."""

    def __init__(self, key, label, times=None, status="ok", detail=None, hint=None):
        self.key, self.label, self.times = key, label, times or {}
        self.status, self.detail, self.hint = status, detail, hint

    def us(self, size):
        summary = self.times.get(size)
        return None if summary is None else summary["median_s"] * 1e6

    def meta(self):
        meta = {"label": self.label, "status": self.status, "detail": self.detail}
        if self.hint:
            meta["hint"] = self.hint
        return meta


CALLS = {"alltoallv": "alltoall"}     # the collectives measured through another's method
DETAILS = {"alltoallv": "comm.alltoall(counts=)"}


def missing_call(collective):
    """Why the installed shmtree cannot make `collective` (its Communicator has no such method:
    a shmtree older than the call), or None (also when shmtree cannot be imported: the
    measurement then says why)."""
    try:
        import shmtree
    except ImportError:
        return None
    name = CALLS.get(collective, collective)
    if hasattr(shmtree.Communicator, name):
        return None
    return f"n/a (no comm.{name} in shmtree {getattr(shmtree, '__version__', '?')})"


def _guarded(key, label, run):
    try:
        return Column(key, label, run())
    except Exception as exc:  # a baseline failing is a result to show, not a crash
        return Column(key, label, status=f"error: {type(exc).__name__}: {exc}")


def run_shmtree(sizes, nprocs, plan, options, collective="allreduce"):
    """(shmtree column, copy column) from one shmtree.run."""
    try:
        reason = missing_call(collective)
        if reason:
            return Column("shmtree", "shmtree", status=reason), None
        measured = sweep.run_sweep(sizes, nprocs, plan, options, with_copy=True,
                                   collective=collective)
    except Exception as exc:
        status = f"error: {type(exc).__name__}: {exc}"
        return Column("shmtree", "shmtree", status=status), None
    return (Column("shmtree", "shmtree", {s: m[collective] for s, m in measured.items()},
                   detail=DETAILS.get(collective, f"comm.{collective}")),
            Column("copy", "copy", {s: m["copy"] for s, m in measured.items()},
                   detail="measured in the shmtree workers"))


def run_copy(sizes, nprocs, plan, collective="allreduce"):
    """{size: summary} of the standalone concurrent copy of each size's whole buffer."""
    if collective == "allreduce":
        return copylimit.run_copy(sizes, nprocs, plan)
    whole = {s: whole_bytes(collective, s, plan.dtype, nprocs) for s in sizes}
    times = copylimit.run_copy(sorted(set(whole.values())), nprocs, plan)
    return {s: times[whole[s]] for s in sizes}


def run_mpi_columns(sizes, nprocs, plan, pythons, collective="allreduce", shared=False):
    """One column per interpreter: MPI's own function (keys mpi0, mpi1, ...) or, with
    `shared`, the single copy on MPI.Win.Allocate_shared memory (mpi_shared0, ...)."""
    columns = []
    prefix, suffix = ("mpi_shared", " shared") if shared else ("mpi", "")
    for k, python in enumerate(pythons):
        reason, hint = mpi.probe(python)
        if reason:
            columns.append(Column(f"{prefix}{k}", _mpi_label(python, suffix), status=reason,
                                  hint=hint))
            continue
        try:
            library, times = mpi.run_mpi(python, sizes, nprocs, plan, collective=collective,
                                         shared=shared)
        except Exception as exc:
            columns.append(Column(f"{prefix}{k}", _mpi_label(python, suffix),
                                  status=f"error: {type(exc).__name__}: {exc}"))
            continue
        label = mpi.short_name(library) + suffix
        how = (SHARED_FUNCTIONS[collective] + f" (as MPI_{FUNCTIONS[collective]})" if shared
               else f"MPI_{FUNCTIONS[collective]}")
        columns.append(Column(f"{prefix}{k}", label, times,
                              detail=f"{library}; {how}; python {python}"))
    return _unique_labels(columns)


def _mpi_label(python, suffix=""):
    return f"MPI{suffix}" if python == sys.executable else f"MPI{suffix} ({python})"


def _unique_labels(columns):
    seen = {}
    for col in columns:
        seen[col.label] = seen.get(col.label, 0) + 1
        if seen[col.label] > 1:
            col.label = f"{col.label} #{seen[col.label]}"
    return columns


def run_all(sizes, nprocs, plan, options, methods, pythons, progress, collective="allreduce"):
    """Every requested method's column, in display order."""
    refused = sorted(set(methods) - set(methods_for(collective)))
    if refused:
        raise ValueError(f"methods {refused} do not measure {collective}")
    columns, copy = [], None
    steps = [m for m in ALL_METHODS if m in methods]
    bar = report.Progress(len(steps), f"compare {collective}", progress)
    for method in steps:
        bar.step(sizes[-1], LABELS.get(method, method))
        if method == "shmtree":
            shm, copy = run_shmtree(sizes, nprocs, plan, options, collective)
            columns.append(shm)
        elif method == "shared" and missing_call(collective):
            columns.append(Column("shared", "shmtree shared", status=missing_call(collective)))
        elif method == "shared":
            columns.append(_guarded("shared", "shmtree shared",
                                    lambda: sweep.run_shared(sizes, nprocs, plan, options,
                                                             collective)))
        elif method == "copy":
            copy = copy or _guarded("copy", "copy",
                                    lambda: run_copy(sizes, nprocs, plan, collective))
        elif method == "numpy_shm":
            columns.append(_guarded("numpy_shm", "numpy-shm",
                                    lambda: baselines.run_numpy_shm(sizes, nprocs, plan)))
        elif method == "pipe":
            columns.append(_guarded("pipe", "pipe",
                                    lambda: baselines.run_pipe(sizes, nprocs, plan)))
        elif method == "mpi":
            columns.extend(run_mpi_columns(sizes, nprocs, plan, pythons, collective))
        elif method == "mpi_shared":
            columns.extend(run_mpi_columns(sizes, nprocs, plan, pythons, collective,
                                           shared=True))
        elif method == "gloo":
            reason = gloo.missing()
            columns.append(Column("gloo", "gloo", status=reason, hint=gloo.HINT) if reason else
                           _guarded("gloo", "gloo", lambda: gloo.run_gloo(sizes, nprocs, plan)))
    bar.done()
    if "copy" in methods and copy is None:  # shmtree failed: measure the copy on its own
        copy = _guarded("copy", "copy", lambda: run_copy(sizes, nprocs, plan, collective))
    return columns, copy


def rows(sizes, dtype, columns, copy, collective="allreduce", nprocs=1):
    """Flat JSON/CSV rows: <key>_us for every column, <key>_vs_shmtree, shmtree_vs_copy.
    size and count are the whole buffer's (measure.layout)."""
    shm = next((c for c in columns if c.key == "shmtree" and c.status == "ok"), None)
    out = []
    for size in sizes:
        count = max(layout(collective, size, dtype, nprocs))
        r = {"size": count * np.dtype(dtype).itemsize, "count": count}
        for col in everything(columns, copy):
            r[f"{col.key}_us"] = col.us(size)
            if shm and col is not shm and col is not copy and col.us(size) is not None:
                r[f"{col.key}_vs_shmtree"] = col.us(size) / shm.us(size)
        if shm and copy and copy.us(size) is not None and shm.us(size) is not None:
            r["shmtree_vs_copy"] = shm.us(size) / copy.us(size)
        out.append(r)
    return out


def text_table(sizes, columns, copy, table_rows):
    """Times in us; each baseline cell also shows (x baseline/shmtree)."""
    headers = ["size"] + [f"{c.label} (us)" for c in columns]
    if copy:
        headers += [f"{copy.label} (us)", "shmtree/copy"]
    lines = []
    for size, r in zip(sizes, table_rows):
        line = [format_size(r["size"])] + [_cell(c, r) for c in columns]
        if copy:
            line += [_cell(copy, r), report.fmt(r.get("shmtree_vs_copy"))]
        lines.append(line)
    return report.table(headers, lines)


def _cell(col, r):
    if col.status != "ok":
        return col.status if len(col.status) < 40 else col.status[:37] + "..."
    value = r.get(f"{col.key}_us")
    ratio = r.get(f"{col.key}_vs_shmtree")
    text = report.fmt(value)
    return f"{text} (x{report.fmt(ratio, 2)})" if ratio is not None else text


def problems(columns, copy):
    """Full status lines for the methods that did not run (cells may be shortened), each with
    how to get that method where there is a way."""
    return [f"{c.label}: {c.status}" + (f": {c.hint}" if c.hint else "")
            for c in everything(columns, copy) if c.status != "ok"]


def everything(columns, copy):
    """The method columns followed by the copy column, if there is one."""
    return columns + ([copy] if copy else [])
