"""``scaling``: shmtree beside MPI over process counts, collectives, sizes and array kinds.

For every P in ``--nprocs`` (default 2, 4, 8, 16: those up to ``--max-procs``, by default the
usable cores, at least 2; P given with ``--nprocs`` are all measured, oversubscribed if need
be) and every collective in ``--collectives`` (default all eleven, less those the installed
shmtree has no call for: ``compare.missing_call``), one ``compare.run_all`` of
the methods ``shmtree``, ``shared``, ``mpi`` and ``mpi_shared``: the same measurements as
``shmtree-bench compare --collective C --shared --methods shmtree,mpi -n P`` (same protocol,
``measure.py``; same layouts, ``measure.layout``: a size is the whole buffer; root 0).  Each
row is one (P, collective, size, arrays) cell:

- ``private``: the call on numpy arrays (``comm.<collective>``) beside MPI's own function
  (``MPI_Allreduce``, ``MPI_Bcast``, ``MPI_Reduce``, ``MPI_Allgather``,
  ``MPI_Reduce_scatter_block``, ``MPI_Alltoall``, ``MPI_Alltoallv`` (``alltoallv``:
  ``comm.alltoall(counts=)``), ``MPI_Gather``, ``MPI_Scatter``, ``MPI_Scan``, ``MPI_Exscan``);
- ``shared``: the call on shmtree's shared arrays (``comm.empty``, the single-copy paths)
  beside the single copy on MPI-3 shared memory (``MPI.Win.Allocate_shared``,
  ``mpi_worker --shared``).

Columns: shmtree's time, MPI's time, and MPI/shmtree (how many times slower than shmtree MPI
is, compare's convention).  MPI is probed once (``mpi.probe``): without it the header says so and
why, the MPI cells read "n/a" and shmtree's numbers are still measured and printed.  A method
that fails in one cell says so in that cell ("error") and in a line below the table.

``--quick`` (``--short``): about ``QUICK_TARGET_S`` s of timed calls per cell instead of
``TARGET_S`` (unless ``--time`` or ``--iters`` say otherwise): ``shmtree-bench scaling --nprocs
2 --sizes 8,32K --quick`` takes seconds.
"""
import sys

import numpy as np

from . import compare, machine, mpi, report
from .commands import (QUICK_TARGET_S, options_of, plan_of, progress_of, round_sizes,
                       shmtree_failure, usable, write_outputs)
from .harness import BenchError
from .measure import COLLECTIVES, MOVES_ONLY, layout
from .mpi_worker import FUNCTIONS
from .units import format_size

DEFAULT_NPROCS = (2, 4, 8, 16)
DEFAULT_SIZES = "8,32K,2M,16M"
ARRAYS = {"private": ("shmtree", "mpi0"), "shared": ("shared", "mpi_shared0")}  # column keys
COLUMNS = {
    "nprocs": "processes (P)", "collective": "the collective, root 0",
    "size": "message bytes (the whole buffer, as in nccl-tests)", "count": "elements",
    "arrays": "private (numpy arrays; MPI's own function) or shared (comm.empty; the single "
              "copy on MPI_Win_allocate_shared memory)",
    "shmtree_us": "shmtree: max over ranks of the median time per call",
    "mpi_us": "MPI: the same, same layouts (None: not measured)",
    "mpi_vs_shmtree": "mpi_us / shmtree_us (> 1: shmtree is faster)",
    "copy_us": "concurrent np.copyto of the whole buffer in shmtree's workers",
    "shmtree_status": "ok, or why shmtree_us is missing",
    "mpi_status": "ok, or why mpi_us is missing",
}


