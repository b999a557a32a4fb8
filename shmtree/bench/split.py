"""shmtree-bench split: sub-communicators beside MPI, measured in the same run.

For shmtree (P ranks, default 4: shmtree.run) and for MPI (mpi4py under the mpiexec beside
the interpreter, e.g. the mpich wheel's; split_worker.py), in alternating rounds:

- split: the median time of `comm.split(color, key)` into two halves (MPI: Comm.Split), and of
  a split of everyone into one (`comm.dup()`'s work), with the new communicator's close or Free
  outside the timing; the slowest rank's median, in milliseconds;
- an 8 B float64 sum allreduce in place on the parent, on its dup (a sub-communicator of the
  same size) and on a half; microseconds per call, the slowest rank's.

Each figure is the best of the rounds (--rounds, default 3: the least disturbed by other load).
"""
from __future__ import annotations

import json
import os
import sys

from .harness import BenchError
from .mpi import OPEN_MPI_ENV, find_mpiexec, run_job
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
    python = python or sys.executable
    mpiexec = find_mpiexec(python)
    if mpiexec is None:
        raise BenchError("no mpiexec beside the interpreter nor on PATH")
    cmd = [mpiexec, "-n", str(nprocs), python, WORKER, str(splits), str(calls), str(rounds)]
    out, err, rc = run_job(cmd, dict(os.environ, **OPEN_MPI_ENV), timeout, "mpiexec")
    for line in out.splitlines():
        if line.startswith("SPLIT-RESULT "):
            data = json.loads(line[len("SPLIT-RESULT "):])
            return data["library"], data["figures"]
    raise BenchError(f"the MPI worker failed (exit {rc}): {err.strip()[-2000:]}")


def _best(a, b):
    return b if a is None else {k: min(a[k], b[k]) for k in a}


def cmd_split(args):
    if args.nprocs < 2:
        raise BenchError("split needs at least 2 processes (-n)")
    shm = mpi = None
    library, problem = None, None
    for _ in range(args.rounds):
        shm = _best(shm, run_shmtree(args.nprocs, args.splits, args.calls, 3))
        if problem is None and not args.no_mpi:
            try:
                library, got = run_mpi(args.nprocs, args.splits, args.calls, 3)
                mpi = _best(mpi, got)
            except BenchError as exc:
                problem = str(exc)
    first = (library or "MPI").splitlines()[0]
    name = " ".join(first.replace("Version:", "").split())[:24]
    print(f"sub-communicators, {args.nprocs} ranks, best of {args.rounds} alternating round(s)"
          + (f"; MPI: {problem}" if problem else f"; MPI: {name}"))
    print(f"{'measure':<26}{'shmtree':>12}{name:>26}{'shmtree/MPI':>13}")
    for key, what, unit in ROWS:
        s, m = shm[key], (mpi[key] if mpi else None)
        print(f"{what:<26}{s:>9.3f} {unit:<2}"
              f"{'' if m is None else f'{m:>9.3f} {unit}':>26}"
              f"{'' if m is None else f'{s / m:.2f}':>13}")
    print(f"a dup's 8 B allreduce over the parent's: {shm['dup_us'] / shm['parent_us']:.2f} "
          "(shmtree)" + ("" if mpi is None else
                         f", {mpi['dup_us'] / mpi['parent_us']:.2f} (MPI)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nprocs": args.nprocs, "shmtree": shm, "mpi": mpi,
                       "mpi_library": library, "mpi_problem": problem}, f, indent=1)
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
    p.add_argument("--rounds", type=arg(positive), default=3,
                   help="alternating rounds of shmtree and MPI; the best of each (default 3)")
    p.add_argument("--no-mpi", action="store_true", help="shmtree only")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    return p
