#!/usr/bin/env python
"""Reproduce shmtree's benchmark numbers on this machine, into one results file.

Runs, with their defaults, the three reports of ``shmtree-bench``:

1. ``allreduce``: the default sweep (float32 sum, 8 B .. 64 MiB, every usable core);
2. ``compare``: shmtree vs numpy + shared_memory, Pipe, MPI (every ``--mpi-python``), gloo and
   the memory-copy floor (2 processes, 8 B .. 64 MiB);
3. ``numa``: the node x node copy-bandwidth matrix and shmtree's placement knobs;

and writes ``bench/results/<host>-<date>.json`` (the three documents under ``sections``, with
the machine description at the top), plus ``<host>-<date>-<command>.png`` when matplotlib is
installed.  ``--quick`` uses tiny sizes and two iterations (a smoke test, not a result);
``--out`` writes elsewhere.  Exit status: 0 when all three ran, 1 otherwise.

    python bench/reproduce.py [--out DIR] [--quick] [--mpi-python PATH ...]
"""
import argparse
import datetime
import importlib.util
import json
import os
import socket
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if importlib.util.find_spec("shmtree") is None:  # run from a checkout built in place
    sys.path.insert(0, os.path.dirname(HERE))

from shmtree.bench import machine, report  # noqa: E402
from shmtree.bench.__main__ import main as bench  # noqa: E402
QUICK = ["--sizes", "8,4K", "--iters", "2"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="results folder")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--mpi-python", action="append", default=[], metavar="PATH",
                   help="interpreter with mpi4py for compare (repeatable)")
    return p.parse_args(argv)


def commands(args):
    """(name, argv) of the three reports, in the order they run."""
    quick = QUICK if args.quick else []
    mpi = [a for path in args.mpi_python for a in ("--mpi-python", path)]
    numa = ["--matrix-size", "1M"] if args.quick else []
    return [("allreduce", ["allreduce"] + quick), ("compare", ["compare"] + quick + mpi),
            ("numa", ["numa"] + quick + numa)]


def run_one(name, argv, stem, scratch, plots):
    """Run one report; return (exit code, its JSON document or None)."""
    path = os.path.join(scratch, f"{name}.json")
    extra = ["--plot", f"{stem}-{name}.png"] if plots else []
    print(f"\n=== shmtree-bench {' '.join(argv)}", flush=True)
    code = bench(argv + ["--json", path] + extra)
    if code != 0 or not os.path.exists(path):
        return code, None
    with open(path) as f:
        return code, json.load(f)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{socket.gethostname()}-{datetime.date.today().isoformat()}")
    plots = importlib.util.find_spec("matplotlib") is not None
    sections, codes = {}, {}
    with tempfile.TemporaryDirectory(prefix="shmtree-reproduce-") as scratch:
        for name, cmd in commands(args):
            codes[name], sections[name] = run_one(name, cmd, stem, scratch, plots)
    doc = {"tool": "shmtree-bench reproduce", "schema": report.SCHEMA, "quick": args.quick,
           **machine.describe(), "exit_codes": codes, "sections": sections}
    report.write_json(f"{stem}.json", doc)
    print(f"\nwrote {stem}.json" + (" and plots" if plots else " (no matplotlib: no plots)"))
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
