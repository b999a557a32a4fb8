"""The single copy of private buffers by cross-memory attach (engine/alg_cma.pxi): the large
allgather and every exchange (alltoall with and without counts=, gather, scatter, scan's two
exchanges) read their blocks straight out of the senders' buffers with process_vm_readv.

Against numpy, with the single copy allowed and forced off (SHMTREE_CMA=0), so that both paths
stay tested on every machine; P = 1..5 (more processes than cores); every dtype the collectives
move; blocks just below, at and above the threshold (Engine.cma_bytes), one byte either side of
a read chunk (Engine.cma_chunk), 4099 items, several chunks, calls around the bytes in all
(Engine.cma_total), and the default threshold and chunk (1 MiB +- 1 byte blocks); counts with
zeros; non-contiguous inputs; in place.  Each call's path is
checked (the engine's cma_counts).  A peer killed mid-copy: every surviving rank raises,
nothing is left in /dev/shm (the autouse fixture, and a listing here)."""
import math
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import shmtree
from procutil import error_name, new_shm_entries, run_ok, shm_listing, stop_processes
from shmtree.frontend import calls, collectives

try:
    import ml_dtypes
except ImportError:                       # pragma: no cover
    ml_dtypes = None

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128", ">i4", "<f8", "S3",
          "datetime64[ns]", [("a", "<i2"), ("b", ">f8")]] + (["bfloat16"] if ml_dtypes else [])
THRESHOLD = 4000                  # cma_bytes in the small battery (and cma_total 0) ...
CHUNK = 4096                      # ... cma_chunk
TOTAL = 1 << 17                   # ... cma_total where the bytes in all are tested
# block sizes in bytes (rounded up to whole items): below, at and above the threshold, a chunk
# -1 / +1, several chunks; and 4099 items
BLOCKS = [THRESHOLD - 1, THRESHOLD, CHUNK - 1, CHUNK + 1, 3 * CHUNK + 5, "4099"]
CMA_CHUNK = 1 << 20               # alg_cma.pxi's defaults
CMA_BYTES = 64 << 10
CMA_TOTAL = 16 << 20


