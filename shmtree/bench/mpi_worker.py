"""The MPI side of ``compare``: one rank of ``mpiexec -n P python mpi_worker.py ...``.

Every rank builds the same buffers as shmtree's workers (``measure.Buffers``), checks one
``MPI.COMM_WORLD.Allreduce(x, out, op)`` against the expected value, then times Allreduce with
the protocol of ``measure.py``.  Rank 0 gathers the ranks' summaries and prints one line,
``SHMTREE-BENCH-MPI {json}``, which ``mpi.py`` reads: the MPI library's own version string, the
mpi4py version and one row per size.

It imports only the standard library, numpy, mpi4py and ``measure.py`` (loaded from this folder
when run by path), so ``--mpi-python`` may point at another virtualenv's interpreter in which
shmtree is not installed: that is how MPICH and Open MPI end up side by side.
"""
import argparse
import json
import sys

import numpy as np

if __package__:
    from . import measure
else:  # run by path: this folder is sys.path[0]
    import measure

MARKER = "SHMTREE-BENCH-MPI "


class MpiSync:
    """barrier() and max() for measure.measure, on an MPI communicator."""

    def __init__(self, comm, mpi):
        self.comm, self.mpi = comm, mpi

    def barrier(self):
        self.comm.Barrier()

    def max(self, value):
        return self.comm.allreduce(value, op=self.mpi.MAX)


def parse_args(argv):
    p = argparse.ArgumentParser(description="one MPI rank of shmtree-bench compare")
    p.add_argument("--sizes", required=True, help="comma-separated byte counts")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--op", default="sum", choices=sorted(measure.UFUNCS))
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--target-s", type=float, default=measure.TARGET_S)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--rotation-bytes", type=int, default=0)
    return p.parse_args(argv)


def one_size(comm, mpi, size, args):
    dtype = np.dtype(args.dtype)
    count = max(1, size // dtype.itemsize)
    bufs = measure.Buffers(count, dtype, comm.rank, args.fresh, args.rotation_bytes)
    op = {"sum": mpi.SUM, "prod": mpi.PROD, "min": mpi.MIN, "max": mpi.MAX}[args.op]

    def call(i):
        x, out = bufs.pair(i)
        comm.Allreduce(x, out, op=op)

    call(0)
    measure.verify(bufs.pair(0)[1], args.op, comm.size, "MPI")
    return measure.measure(call, MpiSync(comm, mpi), args.iters, args.target_s)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import mpi4py
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        summaries = comm.gather(one_size(comm, MPI, size, args), root=0)
        if comm.rank == 0:
            rows.append(dict(measure.slowest(summaries), size=size))
    if comm.rank == 0:
        library = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()
        print(MARKER + json.dumps({"library": library, "mpi4py": mpi4py.__version__,
                                   "nprocs": comm.size, "rows": rows}), flush=True)


if __name__ == "__main__":
    main()
