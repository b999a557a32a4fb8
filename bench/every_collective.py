#!/usr/bin/env python
"""Every collective beside MPI, side by side: the table of docs/performance.md ("Every
collective against MPI").

For each process count and collective, runs ``shmtree-bench compare --collective C`` (shmtree,
every ``--mpi-python``'s MPI and the concurrent-copy reference, in one run each), ``--rounds``
times (round by round over every collective, so that a cell's rounds lie minutes apart), and
prints one markdown table per process count: per cell shmtree's time over the best
MPI's (below 1: shmtree is faster), the best of the rounds of each (the least disturbed by
other load), with shmtree's and the best MPI's microseconds.  ``--json`` keeps every run.

    python bench/every_collective.py [--nprocs 2,4] [--sizes 8,32K,2M,16M] [--rounds 2]
        [--mpi-python PATH ...] [--collectives allgather,scatter,...] [--json FILE]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall",
               "alltoallv", "gather", "scatter", "scan", "exscan")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", default="2", help="process counts, comma-separated (default 2)")
    p.add_argument("--sizes", default="8,32K,2M,16M", help="as shmtree-bench's --sizes")
    p.add_argument("--rounds", type=int, default=2, help="runs of each cell; the best is kept")
    p.add_argument("--time", default="0.1", help="seconds of timed calls per size")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--mpi-python", action="append", default=[], metavar="PATH")
    p.add_argument("--json", metavar="FILE", help="write every run's rows as JSON")
    return p.parse_args(argv)


def run_compare(collective, nprocs, args):
    """One compare run: its rows (a list of dicts keyed size, shmtree_us, mpiK_us ...)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = [sys.executable, "-m", "shmtree.bench", "compare", "--collective", collective,
               "-n", str(nprocs), "--sizes", args.sizes, "--methods", "shmtree,mpi,copy",
               "--time", args.time, "--no-progress", "--json", out]
        for python in args.mpi_python:
            cmd += ["--mpi-python", python]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            doc = json.load(f)
    return doc["rows"], doc.get("methods", {})


def best_mpi(row):
    times = [v for k, v in row.items() if k.startswith("mpi") and k.endswith("_us") and v]
    return min(times) if times else None


def fmt(us):
    return f"{us:.3g}" if us < 1000 else f"{us:.0f}"


def size_text(n):
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    everything = {}
    for P in [int(p) for p in args.nprocs.split(",")]:
        table = {coll: {} for coll in args.collectives.split(",")}
        for _ in range(args.rounds):          # (round by round over every collective: the
            for coll, best in table.items():  # rounds of a cell minutes apart, so that the
                rows, _ = run_compare(coll, P, args)    # best of them escapes a slow spell)
                everything.setdefault(f"P{P}", {}).setdefault(coll, []).append(rows)
                for row in rows:
                    mine, theirs = row.get("shmtree_us"), best_mpi(row)
                    old = best.get(row["size"], (None, None))
                    best[row["size"]] = (mine if old[0] is None or (mine and mine < old[0])
                                         else old[0],
                                         theirs if old[1] is None or (theirs and theirs < old[1])
                                         else old[1])
        sizes = sorted({s for b in table.values() for s in b})
        print(f"\nP = {P}: shmtree / best MPI (shmtree us / MPI us), best of {args.rounds} runs")
        print("| collective | " + " | ".join(size_text(s) for s in sizes) + " |")
        print("|---" * (len(sizes) + 1) + "|")
        for coll, best in table.items():
            cells = []
            for s in sizes:
                mine, theirs = best.get(s, (None, None))
                cells.append("-" if not mine or not theirs else
                             f"{mine / theirs:.2f}x ({fmt(mine)} / {fmt(theirs)})")
            print(f"| {coll} | " + " | ".join(cells) + " |")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