def cma_expected():
    """Does this machine let sibling processes of one user read each other's memory (no Yama
    ptrace scope above 0, no seccomp filter)?  Then the probe must say yes."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            if f.read().strip() != "0":
                return False
    except OSError:
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Seccomp:"):
                return line.split()[1] == "0"
    return True


def dt(name):
    return np.dtype(getattr(ml_dtypes, name)) if name == "bfloat16" else np.dtype(name)


def data(dtype, n, rank, seed):
    """n items of dtype, from (rank, seed) alone (every rank can make every rank's)."""
    rng = np.random.default_rng([rank, seed, n, 77])
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "b":
        raw &= 1
    elif dtype.kind in "Mm":
        raw = rng.integers(-10**9, 10**9, size=n).astype(np.int64).view(np.uint8)
    elif dtype.kind in "fc":                  # (no NaN: scan folds them)
        vals = rng.integers(-50, 50, size=n * (2 if dtype.kind == "c" else 1))
        if dtype.kind == "c":
            vals = vals[0::2] + 1j * vals[1::2]
        return vals.astype(dtype)
    return raw.view(dtype) if n else np.empty(0, dtype)


def same(got, want, d):
    """got is of dtype d and holds the very bytes of want in d (np.stack and np.concatenate
    give native byte order)."""
    got, want = np.asarray(got), np.asarray(want)
    return got.dtype == d and got.shape == want.shape and \
        np.ascontiguousarray(got).tobytes() == want.astype(d).tobytes()


def counts_of(P, src, seed, n):
    """Rows rank src sends each rank (zeros included: one destination, and rank seed % P's
    whole row)."""
    if src == seed % P and P > 1:
        return [0] * P
    return [0 if q == (src + seed) % P and P > 1 else n + (src + 2 * q + seed) % 3
            for q in range(P)]


def cases(P, small):
    """(collective, dtype, items or rows per block, how) of one battery."""
    out = []
    if small:
        for name in DTYPES:
            d = dt(name)
            for b in BLOCKS:
                n = 4099 if b == "4099" else max(1, -(-b // d.itemsize))
                for coll in ("alltoall", "allgather", "gather", "scatter"):
                    out.append((coll, name, n, "plain"))
            rows = max(1, -(-(THRESHOLD + 1) // (3 * d.itemsize)))
            for coll in ("counts", "gather0", "scatter0", "allgather0"):
                out.append((coll, name, rows, "plain"))
            n = -(-(2 * CHUNK + 3) // d.itemsize)
            for coll in ("alltoall", "allgather", "gather", "scatter", "counts"):
                out.append((coll, name, n if coll != "counts" else rows, "strided"))
            out.append(("allgather", name, n, "inplace"))
            out.append(("alltoall", name, n, "out"))
        for name in ("float64", "int32"):
            out.append(("scan", name, P * 2000 + 3, "plain"))
            out.append(("exscan", name, P * 2000 + 3, "plain"))
        for name in ("uint8", "float64"):             # around the bytes in all (cma_total)
            d = dt(name)
            for coll, parts in (("alltoall", P * P), ("allgather", P * P), ("gather", P),
                                ("scatter", P)):
                n = TOTAL // parts // d.itemsize
                for k in (n - 1, n, n + 1):
                    out.append((coll, name, k, "total"))
    else:
        # the default threshold: blocks around CMA_TOTAL / P^2 bytes (P = 4: a read chunk -1,
        # 0, +1), CMA_TOTAL / P for the rooted ones
        for coll, parts in (("alltoall", P * P), ("allgather", P * P), ("gather", P),
                            ("scatter", P)):
            for n in (CMA_TOTAL // parts - 1, CMA_TOTAL // parts, CMA_TOTAL // parts + 1):
                out.append((coll, "uint8", n, "plain"))
        out.append(("counts", "uint8", CMA_TOTAL // (3 * P * P) + 5, "plain"))
    return out


def run_case(comm, i, coll, name, n, how):
    """Run one case: (result right, largest block in bytes, bytes in all, which engine call
    moves them: "x" the exchange, "ag" the allgather, None not checked, how many such)."""
    P, me = comm.size, comm.rank
    d = dt(name)
    root = i % P
    if coll == "alltoall":
        xs = [data(d, P * n, s, i).reshape(P, n) for s in range(P)]
        want = np.stack([xs[s][me] for s in range(P)])
        x = xs[me]
        if how == "strided":
            x = np.repeat(x, 2, axis=1)[:, ::2]
        if how == "out":
            o = np.empty_like(x)
            got = comm.alltoall(x, out=o)
            ok = got is o
        else:
            got, ok = comm.alltoall(x), True
        return ok and same(got, want, d), n * d.itemsize, P * P * n * d.itemsize, "x", 1
    if coll == "counts":
        C = [counts_of(P, s, i, n) for s in range(P)]
        xs = [data(d, 3 * sum(C[s]), s, i).reshape(-1, 3) for s in range(P)]
        bounds = [np.cumsum([0] + C[s]) for s in range(P)]
        want = np.concatenate([xs[s][bounds[s][me]:bounds[s][me + 1]] for s in range(P)])
        x = xs[me]
        if how == "strided":
            x = np.repeat(x, 2, axis=0)[::2]
        got = comm.alltoall(x, counts=C[me])
        row = 3 * d.itemsize
        largest = max([C[s][q] for s in range(P) for q in range(P) if q != s] or [0]) * row
        return same(got, want, d), largest, sum(map(sum, C)) * row, "x", 1
    if coll in ("allgather", "gather"):
        xs = [data(d, n, s, i) for s in range(P)]
        want = np.stack(xs)
        x = xs[me]
        block = n * d.itemsize
        kind = "ag" if coll == "allgather" or collectives.gather_gathers(
            block, P, comm.group.plan.small_bytes) else "x"
        if how == "strided":
            x = np.repeat(x, 2)[::2]
        if how == "inplace":
            o = np.empty((P, n), d)
            o[me] = x
            got = comm.allgather(o[me], out=o)
            ok = got is o
        elif coll == "allgather":
            got, ok = comm.allgather(x), True
        else:
            got = comm.gather(x, root=root)
            if me != root:
                return got is None, block, P * block, kind, 1
            ok = True
        return ok and same(got, want, d), block, P * block, kind, 1
    if coll == "scatter":
        x = data(d, P * n, root, i).reshape(P, n)
        if how == "strided":
            x = np.repeat(x, 2, axis=1)[:, ::2]
        got = comm.scatter(x if me == root else None, root=root)
        return same(got, x[me], d), n * d.itemsize, P * n * d.itemsize, "x", 1
    if coll in ("gather0", "allgather0"):
        rows = [0 if s == i % P and P > 1 else n + s for s in range(P)]
        xs = [data(d, 3 * rows[s], s, i).reshape(-1, 3) for s in range(P)]
        want = np.concatenate(xs)
        row = 3 * d.itemsize
        sizes = (max(rows) * row, sum(rows) * row)
        if coll == "allgather0":
            return (same(comm.allgather(xs[me], axis=0), want, d),) + sizes + ("ag", 1)
        got = comm.gather(xs[me], root=root, axis=0)
        ok = got is None if me != root else same(got, want, d)
        return (ok,) + sizes + ("x", 1)
    if coll == "scatter0":
        m = P * n + 2
        x = data(d, 3 * m, root, i).reshape(m, 3)
        got = comm.scatter(x if me == root else None, root=root, axis=0)
        b = calls.split_bounds(m, P)
        return same(got, x[b[me]:b[me + 1]], d), (n + 1) * 3 * d.itemsize, \
            3 * m * d.itemsize, "x", 1
    # scan / exscan: the transpose scheme's two exchanges, or one allgather (not checked)
    xs = [data(d, n, s, i) for s in range(P)]
    stack = np.stack(xs)
    want = np.cumsum(stack, axis=0, dtype=d)
    if coll == "exscan":
        got = comm.exscan(xs[me])
        ok = me == 0 or same(got, want[me - 1], d)
    else:
        got = comm.scan(xs[me])
        ok = same(got, want[me], d)
    return ok, 0, 0, None, 0


def battery(comm, small):
    """Every case; returns (wrong results, wrong paths, the probe's answer)."""
    eng = comm._engine
    if small:
        eng.cma_bytes, eng.cma_chunk, eng.cma_total = THRESHOLD, CHUNK, 0
    assert (eng.cma_bytes, eng.cma_chunk, eng.cma_total) == (
        (THRESHOLD, CHUNK, 0) if small else (CMA_BYTES, CMA_CHUNK, CMA_TOTAL))
    limit = {"x": comm.group.plan.selection()[calls.ALLTOALL][0],
             "ag": comm.group.plan.selection()[calls.ALLGATHER][0]}
    comm.barrier()                         # (the probe: after the first call's round at latest)
    state = eng.cma_state
    wrong, paths = [], []
    for i, (coll, name, n, how) in enumerate(cases(comm.size, small)):
        if small:
            eng.cma_total = TOTAL if how == "total" else 0
        before = eng.cma_counts()["calls"]
        ok, largest, total, kind, count = run_case(comm, i, coll, name, n, how)
        took = eng.cma_counts()["calls"] - before
        if not ok:
            wrong.append((coll, str(name), n, how))
        if kind is None:
            continue
        whole = total if kind == "x" else comm.size * total      # (every rank's output)
        want = count if (state == "yes" and comm.size > 1 and largest >= eng.cma_bytes
                         and whole >= eng.cma_total and total > limit[kind]) else 0
        if took != want:
            paths.append((coll, str(name), n, how, largest, total, took, want))
    return wrong, paths, state


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cma", ["on", "off"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
def test_against_numpy(P, cma, monkeypatch):
    if cma == "off":
        monkeypatch.setenv("SHMTREE_CMA", "0")
    else:
        monkeypatch.delenv("SHMTREE_CMA", raising=False)
    outs = run_ok(battery, P, args=(True,), chunk_bytes=4096, small_bytes=1024)
    for rank, (wrong, paths, state) in enumerate(outs):
        assert wrong == [], (rank, wrong[:10])
        assert paths == [], (rank, paths[:10])
        if cma == "off":
            assert state == "off"
        elif P == 1:
            assert state == "no"
        elif cma_expected():
            assert state == "yes", state


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cma", ["on", "off"])
@pytest.mark.parametrize("P", [2, 4])
def test_default_chunk_and_threshold(P, cma, monkeypatch):
    """The engine's own threshold and chunk: calls whose bytes in all are just below, at and
    above CMA_TOTAL (at P = 4 the alltoall's blocks are a read chunk -1, 0, +1)."""
    if cma == "off":
        monkeypatch.setenv("SHMTREE_CMA", "0")
    else:
        monkeypatch.delenv("SHMTREE_CMA", raising=False)
    outs = run_ok(battery, P, args=(False,))
    for rank, (wrong, paths, state) in enumerate(outs):
        assert wrong == [], (rank, wrong)
        assert paths == [], (rank, paths)
        assert state == ("off" if cma == "off" else "yes" if cma_expected() else "no")


# ---------------------------------------------------------------------------------------------
# the bytes: each rank reads (P-1)/P of the message, once, and publishes nothing into shared
# memory


def bytes_worker(comm, n):
    P, me = comm.size, comm.rank
    x = np.arange(P * n, dtype=np.float64).reshape(P, n) + me
    out = {}
    comm.barrier()
    for name, call in (("alltoall", lambda: comm.alltoall(x)),
                       ("allgather", lambda: comm.allgather(x[0])),
                       ("gather", lambda: comm.gather(x[0], root=P - 1)),
                       ("scatter", lambda: comm.scatter(x if me == 1 else None, root=1))):
        before = comm.stats()["bytes_sent"], comm._engine.cma_counts()["bytes"]
        call()
        out[name] = (comm.stats()["bytes_sent"] - before[0],
                     comm._engine.cma_counts()["bytes"] - before[1])
    return out, comm._engine.cma_state


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_single_copy_reads_the_minimum(P):
    """alltoall and allgather: every rank reads the P-1 blocks of the others, X (P-1)/P of the
    message, and publishes nothing (the descriptor round carries no data); gather: the root
    reads P-1 blocks; scatter: every rank but the root reads its own block (the docs/
    algorithms.md table's counterpart of test_ring_algorithms_send_the_minimum)."""
    n = -(-CMA_TOTAL // (8 * P))                  # (the bytes in all: the threshold)
    outs = run_ok(bytes_worker, P, args=(n,))
    block = n * 8
    for rank, (got, state) in enumerate(outs):
        if state != "yes":
            assert not cma_expected(), state
            pytest.skip(f"no cross-memory attach here ({state})")
        assert got["alltoall"] == (0, (P - 1) * block), (rank, got)
        assert got["allgather"] == (0, (P - 1) * block), (rank, got)
        assert got["gather"] == (0, (P - 1) * block if rank == P - 1 else 0), (rank, got)
        # (scatter: plus its first round, the claims and the root's description, no data)
        assert got["scatter"][0] < 1024 and got["scatter"][1] == (0 if rank == 1 else block), \
            (rank, got)


# ---------------------------------------------------------------------------------------------
# a peer killed mid-copy


BIG = 24 << 20                    # bytes per rank's input: a call of a few ms


def killed_member(group, rank, victim, coll, ready, queue):
    """One member: large calls in a loop; the victim sets `ready` as its third call begins and
    is killed by the parent.  Survivors report (rank, error name, message, when).  coll:
    alltoall, allgather (every rank reads every other), gather / scatter "-reader" (the victim
    reads: the gather's root, a scatter's receiver, and the others wait for it to finish) or
    "-sender" (the others read the victim's buffer: a gather's sender, the scatter's root)."""
    try:
        comm = group.join(rank)
        P = comm.size
        x = np.ones((P, BIG // P // 8))
        out = np.empty_like(x)
        comm.barrier(timeout=60)
        root = victim if coll in ("gather-reader", "scatter-sender") else (victim + 1) % P
        for i in range(10 ** 9):
            if rank == victim and i == 2:
                ready.set()
            if coll == "alltoall":
                comm.alltoall(x, out=out)
            elif coll == "allgather":
                comm.allgather(x[0], out=out)
            elif coll.startswith("gather"):
                comm.gather(x[0], root=root, out=out if rank == root else None)
            else:
                comm.scatter(x if rank == root else None, root=root, out=out[0])
            assert comm._engine.cma_counts()["calls"] == i + 1 or \
                comm._engine.cma_state != "yes"
    except BaseException as e:  # noqa: B036 -- reported to the parent
        queue.put((rank, error_name(e), str(e), time.monotonic()))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("coll", ["alltoall", "allgather", "gather-reader", "gather-sender",
                                  "scatter-reader", "scatter-sender"])
def test_peer_killed_mid_copy(coll):
    """SIGKILL of a rank while the others read its buffer, or wait for it to finish reading
    theirs: every survivor raises PeerLostError within a few seconds (one of them naming the
    dead rank), nobody hangs, nothing is left in /dev/shm."""
    P, victim = 3, 1
    before = shm_listing()
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    ready = ctx.Event()
    procs, reports = [], {}
    with shmtree.Group(P) as group:
        try:
            for rank in range(P):
                p = ctx.Process(target=killed_member,
                                args=(group, rank, victim, coll, ready, queue))
                p.start()
                procs.append(p)
            assert ready.wait(60), "the victim never reached its third call"
            time.sleep(0.003)
            struck = time.monotonic()
            os.kill(procs[victim].pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while len(reports) < P - 1 and time.monotonic() < deadline:
                if queue.empty():
                    time.sleep(0.005)
                    continue
                rank, name, msg, t = queue.get()
                reports[rank] = (name, msg, t - struck)
        finally:
            stop_processes(procs)
    assert sorted(reports) == [0, 2], reports
    for rank, (name, msg, s) in reports.items():
        assert name == "PeerLostError", (rank, name, msg)
        assert s < 5.0, (rank, s)
    assert any(f"rank {victim} died" in msg for _, msg, _ in reports.values()), reports
    assert new_shm_entries(before) == []


# ---------------------------------------------------------------------------------------------
# a read that fails while every peer lives


def unreadable_worker(comm):
    """Rank 1's gather input lies in pages it made unreadable (PROT_NONE): the root's read
    fails (EFAULT) while rank 1 lives and waits for it."""
    import ctypes
    import mmap

    eng = comm._engine
    eng.cma_bytes, eng.cma_total = 4096, 0
    n = 1 << 20
    mm = mmap.mmap(-1, n)
    x = np.frombuffer(mm, np.uint8)
    x[:] = 7
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    addr = x.ctypes.data                  # (mmap's pages: page-aligned)
    comm.barrier()
    state = eng.cma_state
    t0 = time.monotonic()
    if comm.rank == 1:
        assert libc.mprotect(addr, n, 0) == 0                # PROT_NONE
    try:
        comm.gather(x, root=0, timeout=30)
        return state, "returned", "", time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 -- reported
        return state, error_name(e), str(e), time.monotonic() - t0
    finally:
        if comm.rank == 1:
            libc.mprotect(addr, n, mmap.PROT_READ | mmap.PROT_WRITE)


@pytest.mark.timeout(60)
def test_failed_read_is_said_on_every_rank():
    """No peer died, yet a read fails: the reader aborts the group after its grace (2.5 s)
    with a note that says which read failed, and every rank raises it."""
    outs = run_ok(unreadable_worker, 2)
    if outs[0][0] != "yes":
        assert not cma_expected()
        pytest.skip(f"no cross-memory attach here ({outs[0][0]})")
    for rank, (state, name, msg, s) in enumerate(outs):
        assert name == "PeerLostError", (rank, name, msg)
        assert "rank 0 could not read rank 1's buffer (process_vm_readv: Bad address)" in msg, \
            (rank, msg)
        assert "SHMTREE_CMA=0" in msg and 2.4 < s < 15, (rank, msg, s)
