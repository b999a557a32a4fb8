"""The MPI side of ``compare``: one rank of ``mpiexec -n P python mpi_worker.py ...``.

Every rank builds the same buffers as shmtree's workers (``measure.Buffers``, laid out by
``measure.layout``), checks one call against the expected value (``measure.check``), then times
it with the protocol of ``measure.py``.  The call is the one ``--collective`` names, root 0:
``Allreduce(x, out, op)``, ``Bcast(x)`` in place, ``Reduce(x, out, op)``, ``Allgather(x, out)``
or ``Reduce_scatter_block(x, out, op)`` (equal blocks, as ``measure.layout`` makes them).
Rank 0 gathers the ranks' summaries and prints one line, ``SHMTREE-BENCH-MPI {json}``, which
``mpi.py`` reads: the MPI library's own version string, the mpi4py version, the collective and
its MPI function, and one row per size.

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
    p.add_argument("--collective", default="allreduce", choices=measure.COLLECTIVES)
    return p.parse_args(argv)


# the MPI function measured for each collective (mpi4py's buffer spelling)
FUNCTIONS = {"allreduce": "Allreduce", "broadcast": "Bcast", "reduce": "Reduce",
             "allgather": "Allgather", "reduce_scatter": "Reduce_scatter_block"}


def mpi_call(comm, collective, op, bufs):
    """call(i) making one MPI `collective` on pair i of `bufs`, root 0."""
    if collective == "broadcast":
        def call(i):
            comm.Bcast(bufs.pair(i)[0], root=0)
    elif collective == "reduce":
        def call(i):
            x, out = bufs.pair(i)
            comm.Reduce(x, out, op=op, root=0)
    elif collective == "allgather":
        def call(i):
            x, out = bufs.pair(i)
            comm.Allgather(x, out)
    elif collective == "reduce_scatter":
        def call(i):
            x, out = bufs.pair(i)
            comm.Reduce_scatter_block(x, out, op=op)
    else:
        def call(i):
            x, out = bufs.pair(i)
            comm.Allreduce(x, out, op=op)
    return call


def one_size(comm, mpi, size, args):
    dtype = np.dtype(args.dtype)
    n_in, n_out = measure.layout(args.collective, size, dtype, comm.size)
    bufs = measure.Buffers(n_in, dtype, comm.rank, args.fresh, args.rotation_bytes, n_out)
    op = {"sum": mpi.SUM, "prod": mpi.PROD, "min": mpi.MIN, "max": mpi.MAX}[args.op]
    call = mpi_call(comm, args.collective, op, bufs)
    call(0)
    measure.check(args.collective, args.op, comm.rank, comm.size, bufs, "MPI")
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
                                   "nprocs": comm.size, "collective": args.collective,
                                   "function": FUNCTIONS[args.collective], "rows": rows}),
              flush=True)


if __name__ == "__main__":
    main()
