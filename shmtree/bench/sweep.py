"""shmtree's own allreduce (or another collective, for ``compare``), measured inside
``shmtree.run`` workers.

One ``shmtree.run`` per sweep: the workers are the group's members, pinned and placed by shmtree
as the group options say.  At each size every worker first measures the concurrent memory copy
(``copylimit.copy_measurement``, same processes, same pinning, same buffers), then checks one
``comm.allreduce(x, op, out=y)`` against the expected value, then times it (``measure.py``).
The parent combines the ranks' summaries (maximum over ranks of the per-rank median) into rows:
size, count, time, algbw = bytes/time, busbw = algbw * 2(P-1)/P (nccl-tests' convention, so that
busbw is comparable with the memory bandwidth a process sees), and the ratio to the copy time.

``comm.allreduce`` gets ``timeout=plan.timeout`` so that a hang in the library becomes an error
(shmtree then stops every worker) instead of a bench that never returns.

``run_sweep(..., collective=...)`` measures another collective the same way (``compare
--collective``), on the buffers of ``measure.layout`` (a size is the whole buffer), root 0:
``comm.broadcast(x, 0, out=x)`` in place on every rank (the root passes its array, the others
None), ``comm.reduce(x, op, 0, out=y)``, ``comm.allgather(x, out=y)`` into a (P, block) view,
``comm.reduce_scatter(x, op, out=y)``, ``comm.alltoall(x, out=y)`` on (P, block) views,
``comm.alltoall(x, counts=[block] * P, out=y)`` on the flat arrays (alltoallv),
``comm.gather(x, 0, out=y)`` into a (P, block) view on the root (out=None elsewhere),
``comm.scatter(x, 0, out=y)`` from a (P, block) view on the root (None elsewhere),
``comm.scan(x, op, out=y)``, ``comm.exscan(x, op, out=y)``.  The copy beside it copies the
whole buffer.
"""
import numpy as np

from . import report
from .copylimit import copy_measurement
from .measure import Buffers, check, fill, layout, measure, slowest, verify
from .units import count_for

GROUP_OPTIONS = ("topology", "tree", "chunk_bytes", "slots", "placement", "numa", "pin",
                 "small_bytes", "nt_bytes", "spin_us")


def group_options(**given):
    """The group options that were actually given (None means: shmtree's default)."""
    return {k: v for k, v in given.items() if k in GROUP_OPTIONS and v is not None}


class CommSync:
    """barrier() and max() for measure.measure, on a shmtree communicator."""

    def __init__(self, comm):
        self.comm = comm

    def barrier(self):
        self.comm.barrier()

    def max(self, value):
        return float(self.comm.allreduce(np.array([value]), op="max")[0])


def allreduce_measurement(comm, size, plan, bufs):
    def call(i):
        x, out = bufs.pair(i)
        comm.allreduce(x, op=plan.op, out=out, timeout=plan.timeout)

    call(0)
    verify(bufs.pair(0)[1], plan.op, comm.size, "shmtree")
    return measure(call, CommSync(comm), plan.iters, plan.target_s)


