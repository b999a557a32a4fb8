"""The measurement protocol shared by every column of every table.

One measurement of one operation at one size, inside every rank at once:

1. all ranks meet at a barrier; each makes one untimed call (first touch, lazy setup);
2. each times 5 more calls one by one (and, if those took under a millisecond in all, up to 100
   more, about a millisecond's worth); the median of those per-call times, maximised over the
   ranks (``sync.max``), is the estimate, so every rank derives the same warmup and iteration
   counts from it (collectives must be called the same number of times everywhere);
3. a few warmup calls (about 20 ms worth, at most 100), a barrier, then N timed calls, each timed
   on its own with ``time.perf_counter``; N is given (``--iters``) or adaptive: enough calls for
   about 0.2 s, at least 3, at most 20000;
4. the rank reports the median of its N per-call times; the caller reports the maximum over
   ranks of those medians.

``sync`` is any object with ``barrier()`` and ``max(seconds) -> seconds`` that all ranks call
together: a shmtree communicator, the fork harness of the baselines, an MPI or gloo wrapper.

``Buffers`` holds the arrays a rank passes to its calls: by default one input and one output that
stay warm in cache; with ``fresh`` a rotation of input/output pairs carved from arenas bigger
than the last-level cache, so that every call starts cache-cold.

``COLLECTIVES``, ``layout``, ``fill`` and ``check`` say, for every collective that ``compare``
measures, how many items a rank's input and output hold for a message size, what the inputs
hold and what the first call must have produced.  A size is the whole buffer, as nccl-tests
counts it: the message of allreduce, broadcast, reduce, scan and exscan; allgather's and
gather's result, reduce_scatter's and scatter's input, alltoall's input (and output), each P
blocks of size / P bytes (rounded down to whole items, at least one item per block).
``alltoallv`` is alltoall with counts (shmtree's ``alltoall(x, counts=...)``, MPI_Alltoallv):
the same buffers, blocks and check as alltoall, the counts P equal blocks of items (the FFT
transpose's case), so that its table reads beside alltoall's.

This module imports only the standard library and numpy: ``mpi_worker.py`` loads it by path in
another interpreter (another virtualenv) where shmtree itself may not be importable.
"""
import math
import statistics
import time

import numpy as np

TARGET_S = 0.2
MIN_ITERS = 3
MAX_ITERS = 20000
WARMUP_S = 0.02
MAX_WARMUP = 100
PROBE_S = 1e-3
PROBE_CALLS = 5
PAGE = 4096

# the bench's op table (units.OPS are its names): a subset of shmtree's, spelled the same way
# (shmtree._kernels.OP_CODES / UFUNC_CODES, not imported here: see above)
UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def iteration_counts(per_call_s, iters=None, target_s=TARGET_S):
    """(warmup calls, timed calls) for an operation that takes per_call_s seconds."""
    per_call_s = max(per_call_s, 1e-7)
    warmup = min(MAX_WARMUP, max(1, math.ceil(WARMUP_S / per_call_s)))
    if iters is None:
        iters = min(MAX_ITERS, max(MIN_ITERS, math.ceil(target_s / per_call_s)))
    return warmup, iters


def measure(call, sync, iters=None, target_s=TARGET_S):
    """Time call(i) on this rank, all ranks together; returns this rank's summary dict."""
    sync.barrier()
    call(0)
    estimate = _estimate(call, PROBE_CALLS, sync)
    if estimate * PROBE_CALLS < PROBE_S:  # too few to go by: probe about a millisecond's worth
        estimate = _estimate(call, min(MAX_WARMUP, math.ceil(PROBE_S / estimate)), sync)
    warmup, iters = iteration_counts(estimate, iters, target_s)
    for i in range(warmup):
        call(2 + i)
    samples = [0.0] * iters
    sync.barrier()
    for i in range(iters):
        start = time.perf_counter()
        call(i)
        samples[i] = time.perf_counter() - start
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "mean_s": statistics.fmean(samples), "iters": iters}


def _estimate(call, count, sync):
    """Median seconds per call over `count` calls, the slowest rank's (the same on every rank)."""
    times = [0.0] * count
    for i in range(count):
        start = time.perf_counter()
        call(1 + i)
        times[i] = time.perf_counter() - start
    return sync.max(statistics.median(times))


def slowest(per_rank):
    """Combine the ranks' summaries: the maximum over ranks of each rank's median."""
    worst = max(per_rank, key=lambda s: s["median_s"])
    return {"median_s": worst["median_s"], "min_s": min(s["min_s"] for s in per_rank),
            "iters": worst["iters"]}


class Buffers:
    """Input arrays of `count` items and output arrays of `out_count` items (default: `count`)
    for one rank, warm or rotating cache-cold.  Every input holds rank + 1."""

    def __init__(self, count, dtype, rank, fresh=False, rotation_bytes=0, out_count=None):
        dtype = np.dtype(dtype)
        out_count = count if out_count is None else out_count
        strides = [_round_up(n * dtype.itemsize, PAGE) // dtype.itemsize
                   for n in (count, out_count)]
        slots = max(2, math.ceil(rotation_bytes / (max(strides) * dtype.itemsize))) \
            if fresh else 1
        self.inputs = _carve(np.full(slots * strides[0], rank + 1, dtype=dtype), strides[0],
                             count)
        self.outputs = _carve(np.zeros(slots * strides[1], dtype=dtype), strides[1], out_count)
        self.count, self.out_count = count, out_count

    def __len__(self):
        return len(self.inputs)

    def pair(self, i):
        """(input, output) for call i."""
        k = i % len(self.inputs)
        return self.inputs[k], self.outputs[k]


