"""shmtree-bench split: sub-communicators beside MPI, measured in the same run.

For shmtree (P ranks, default 4: shmtree.run) and for each MPI (mpi4py under the mpiexec
beside the interpreter, e.g. the mpich wheel's, or each --mpi-python's; split_worker.py), in
alternating rounds:

- split: the median time of `comm.split(color, key)` into two halves (MPI: Comm.Split), and of
  a split of everyone into one (`comm.dup()`'s work), with the new communicator's close or Free
  outside the timing; the slowest rank's median, in milliseconds;
- an 8 B float64 sum allreduce in place on the parent, on its dup (a sub-communicator of the
  same size) and on a half; microseconds per call, the slowest rank's.

Each figure is the best of the rounds (--rounds, default 3: the least disturbed by other load);
the last column is shmtree's over the best MPI's (below 1: shmtree is faster).
"""
from __future__ import annotations

import json
import os
import sys

from .harness import BenchError
from .mpi import add_round_options, alternate, mpi_pythons, run_worker
from .split_worker import measure, slowest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "split_worker.py")
ROWS = (("split_ms", "split into halves", "ms"), ("dup_ms", "split(0) (dup)", "ms"),
        ("parent_us", "8 B allreduce, parent", "us"), ("dup_us", "8 B allreduce, its dup", "us"),
        ("half_us", "8 B allreduce, a half", "us"))


def _shmtree_rank(comm, splits, calls, rounds):
    def allreduce(sub, x):
        (comm if sub is None else sub).allreduce(x, out=x)

    return measure(lambda color, key: comm.split(color, key), lambda sub: sub.close(),
                   allreduce, comm.barrier, comm.rank, comm.size, splits, calls, rounds)


def run_shmtree(nprocs, splits, calls, rounds):
    import shmtree
    return slowest(shmtree.run(_shmtree_rank, nprocs, args=(splits, calls, rounds)))


def run_mpi(nprocs, splits, calls, rounds, python=None, timeout=300):
    return run_worker(python or sys.executable, nprocs, WORKER, [splits, calls, rounds],
                      "SPLIT-RESULT", timeout)


def _best(a, b):
    return {k: min(a[k], b[k]) for k in a}


def cmd_split(args):
    if args.nprocs < 2:
        raise BenchError("split needs at least 2 processes (-n)")
    pythons = mpi_pythons(args)
    shm, mpis = alternate(args.rounds, lambda: run_shmtree(args.nprocs, args.splits, args.calls,
                                                           3),
                          lambda python: run_mpi(args.nprocs, args.splits, args.calls, 3, python),
                          pythons, _best)
    print(f"sub-communicators, {args.nprocs} ranks, best of {args.rounds} alternating round(s)"
          + "".join(f"; {name}: {problem}" for name, _, problem in mpis if problem))
    mpis = [(name, figures) for name, figures, _ in mpis if figures]
    print(f"{'measure':<26}{'shmtree':>12}" + "".join(f"{n[:22]:>24}" for n, _ in mpis)
          + ("  shmtree/best MPI" if mpis else ""))
    for key, what, unit in ROWS:
        s = shm[key]
        print(f"{what:<26}{s:>9.3f} {unit:<2}" + "".join(f"{f[key]:>21.3f} {unit:<2}"
                                                         for _, f in mpis)
              + (f"{s / min(f[key] for _, f in mpis):>18.2f}" if mpis else ""))
    print(f"a dup's 8 B allreduce over the parent's: {shm['dup_us'] / shm['parent_us']:.2f} "
          "(shmtree)" + "".join(f", {f['dup_us'] / f['parent_us']:.2f} ({name})"
                                for name, f in mpis))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nprocs": args.nprocs, "shmtree": shm,
                       "mpi": {name: figures for name, figures in mpis}}, f, indent=1)
    return 0


def add_parser(sub, arg, positive):
    p = sub.add_parser(
        "split", help="sub-communicators: split time and a sub-communicator's allreduce "
                      "beside MPI",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("-n", "--nprocs", type=arg(positive), default=4,
                   help="processes (default 4)")
    p.add_argument("--splits", type=arg(positive), default=20,
                   help="timed splits of each kind per round (default 20)")
    p.add_argument("--calls", type=arg(positive), default=2000,
                   help="timed 8 B allreduces per measurement (default 2000)")
    add_round_options(p, arg, positive)
    return p