def collective_call(comm, collective, plan, bufs):
    """call(i) making one shmtree `collective` on pair i of `bufs` (laid out by
    measure.layout), root 0."""
    op, timeout, P = plan.op, plan.timeout, comm.size
    if collective == "broadcast":
        def call(i):
            x = bufs.pair(i)[0]
            comm.broadcast(x if comm.rank == 0 else None, 0, out=x, timeout=timeout)
    elif collective == "reduce":
        def call(i):
            x, out = bufs.pair(i)
            comm.reduce(x, op, 0, out=out, timeout=timeout)
    elif collective == "allgather":
        gathered = [out.reshape(P, -1) for out in bufs.outputs]

        def call(i):
            x = bufs.pair(i)[0]
            comm.allgather(x, out=gathered[i % len(gathered)], timeout=timeout)
    elif collective == "reduce_scatter":
        def call(i):
            x, out = bufs.pair(i)
            comm.reduce_scatter(x, op, out=out, timeout=timeout)
    elif collective == "alltoall":
        pairs = [(x.reshape(P, -1), out.reshape(P, -1)) for x, out in zip(bufs.inputs,
                                                                          bufs.outputs)]

        def call(i):
            x, out = pairs[i % len(pairs)]
            comm.alltoall(x, out=out, timeout=timeout)
    elif collective == "alltoallv":
        counts = [bufs.count // P] * P

        def call(i):
            x, out = bufs.pair(i)
            comm.alltoall(x, counts=counts, out=out, timeout=timeout)
    elif collective == "gather":
        root = comm.rank == 0
        gathered = [out.reshape(P, -1) if root else None for out in bufs.outputs]

        def call(i):
            comm.gather(bufs.pair(i)[0], 0, out=gathered[i % len(gathered)], timeout=timeout)
    elif collective == "scatter":
        root = comm.rank == 0
        blocks = [x.reshape(P, -1) if root else None for x in bufs.inputs]

        def call(i):
            comm.scatter(blocks[i % len(blocks)], 0, out=bufs.pair(i)[1], timeout=timeout)
    elif collective in ("scan", "exscan"):
        method = getattr(comm, collective)

        def call(i):
            x, out = bufs.pair(i)
            method(x, op, out=out, timeout=timeout)
    else:
        raise ValueError(f"no shmtree call for collective {collective!r}")
    return call


def collective_measurement(comm, collective, plan, bufs):
    """One collective other than allreduce: checked once, then timed (measure.py)."""
    call = collective_call(comm, collective, plan, bufs)
    call(0)
    check(collective, plan.op, comm.rank, comm.size, bufs, "shmtree")
    return measure(call, CommSync(comm), plan.iters, plan.target_s)


def _worker(comm, sizes, plan, with_copy, show_progress, collective="allreduce"):
    progress = report.Progress(len(sizes), collective, show_progress and comm.rank == 0)
    results = []
    for size in sizes:
        progress.step(size)
        if collective == "allreduce":
            bufs = Buffers(count_for(size, plan.dtype), plan.dtype, comm.rank, plan.fresh,
                           plan.rotation_bytes)
            copy = copy_measurement(CommSync(comm), comm.rank, size, plan, bufs) \
                if with_copy else None
            results.append({"allreduce": allreduce_measurement(comm, size, plan, bufs),
                            "copy": copy})
            continue
        n_in, n_out = layout(collective, size, plan.dtype, comm.size)
        bufs = Buffers(n_in, plan.dtype, comm.rank, plan.fresh, plan.rotation_bytes, n_out)
        fill(collective, comm.rank, comm.size, bufs.inputs)
        copy = None
        if with_copy:   # the whole buffer, in the same processes
            whole = Buffers(max(n_in, n_out), plan.dtype, comm.rank, plan.fresh,
                            plan.rotation_bytes)
            copy = copy_measurement(CommSync(comm), comm.rank, size, plan, whole)
            del whole
        results.append({collective: collective_measurement(comm, collective, plan, bufs),
                        "copy": copy})
    progress.done()
    return results


def run_sweep(sizes, nprocs, plan, options, with_copy=True, progress=False,
              collective="allreduce"):
    """{size: {collective: summary, "copy": summary | None}} measured in shmtree workers
    (the key is "allreduce" unless another collective is asked for)."""
    import shmtree
    per_rank = shmtree.run(_worker, nprocs,
                           args=(sizes, plan, with_copy, progress, collective), **options)
    combined = {}
    for k, size in enumerate(sizes):
        copies = [r[k]["copy"] for r in per_rank]
        combined[size] = {collective: slowest([r[k][collective] for r in per_rank]),
                          "copy": slowest(copies) if with_copy else None}
    return combined


def row(size, dtype, nprocs, allreduce, copy=None):
    """One table/JSON row from the combined summaries of one size."""
    count = count_for(size, dtype)
    nbytes = count * np.dtype(dtype).itemsize
    t = allreduce["median_s"]
    algbw = nbytes / t / 1e9
    out = {"size": nbytes, "count": count, "time_us": t * 1e6, "algbw_gbs": algbw,
           "busbw_gbs": algbw * 2 * (nprocs - 1) / nprocs, "iters": allreduce["iters"]}
    if copy is not None:
        out.update(copy_us=copy["median_s"] * 1e6, vs_copy=t / copy["median_s"])
    return out


def _shared_call(comm, collective, plan, size):
    """call(i) of `collective` on shared arrays (comm.empty), laid out as measure.layout says,
    and a check of its result."""
    P, r = comm.size, comm.rank
    n_in, n_out = layout(collective, size, plan.dtype, P)
    if collective == "allreduce":
        x = comm.empty(n_in, plan.dtype)
        x[:] = r + 1                     # (every input holds rank + 1, as in Buffers)

        def call(i):
            comm.allreduce(x, op=plan.op, out=x, timeout=plan.timeout)

        def check():
            verify(x, plan.op, P, "shmtree shared")
            x[:] = 1                     # (in place: the values change, the work does not)
    elif collective == "broadcast":
        x = comm.empty(n_in, plan.dtype)
        x[:] = r + 1

        def call(i):
            comm.broadcast(x if r == 0 else None, 0, out=x, timeout=plan.timeout)

        def check():
            if not np.all(x == 1):
                raise RuntimeError("shmtree shared: wrong broadcast result")
    elif collective == "allgather":
        mine = np.full(n_in, r + 1, plan.dtype)
        out = comm.empty((P, n_in), plan.dtype)

        def call(i):
            comm.allgather(mine, out=out, timeout=plan.timeout)

        def check():
            if not all(np.all(out[q] == q + 1) for q in range(P)):
                raise RuntimeError("shmtree shared: wrong allgather result")
    elif collective == "reduce":
        x = comm.empty(n_in, plan.dtype)
        x[:] = r + 1

        def call(i):
            comm.reduce(x, plan.op, 0, out=x if r == 0 else None, timeout=plan.timeout)

        def check():
            if r == 0:
                verify(x, plan.op, P, "shmtree shared")
            x[:] = 1
    elif collective == "reduce_scatter":
        x = comm.empty(n_in, plan.dtype)
        x[:] = r + 1
        out = np.empty(n_out, plan.dtype)

        def call(i):
            comm.reduce_scatter(x, plan.op, out=out, timeout=plan.timeout)

        def check():
            verify(out, plan.op, P, "shmtree shared", "reduce_scatter")
    elif collective in SOURCES_SHARED:
        return _shared_sources(comm, collective, plan, n_in, n_out)
    else:
        raise ValueError(f"no shared-array measurement of {collective}")
    return call, check


SOURCES_SHARED = ("alltoall", "alltoallv", "gather", "scatter", "scan", "exscan")


def _shared_sources(comm, collective, plan, n_in, n_out):
    """(call, check) of alltoall(v), gather, scatter, scan or exscan reading shared inputs
    (comm.empty: the ranks' sources, where the others can read them straight) and writing
    private outputs, laid out and filled as in the private measurement (measure.fill)."""
    P, r, timeout = comm.size, comm.rank, plan.timeout
    blocked = collective in ("alltoall", "alltoallv", "scatter")
    x = comm.empty((P, n_in // P) if blocked else n_in, plan.dtype)
    x[...] = r + 1
    fill(collective, r, P, [x])
    out = np.zeros((P, n_out // P) if collective in ("alltoall", "alltoallv", "gather")
                   else n_out, plan.dtype)
    if collective == "alltoall":
        def call(i):
            comm.alltoall(x, out=out, timeout=timeout)
    elif collective == "alltoallv":
        flat, got, counts = x.reshape(-1), out.reshape(-1), [n_in // P] * P

        def call(i):
            comm.alltoall(flat, counts=counts, out=got, timeout=timeout)
    elif collective == "gather":
        def call(i):
            comm.gather(x, 0, out=out if r == 0 else None, timeout=timeout)
    elif collective == "scatter":
        def call(i):
            comm.scatter(x if r == 0 else None, 0, out=out, timeout=timeout)
    else:
        method = getattr(comm, collective)

        def call(i):
            method(x, plan.op, out=out, timeout=timeout)

    class Pair:
        def pair(self, i):
            return x.reshape(-1), out.reshape(-1)

    def checked():
        check(collective, plan.op, r, P, Pair(), "shmtree shared")
    return call, checked


def _shared_worker(comm, sizes, plan, collective):
    """The collective on shared arrays (comm.empty): the single-copy path."""
    out = []
    for size in sizes:
        call, check = _shared_call(comm, collective, plan, size)
        call(0)
        check()
        out.append(measure(call, CommSync(comm), plan.iters, plan.target_s))
        del call, check
    return out


def run_shared(sizes, nprocs, plan, options, collective="allreduce"):
    """{size: summary} of the single-copy `collective` on shared arrays."""
    import shmtree
    per_rank = shmtree.run(_shared_worker, nprocs, args=(sizes, plan, collective), **options)
    return {size: slowest([r[k] for r in per_rank]) for k, size in enumerate(sizes)}