def _round_up(n, multiple):
    return max(multiple, -(-n // multiple) * multiple)


def _carve(arena, stride, count):
    return [arena[k * stride: k * stride + count] for k in range(len(arena) // stride)]


def expected(op, dtype, size):
    """The value every element of the result must have: rank r contributes r + 1."""
    contributions = np.arange(1, size + 1).astype(dtype)
    return UFUNCS[op].reduce(contributions, dtype=dtype)


def verify(result, op, size, what, collective="allreduce"):
    """Raise RuntimeError unless every element of result is the expected value."""
    want = expected(op, result.dtype, size)
    if not np.all(result == want):
        bad = result[result != want].ravel()[:3]
        raise RuntimeError(f"{what}: wrong {collective} result: expected {want!r}, got {bad!r}")


COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter",
               "alltoall", "alltoallv", "gather", "scatter", "scan", "exscan")
EXCHANGES = ("alltoall", "alltoallv")   # alltoallv: alltoall(counts=) / MPI_Alltoallv of P
                                        # equal counts (the FFT transpose), alltoall's layout
MOVES_ONLY = ("broadcast", "allgather") + EXCHANGES + ("gather", "scatter")   # no op: bytes
GATHERING = ("allgather", "gather")               # input: one block; output: P blocks
SPLITTING = ("reduce_scatter", "scatter")         # input: P blocks; output: one block
BLOCKED = GATHERING + SPLITTING + EXCHANGES       # sizes rounded to P equal blocks


def layout(collective, nbytes, dtype, nprocs):
    """(input items, output items) of one rank for a message of `nbytes`, the whole buffer:
    allgather and gather gather P blocks into the output (gather's only on the root, rank 0),
    reduce_scatter reduces and scatter splits an input of P blocks (scatter's only on the root),
    alltoall sends an input of P blocks and receives as many; the others have input and output
    of the message's size.  Broadcast runs in place (the input is also the output on every
    rank), as MPI_Bcast does."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}: choose one of "
                         f"{', '.join(COLLECTIVES)}")
    count = max(1, nbytes // np.dtype(dtype).itemsize)
    if collective in BLOCKED:
        block = max(1, count // nprocs)
        whole = block * nprocs
        return ((block, whole) if collective in GATHERING else
                (whole, block) if collective in SPLITTING else (whole, whole))
    return count, count


def whole_bytes(collective, nbytes, dtype, nprocs):
    """The bytes a size stands for once rounded to whole items (and blocks): the larger of a
    rank's input and output."""
    return max(layout(collective, nbytes, dtype, nprocs)) * np.dtype(dtype).itemsize


def tag(source, dest, nprocs):
    """What alltoall's block for rank `dest` holds in rank `source`'s input: a value of its own
    for every (source, dest) pair (up to 100 pairs), small enough for every dtype."""
    return 1 + (source * nprocs + dest) % 100


def fill(collective, rank, nprocs, inputs):
    """Give the input arrays (each laid out by `layout`) what `check` expects of `collective`
    where Buffers' "every input holds rank + 1" does not say which block went where: alltoall's
    (and alltoallv's) block d of rank r holds tag(r, d); the root's (rank 0's) scatter input holds d + 1 in block
    d.  Other collectives' inputs are left as they are."""
    if collective not in EXCHANGES + ("scatter",) or (collective == "scatter" and rank != 0):
        return
    for x in inputs:
        blocks = x.reshape(nprocs, -1)
        for d in range(nprocs):
            blocks[d] = tag(rank, d, nprocs) if collective in EXCHANGES else d + 1


def check(collective, op, rank, nprocs, bufs, what):
    """Raise RuntimeError unless the first call on Buffers `bufs` (pair 0, inputs as `fill`
    left them) produced what `collective` must produce on this rank (rank r contributed r + 1
    everywhere, root 0).  exscan's rank 0 is not checked: MPI_Exscan leaves it undefined."""
    x, out = bufs.pair(0)
    if collective in ("allreduce", "reduce_scatter") or (collective == "reduce" and rank == 0):
        verify(out, op, nprocs, what, collective)
    elif collective in ("scan", "exscan"):
        if collective == "scan" or rank > 0:      # the ranks 0..r (0..r-1): r + 1 (r) inputs
            verify(out, op, rank + (collective == "scan"), what, collective)
    elif collective == "broadcast":
        _same(x, 1, what, collective, "")          # the root's (rank 0's) value, in place
    elif collective == "scatter":
        _same(out, rank + 1, what, collective, "")
    elif collective in ("allgather",) + EXCHANGES or (collective == "gather" and rank == 0):
        blocks = out.reshape(nprocs, -1)
        for r in range(nprocs):
            want = tag(r, rank, nprocs) if collective in EXCHANGES else r + 1
            _same(blocks[r], want, what, collective, f"block {r} ")


def _same(got, value, what, collective, where):
    want = np.array(value).astype(got.dtype)
    if not np.all(got == want):
        raise RuntimeError(f"{what}: wrong {collective} result: {where}expected {want!r}, "
                           f"got {got[got != want].ravel()[:3]!r}")


class Plan:
    """What to measure at every size: dtype, op, iteration policy, buffer policy, timeout."""

    def __init__(self, dtype="float32", op="sum", iters=None, target_s=TARGET_S, fresh=False,
                 rotation_bytes=0, timeout=60.0):
        self.dtype, self.op = np.dtype(dtype).name, op
        self.iters, self.target_s = iters, target_s
        self.fresh, self.rotation_bytes = fresh, rotation_bytes
        self.timeout = timeout

    def as_dict(self):
        return dict(vars(self))
