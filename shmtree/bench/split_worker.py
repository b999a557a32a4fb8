"""The MPI side of shmtree-bench split (run under mpiexec by path), and the measuring loop
both sides share (measure).  Prints one line 'SPLIT-RESULT {json}' on rank 0.  argv: the
number of timed splits, the timed allreduces per round, the rounds."""
import json
import statistics
import sys
import time

import numpy as np


def _allreduce_us(allreduce, barrier, calls):
    x = np.ones(1)
    allreduce(x)
    barrier()
    t = time.perf_counter()
    for _ in range(calls):
        allreduce(x)
    return (time.perf_counter() - t) / calls * 1e6


def measure(split, free, allreduce, barrier, rank, size, splits, calls, rounds):
    """One rank's figures of one library (its calls given as functions; split(color, key)
    makes a communicator, free(sub) frees it, allreduce(sub or None, x) is an 8 B sum in place
    on sub or on the parent): {"split_ms": the median split into halves (ranks 0..P/2-1 and
    the rest), "dup_ms": the same for split(0) of everyone, "parent_us", "dup_us", "half_us":
    an 8 B allreduce on the parent, on its dup, on its half (the best round of each)}."""
    times = {"split": [], "dup": []}
    for what in ("split", "dup"):
        for i in range(splits + 2):
            color = (0 if rank < size // 2 else 1) if what == "split" else 0
            barrier()
            t = time.perf_counter()
            sub = split(color, rank)
            dt = time.perf_counter() - t
            free(sub)
            if i >= 2:                     # (the first ones warm up)
                times[what].append(dt * 1e3)
    dup, half = split(0, rank), split(0 if rank < size // 2 else 1, rank)
    best = {"parent": float("inf"), "dup": float("inf"), "half": float("inf")}
    for _ in range(rounds):           # (alternating, so that a busy moment slows all alike)
        for name, sub in (("parent", None), ("dup", dup), ("half", half)):
            us = _allreduce_us(lambda x: allreduce(sub, x), barrier, calls)
            best[name] = min(best[name], us)
    free(dup)
    free(half)
    return {"split_ms": statistics.median(times["split"]),
            "dup_ms": statistics.median(times["dup"]), **{f"{k}_us": v for k, v in best.items()}}


def slowest(figures):
    """Every figure of the ranks' (a list of measure's dicts): the slowest rank's."""
    return {k: max(f[k] for f in figures) for k in figures[0]}


def main():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    splits, calls, rounds = (int(v) for v in sys.argv[1:4])

    def allreduce(sub, x):
        (comm if sub is None else sub).Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)

    got = comm.gather(measure(lambda color, key: comm.Split(color, key), lambda sub: sub.Free(),
                              allreduce, comm.Barrier, comm.rank, comm.size, splits, calls,
                              rounds), root=0)
    if comm.rank == 0:
        print("SPLIT-RESULT " + json.dumps({"library": MPI.Get_library_version().strip(),
                                            "figures": slowest(got)}), flush=True)


if __name__ == "__main__":
    main()
