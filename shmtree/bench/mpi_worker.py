"""The MPI side of ``compare``: one rank of ``mpiexec -n P python mpi_worker.py ...``.

Every rank builds the same buffers as shmtree's workers (``measure.Buffers``, laid out by
``measure.layout``), checks one call against the expected value (``measure.check``), then times
it with the protocol of ``measure.py``.  The call is the one ``--collective`` names, root 0:
``Allreduce(x, out, op)``, ``Bcast(x)`` in place, ``Reduce(x, out, op)``, ``Allgather(x, out)``,
``Reduce_scatter_block(x, out, op)``, ``Alltoall(x, out)``, ``Alltoallv`` (``alltoallv``: P
equal counts and their displacements, given as lists, as a program that computes them would),
``Gather(x, out)``,
``Scatter(x, out)`` (equal blocks, as ``measure.layout`` makes them, filled by
``measure.fill``), ``Scan(x, out, op)`` or ``Exscan(x, out, op)``.
Rank 0 gathers the ranks' summaries and prints one line, ``SHMTREE-BENCH-MPI {json}``, which
``mpi.py`` reads: the MPI library's own version string, the mpi4py version, the collective and
its MPI function, and one row per size.

``--shared``: the same collective on memory every rank can address, as ``compare --shared``
measures shmtree on shared arrays, so that the comparison is fair.  Each rank's array lives in an
MPI-3 shared-memory window (``MPI.Win.Allocate_shared`` over ``COMM_TYPE_SHARED``, one segment
per rank, ``alloc_shared_noncontig``, first-touched by its owner) and the collective is the
single-copy one an MPI programmer would write on it: every rank reads its part straight from the
peers' windows (``Win.Shared_query``) and writes it straight where it belongs, ``CHUNK_BYTES`` at
a time with numpy, between two ``MPI_Barrier`` calls (with ``MPI_Win_sync``: the peers' writes
before are seen, nobody returns while others still read or write its memory).  The layouts are
shmtree's (``sweep._shared_call``): allreduce in place, broadcast in place from rank 0, reduce
into rank 0's input, allgather of a private block into every rank's shared output,
reduce_scatter of shared inputs into a private block; alltoall, gather, scatter, scan and
exscan read shared inputs (the sources, as ``sweep._shared_sources``) and each rank writes its
own private output: alltoall's block s from rank s's window, the root's gather every rank's
block, scatter's block r from the root's window, scan (exscan) the fold of windows 0..r
(0..r-1).  Each part is reduced in rank order (x[0] op x[1] op ...).

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
else:  # run by path: load measure.py from this folder (sys.path[0] is not it under -P or
    import os  # PYTHONSAFEPATH, which the tests' conftest sets for an installed shmtree)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
    p.add_argument("--shared", action="store_true",
                   help="single copy on MPI.Win.Allocate_shared memory (see the docstring)")
    return p.parse_args(argv)


# the MPI function measured for each collective (mpi4py's buffer spelling)
FUNCTIONS = {"allreduce": "Allreduce", "broadcast": "Bcast", "reduce": "Reduce",
             "allgather": "Allgather", "reduce_scatter": "Reduce_scatter_block",
             "alltoall": "Alltoall", "alltoallv": "Alltoallv", "gather": "Gather",
             "scatter": "Scatter", "scan": "Scan", "exscan": "Exscan"}


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
    elif collective == "alltoall":
        def call(i):
            x, out = bufs.pair(i)
            comm.Alltoall(x, out)
    elif collective == "alltoallv":
        P = comm.size
        block = bufs.count // P
        counts = [block] * P                          # (items; the datatype is the array's)
        displs = [block * q for q in range(P)]

        def call(i):
            x, out = bufs.pair(i)
            comm.Alltoallv([x, (counts, displs)], [out, (counts, displs)])
    elif collective == "gather":
        def call(i):
            x, out = bufs.pair(i)
            comm.Gather(x, out, root=0)
    elif collective == "scatter":
        def call(i):
            x, out = bufs.pair(i)
            comm.Scatter(x, out, root=0)
    elif collective in ("scan", "exscan"):
        method = comm.Scan if collective == "scan" else comm.Exscan

        def call(i):
            x, out = bufs.pair(i)
            method(x, out, op=op)
    else:
        def call(i):
            x, out = bufs.pair(i)
            comm.Allreduce(x, out, op=op)
    return call


def one_size(comm, mpi, size, args):
    dtype = np.dtype(args.dtype)
    n_in, n_out = measure.layout(args.collective, size, dtype, comm.size)
    bufs = measure.Buffers(n_in, dtype, comm.rank, args.fresh, args.rotation_bytes, n_out)
    measure.fill(args.collective, comm.rank, comm.size, bufs.inputs)
    op = {"sum": mpi.SUM, "prod": mpi.PROD, "min": mpi.MIN, "max": mpi.MAX}[args.op]
    call = mpi_call(comm, args.collective, op, bufs)
    call(0)
    measure.check(args.collective, args.op, comm.rank, comm.size, bufs, "MPI")
    return measure.measure(call, MpiSync(comm, mpi), args.iters, args.target_s)


CHUNK_BYTES = 256 << 10        # a part is reduced (or moved) this much at a time, in cache
SOURCES_SHARED = ("alltoall", "alltoallv", "gather", "scatter", "scan",
                  "exscan")                                             # shared in, private out
SHARED_FUNCTIONS = {c: "single copy on MPI_Win_allocate_shared (numpy, 2x MPI_Barrier)"
                    for c in FUNCTIONS}


class Window:
    """One shared-memory window: this rank's array and every rank's, as numpy arrays."""

    def __init__(self, node, mpi, count, dtype):
        dtype = np.dtype(dtype)
        info = mpi.Info.Create()
        info.Set("alloc_shared_noncontig", "true")       # a segment per rank, on its own pages
        try:
            self.win = mpi.Win.Allocate_shared(max(1, count) * dtype.itemsize, dtype.itemsize,
                                               info, comm=node)
        finally:
            info.Free()
        self.views = []
        for r in range(node.size):
            buf, _ = self.win.Shared_query(r)
            self.views.append(np.frombuffer(buf, dtype, count))
        self.mine = self.views[node.rank]

    def free(self):
        self.views = self.mine = None
        self.win.Free()


class SharedCollective:
    """call(i) of one collective on shared windows, the single copy (module docstring)."""

    def __init__(self, comm, mpi, collective, op, n_in, n_out, dtype):
        self.comm, self.mpi = comm, mpi
        P, r = comm.size, comm.rank
        self.ufunc = measure.UFUNCS[op]
        self.windows = []
        shared_in = collective != "allgather"
        self.x = self._window(n_in, dtype) if shared_in else np.full(n_in, r + 1, dtype)
        if shared_in:
            self.x.mine[:] = r + 1                        # first touch: the owner's
            measure.fill(collective, r, P, [self.x.mine])
        private_out = collective == "reduce_scatter" or collective in SOURCES_SHARED
        self.out = (self._window(n_out, dtype) if collective == "allgather" else
                    np.zeros(n_out, dtype) if private_out else None)
        if collective == "allgather":
            self.out.mine[:] = 0
        step = max(1, CHUNK_BYTES // np.dtype(dtype).itemsize)
        self.step, self.tmp = step, np.empty(min(step, max(n_in, n_out)), dtype)
        share = -(-n_in // P)
        self.lo, self.hi = min(r * share, n_in), min((r + 1) * share, n_in)
        self.work = {"allreduce": self._allreduce, "broadcast": self._broadcast,
                     "reduce": self._reduce, "allgather": self._allgather,
                     "reduce_scatter": self._reduce_scatter, "alltoall": self._alltoall,
                     "alltoallv": self._alltoall,
                     "gather": self._gather, "scatter": self._scatter, "scan": self._scan,
                     "exscan": self._exscan}[collective]
        self._sync()

    def _window(self, count, dtype):
        w = Window(self.comm, self.mpi, count, dtype)
        w.win.Lock_all(self.mpi.MODE_NOCHECK)             # passive target, for Win_sync
        self.windows.append(w)
        return w

    def _sync(self):
        for w in self.windows:
            w.win.Sync()
        self.comm.Barrier()
        for w in self.windows:
            w.win.Sync()

    def __call__(self, i):
        self._sync()                                      # every input is written
        self.work()
        self._sync()                                      # every part is written

    def _fold(self, ins, a, b, targets):
        """ins[0][a:b] op ins[1][a:b] op ..., a chunk at a time, into every target[a:b]."""
        for c in range(a, b, self.step):
            d = min(c + self.step, b)
            t = self.tmp[:d - c]
            if len(ins) > 1:
                self.ufunc(ins[0][c:d], ins[1][c:d], out=t)
            else:
                t[...] = ins[0][c:d]
            for x in ins[2:]:
                self.ufunc(t, x[c:d], out=t)
            for o in targets:
                o[c:d] = t

    def _allreduce(self):
        self._fold(self.x.views, self.lo, self.hi, self.x.views)

    def _reduce(self):
        self._fold(self.x.views, self.lo, self.hi, [self.x.views[0]])

    def _broadcast(self):
        if self.comm.rank:
            self.x.mine[:] = self.x.views[0]

    def _allgather(self):
        n = len(self.x)
        at = self.comm.rank * n
        for o in self.out.views:
            o[at:at + n] = self.x

    def _reduce_scatter(self):
        n = len(self.out)
        at = self.comm.rank * n
        self._fold([v[at:at + n] for v in self.x.views], 0, n, [self.out])

    def _alltoall(self):
        n = len(self.out) // self.comm.size
        at = self.comm.rank * n
        for s, v in enumerate(self.x.views):
            self.out[s * n:(s + 1) * n] = v[at:at + n]

    def _gather(self):
        if self.comm.rank == 0:
            n = len(self.x.mine)
            for s, v in enumerate(self.x.views):
                self.out[s * n:(s + 1) * n] = v

    def _scatter(self):
        n = len(self.out)
        at = self.comm.rank * n
        self.out[:] = self.x.views[0][at:at + n]

    def _scan(self):
        self._fold(self.x.views[:self.comm.rank + 1], 0, len(self.out), [self.out])

    def _exscan(self):
        if self.comm.rank:                                # rank 0's output: undefined in MPI
            self._fold(self.x.views[:self.comm.rank], 0, len(self.out), [self.out])

    def check(self, collective, op):
        """measure.check's rules, on these arrays (rank 0 the root)."""
        P, r = self.comm.size, self.comm.rank
        x = self.x.mine if isinstance(self.x, Window) else self.x
        out = self.out.mine if isinstance(self.out, Window) else self.out
        if collective == "allreduce" or collective == "reduce" and r == 0:
            measure.verify(x, op, P, "MPI shared", collective)
        elif collective == "reduce_scatter":
            measure.verify(out, op, P, "MPI shared", collective)
        elif collective in ("broadcast", "allgather") or collective in SOURCES_SHARED:
            class Pair:
                def pair(self, i):
                    return x, out
            measure.check(collective, op, r, P, Pair(), "MPI shared")
        if collective in ("allreduce", "reduce"):
            self._sync()
            x[:] = 1                  # (in place: the values change, the work does not)
            self._sync()

    def free(self):
        for w in self.windows:
            w.win.Unlock_all()
            w.free()
        self.windows = []


def one_size_shared(comm, mpi, size, args):
    n_in, n_out = measure.layout(args.collective, size, args.dtype, comm.size)
    call = SharedCollective(comm, mpi, args.collective, args.op, n_in, n_out, args.dtype)
    try:
        call(0)
        call.check(args.collective, args.op)
        return measure.measure(call, MpiSync(comm, mpi), args.iters, args.target_s)
    finally:
        call.free()


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import mpi4py
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if args.shared:
        comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
        if comm.size != MPI.COMM_WORLD.size:
            raise SystemExit("--shared: every rank must run on one node")
    measure_one = one_size_shared if args.shared else one_size
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        summaries = comm.gather(measure_one(comm, MPI, size, args), root=0)
        if comm.rank == 0:
            rows.append(dict(measure.slowest(summaries), size=size))
    if comm.rank == 0:
        library = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()
        print(MARKER + json.dumps({"library": library, "mpi4py": mpi4py.__version__,
                                   "nprocs": comm.size, "collective": args.collective,
                                   "function": (SHARED_FUNCTIONS if args.shared else
                                                FUNCTIONS)[args.collective],
                                   "shared": args.shared, "rows": rows}),
              flush=True)


if __name__ == "__main__":
    main()