def parse_nprocs(text):
    """--nprocs "2,4,8": distinct process counts >= 1, sorted (ValueError otherwise)."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"process counts must be integers >= 1, got {part!r} in {text!r}")
        values.append(int(part))
    if not values:
        raise ValueError(f"no process count in {text!r}")
    return sorted(set(values))


def default_collectives():
    """Every collective of measure.COLLECTIVES that the installed shmtree can make."""
    return [c for c in COLLECTIVES if compare.missing_call(c) is None]


def parse_collectives(text):
    """--collectives "allreduce,broadcast": a subset of measure.COLLECTIVES, in its order."""
    given = [c.strip().replace("-", "_") for c in text.split(",") if c.strip()]
    unknown = [c for c in given if c not in COLLECTIVES]
    if unknown or not given:
        raise ValueError(f"choose from {','.join(COLLECTIVES)}, got {text!r}")
    return [c for c in COLLECTIVES if c in given]


def choose_nprocs(given, max_procs, cores):
    """(the P to measure, a note on those left out or None).  Without --nprocs: the default
    list up to --max-procs, else up to the usable cores (at least 2); with --nprocs: all of
    them unless --max-procs caps them."""
    wanted = list(given) if given else list(DEFAULT_NPROCS)
    cap = max_procs if max_procs is not None else (None if given else max(2, cores))
    if cap is None:
        return wanted, None
    kept = [p for p in wanted if p <= cap]
    dropped = [p for p in wanted if p > cap]
    why = (f"--max-procs {cap}" if max_procs is not None else
           f"more than the {cores} usable cores; --max-procs, or --nprocs "
           f"{','.join(map(str, wanted))} to oversubscribe")
    if not kept:
        raise BenchError(f"no process count left to measure: {','.join(map(str, wanted))} "
                         f"are all above {cap} ({why})")
    note = f"P = {', '.join(map(str, dropped))} left out ({why})" if dropped else None
    return kept, note


def _mpi_header(reason, hint, columns_seen, python):
    if reason:
        return [f"# MPI: not measured: {reason}: {hint}", "# shmtree's numbers only"]
    libraries = sorted({" ".join(c.detail.split(";")[0].split()) for c in columns_seen
                        if c.status == "ok"})
    if not libraries:
        return [f"# MPI: failed in every cell (python {python}); see below"]
    return [f"# MPI: {lib} (python {python})" for lib in libraries]


def measure_cell(P, collective, args, methods, python, problems, notes):
    """The rows of one (P, collective): every size, private and shared, from one
    compare.run_all; failures go to `problems`, size rounding to `notes`."""
    plan, options = plan_of(args, P), options_of(args)
    sizes, note = round_sizes(args.sizes, args.dtype, P, collective)
    if note:
        notes.append(f"P={P} {collective}: {note}")
    try:
        columns, copy = compare.run_all(sizes, P, plan, options, methods, [python], False,
                                        collective)
    except Exception as exc:     # (run_all guards every method; this is anything else)
        raise shmtree_failure(exc) from exc
    by_key = {c.key: c for c in columns}
    for c in columns:
        if c.status != "ok":
            problems.append(f"P={P} {collective} {c.label}: {c.status}"
                            + (f": {c.hint}" if c.hint and c.key.startswith("mpi") else ""))
    rows, itemsize = [], np.dtype(plan.dtype).itemsize
    for size in sizes:
        count = max(layout(collective, size, plan.dtype, P))
        for arrays, (shm_key, mpi_key) in ARRAYS.items():
            shm, theirs = by_key.get(shm_key), by_key.get(mpi_key)
            shm_us = shm.us(size) if shm is not None and shm.status == "ok" else None
            mpi_us = theirs.us(size) if theirs is not None and theirs.status == "ok" else None
            rows.append({
                "nprocs": P, "collective": collective, "size": count * itemsize,
                "count": count, "arrays": arrays,
                "shmtree_us": shm_us, "mpi_us": mpi_us,
                "mpi_vs_shmtree": mpi_us / shm_us if shm_us and mpi_us else None,
                "copy_us": copy.us(size) if copy is not None and copy.status == "ok" else None,
                "shmtree_status": shm.status if shm is not None else "not measured",
                "mpi_status": theirs.status if theirs is not None else "not measured"})
    return rows, columns


def _cell(value, status):
    if value is not None:
        return report.fmt(value)
    if status.startswith("n/a") or status == "not measured":
        return "n/a"
    return "error"


def text_table(rows, mpi_label):
    headers = ["P", "collective", "size", "arrays", "shmtree (us)", f"{mpi_label} (us)",
               "MPI/shmtree"]
    lines = [[r["nprocs"], r["collective"], format_size(r["size"]), r["arrays"],
              _cell(r["shmtree_us"], r["shmtree_status"]), _cell(r["mpi_us"], r["mpi_status"]),
              report.fmt(r["mpi_vs_shmtree"], 2) + ("x" if r["mpi_vs_shmtree"] else "")]
             for r in rows]
    return report.table(headers, lines)


def cmd_scaling(args):
    cores = usable()
    nprocs, left_out = choose_nprocs(args.nprocs, args.max_procs, cores)
    collectives = args.collectives or default_collectives()
    python = args.mpi_python or sys.executable
    reason, hint = mpi.probe(python)
    methods = ["shmtree", "shared"] + ([] if reason else ["mpi", "mpi_shared"])
    bar = report.Progress(len(nprocs) * len(collectives), "scaling", progress_of(args))
    rows, problems, notes, mpi_columns = [], [], [], []
    try:
        for P in nprocs:
            for collective in collectives:
                bar.step(max(args.sizes), f"P={P} {collective}")
                got, columns = measure_cell(P, collective, args, methods, python, problems,
                                            notes)
                rows += got
                mpi_columns += [c for c in columns if c.key.startswith("mpi")]
    finally:
        bar.done()
    for note in notes:
        print(f"shmtree-bench: note: {note}", file=sys.stderr)
    plan, options = plan_of(args, nprocs[0]), options_of(args)
    labels = sorted({c.label.removesuffix(" shared") for c in mpi_columns if c.status == "ok"})
    mpi_label = labels[0] if len(labels) == 1 else "MPI"
    knobs = ", ".join(f"{k}={v}" for k, v in options.items()) or "default group options"
    buffers = "cache-cold buffers (--fresh)" if plan.fresh else "warm buffers"
    ops = sorted({plan.op} if set(collectives) - set(MOVES_ONLY) else set())
    print(f"# shmtree {machine.shmtree_version()} scaling: P = {', '.join(map(str, nprocs))} "
          f"({cores} usable cores), {plan.dtype}{''.join(' ' + o for o in ops)}, {knobs}, "
          f"{buffers}" + (", --quick" if args.quick else ""))
    print("# time = max over ranks of the median per call; size = the whole buffer "
          "(allgather's and gather's result, reduce_scatter's, scatter's and alltoall's input), "
          "as in nccl-tests; root 0")
    print("# private: numpy arrays, beside MPI's own function; shared: shmtree's shared arrays "
          "(comm.empty), beside the single copy on MPI_Win_allocate_shared memory")
    for line in _mpi_header(reason, hint, mpi_columns, python):
        print(line)
    over = [P for P in nprocs if P > cores]
    if over:
        print(f"# P = {', '.join(map(str, over))} oversubscribed: more processes than the "
              f"{cores} usable cores (unpinned; not what a machine with the cores would show)")
    for line in ([left_out] if left_out else []) + notes:
        print(f"# {line}")
    print(text_table(rows, mpi_label))
    for line in problems:
        print(f"# {line}")
    doc = report.document(
        "scaling", machine.describe(args.topology),
        {"argv": args.argv, "nprocs": nprocs, "sizes": args.sizes, "collectives": collectives,
         "plan": plan.as_dict(), "group_options": options, "mpi_python": python,
         "quick": args.quick, "methods": methods,
         "functions": {c: f"MPI_{FUNCTIONS[c]}" for c in collectives}},
        COLUMNS, rows, mpi={"status": reason or "ok", "hint": hint, "libraries": labels},
        problems=problems, notes=([left_out] if left_out else []) + notes)
    write_outputs(args, doc, list(COLUMNS), rows)
    failed = any(r["shmtree_us"] is None for r in rows)
    return 1 if failed else 0


QUICK_HELP = (f"a smoke test, not a result: about {QUICK_TARGET_S} s of timed calls per cell "
              "(unless --time or --iters say otherwise)")
