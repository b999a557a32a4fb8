"""Nonblocking collectives (docs/design.md, "Nonblocking calls"; docs/guide/nonblocking.md).

iallreduce, ibroadcast, ireduce, iallgather, ireduce_scatter and ibarrier return a
shmtree.Request (a concurrent.futures.Future) that the communicator's progress thread completes
in issue order.  Checked here, each in a few shmtree.run groups of 2 or 3 ranks:

- results equal those of the blocking calls (and numpy's), small and large messages;
- blocking calls mixed with nonblocking ones, waits in any order, 100 outstanding, wait_all;
- the Future protocol: callbacks (in the progress thread; one that raises is only logged),
  concurrent.futures.wait, asyncio.wrap_future, cancel() False, test()/done(), repr;
- result(timeout) running out aborts nothing; the call's own timeout= aborts the group; a peer
  SIGKILLed fails outstanding requests with PeerLostError; a mismatch fails the request on every
  rank and leaves the group usable; local errors are raised by the posting call;
- close() waits for outstanding requests and ends the progress thread; a forked child cannot
  wait for its parent's requests nor use the communicator; Ctrl-C while waiting interrupts the
  wait, not the call (but aborts the group when the wait is a blocking call queued behind
  requests); an idle progress thread burns no CPU; a collective (or a wait) inside a
  completion callback raises instead of deadlocking; the module-level i-calls.

Workers return what they saw as data (error names, timings): a group aborted on purpose would
make shmtree.run raise WorkerError, so every expected failure is caught inside the worker.
"""
import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

import shmtree
from procutil import open_gate, run_ok, wait_gate
from test_collectives import check, make, reference, same_bytes, unwire, wire

SMALL, LARGE = 7, 70001          # inline, and a non-multiple of every chunk size
PROGRESS_PREFIX = "shmtree-progress-"


def outcome(fn):
    """(error class name or "ok", value or message, seconds) of fn()."""
    t0 = time.monotonic()
    try:
        return "ok", fn(), time.monotonic() - t0
    except BaseException as e:  # noqa: B036 -- KeyboardInterrupt is data here
        return type(e).__name__, str(e), time.monotonic() - t0


def ints(n, i, rank, dtype=np.float64):
    """Call i's input on `rank`: small integers, so that sums are exact in any order."""
    return ((np.arange(n) % 13) + 100 * i + rank + 1).astype(dtype)


def progress_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith(PROGRESS_PREFIX)]


# ---------------------------------------------------------------------------------------------
# 1. results equal the blocking calls'

ALLREDUCE_CASES = [("float64", "sum"), ("float32", "max"), ("int32", "prod"), ("int8", "min"),
                   ("uint16", "bxor"), ("bool", "sum"), ("complex128", "sum")]


def equal_worker(comm, sizes):
    P, me = comm.size, comm.rank
    root = P - 1                                # a non-zero root
    out = []
    for n in sizes:
        for dtype, op in ALLREDUCE_CASES:
            x = make(dtype, op, n, me)
            got = comm.iallreduce(x, op).wait()
            buf = np.empty_like(x)
            req = comm.iallreduce(x, op, out=buf)
            assert req.wait() is buf
            out.append(("allreduce", dtype, op, n, wire(got), wire(buf),
                        wire(comm.allreduce(x, op))))

        x = make("float64", None, n, root) if me == root else None
        got = comm.ibroadcast(x, root=root).wait()
        shaped = make("float64", None, n, root) if me == root else np.zeros(n)
        got2 = comm.ibroadcast(shaped, root=root).wait()    # non-roots: values ignored
        out.append(("broadcast", "float64", None, n, wire(got), wire(got2),
                    wire(comm.broadcast(x, root=root))))

        x = make("int32", "sum", n, me)
        got = comm.ireduce(x, "sum", root=1).wait()
        out.append(("reduce", "int32", "sum", n, wire(got), None,
                    wire(comm.reduce(x, "sum", root=1))))

        x = make("float32", None, n, me)
        out.append(("allgather", "float32", None, n, wire(comm.iallgather(x).wait()), None,
                    wire(comm.allgather(x))))
        x = make("int16", None, n + me, me)                 # uneven lengths along axis 0
        out.append(("allgather0", "int16", None, n, wire(comm.iallgather(x, axis=0).wait()),
                    None, wire(comm.allgather(x, axis=0))))

        x = make("float64", "sum", n, me)                   # n is not a multiple of P
        out.append(("reduce_scatter", "float64", "sum", n,
                    wire(comm.ireduce_scatter(x, "sum").wait()), None,
                    wire(comm.reduce_scatter(x, "sum"))))

        out.append(("barrier", None, None, n, comm.ibarrier().wait(), None, None))
    return out


def expected(kind, dtype, op, n, P, rank):
    root = P - 1
    if kind == "allreduce":
        return reference(dtype, op, [make(dtype, op, n, r) for r in range(P)])
    if kind == "broadcast":
        return make(dtype, None, n, root)
    if kind == "reduce":
        return reference(dtype, op, [make(dtype, op, n, r) for r in range(P)]) \
            if rank == 1 else None
    if kind == "allgather":
        return np.stack([make(dtype, None, n, r) for r in range(P)])
    if kind == "allgather0":
        return np.concatenate([make(dtype, None, n + r, r) for r in range(P)])
    if kind == "reduce_scatter":
        return np.array_split(reference(dtype, op, [make(dtype, op, n, r) for r in range(P)]),
                              P)[rank]
    return None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("P", [2, 3])
def test_results_equal_blocking_calls(P):
    outs = run_ok(equal_worker, P, args=((SMALL, LARGE),))
    first = outs[0]
    for rank, out in enumerate(outs):
        assert len(out) == len(first)
        for i, (kind, dtype, op, n, got, got2, blocking) in enumerate(out):
            what = (rank, kind, dtype, op, n)
            if kind == "barrier":
                assert got is None, what
                continue
            got, got2, blocking = unwire(got), unwire(got2), unwire(blocking)
            want = expected(kind, dtype, op, n, P, rank)
            if want is None:
                assert got is None and blocking is None, what
                continue
            check(got, want, dtype, op)
            # the same bits as the blocking call, and on every rank (the reducing kinds)
            assert got.dtype == blocking.dtype and same_bytes(got, blocking), what
            if got2 is not None:
                assert same_bytes(got2, got), what
            if kind in ("allreduce", "broadcast", "allgather", "allgather0"):
                assert same_bytes(got, unwire(first[i][4])), what


# ---------------------------------------------------------------------------------------------
# 2. blocking and nonblocking calls mixed, in the same order on every rank

MIXED_STEPS = 24


def mixed_step(comm, i, blocking):
    """Call i (kind and size from i, input from i and the rank): its result or its request."""
    P, me = comm.size, comm.rank
    n = (5, 3001, LARGE)[i % 3]
    kind = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "barrier",
            "allgather0")[i % 7]
    x = ints(n, i, me)
    if kind == "allreduce":
        call = (comm.allreduce if blocking else comm.iallreduce), (x,), {}
    elif kind == "broadcast":
        call = (comm.broadcast if blocking else comm.ibroadcast), \
            (x if me == i % P else None,), {"root": i % P}
    elif kind == "reduce":
        call = (comm.reduce if blocking else comm.ireduce), (x,), {"root": (i + 1) % P}
    elif kind == "allgather":
        call = (comm.allgather if blocking else comm.iallgather), (x,), {}
    elif kind == "allgather0":
        call = (comm.allgather if blocking else comm.iallgather), (ints(n + me, i, me),), \
            {"axis": 0}
    elif kind == "reduce_scatter":
        call = (comm.reduce_scatter if blocking else comm.ireduce_scatter), (x,), {}
    else:
        call = (comm.barrier if blocking else comm.ibarrier), (), {}
    fn, args, kw = call
    return fn(*args, **kw)


def mixed_expected(i, P, rank):
    n = (5, 3001, LARGE)[i % 3]
    kind = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "barrier",
            "allgather0")[i % 7]
    xs = [ints(n, i, r) for r in range(P)]
    if kind == "allreduce":
        return sum(xs)
    if kind == "broadcast":
        return xs[i % P]
    if kind == "reduce":
        return sum(xs) if rank == (i + 1) % P else None
    if kind == "allgather":
        return np.stack(xs)
    if kind == "allgather0":
        return np.concatenate([ints(n + r, i, r) for r in range(P)])
    if kind == "reduce_scatter":
        return np.array_split(sum(xs), P)[rank]
    return None


def mixed_order_worker(comm, pattern, gates):
    """pattern[i]: 'b' blocking, 'n' nonblocking.  A nonblocking call i followed by a blocking
    one: rank i % P holds back call i until every other rank has posted it and is about to
    make the blocking call (gates in the directory `gates`), so the others make that blocking
    call while their request i is outstanding (it is queued behind it)."""
    P, me = comm.size, comm.rank
    results = {}
    pending = {}
    queued = 0                  # blocking calls made while a request was outstanding
    for i, how in enumerate(pattern):
        if how == "n" and pattern[i + 1:i + 2] == "b" and me == i % P:
            for r in range(P):
                if r != me:
                    wait_gate(os.path.join(gates, f"{i}-{r}"))
        if how == "b":
            queued += any(not r.done() for r in pending.values())
            if pattern[i - 1:i] == "n" and me != (i - 1) % P:
                open_gate(os.path.join(gates, f"{i - 1}-{me}"))
            results[i] = outcome(lambda: mixed_step(comm, i, True))
        else:
            pending[i] = mixed_step(comm, i, False)
    for i, req in pending.items():
        results[i] = outcome(req.wait)
    errors = []
    for i in range(len(pattern)):
        name, value, _ = results[i]
        want = mixed_expected(i, P, me)
        if name != "ok":
            errors.append(f"call {i} ({pattern[i]}): {name}: {value}")
        elif (want is None) != (value is None) or (
                want is not None and not np.array_equal(value, want)):
            errors.append(f"call {i} ({pattern[i]}): wrong result")
    after = comm.allreduce(np.ones(3)).tolist()
    return errors, after, queued


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3])
def test_mixed_blocking_and_nonblocking_in_issue_order(P, tmp_path):
    pattern = "nnbnnnbbnbnnnnbnbbnnnbnn"[:MIXED_STEPS]
    outs = run_ok(mixed_order_worker, P, args=(pattern, str(tmp_path)))
    for rank, (errors, after, queued) in enumerate(outs):
        assert errors == [], (rank, errors)
        assert after == [float(P)] * 3
    assert sum(queued for _, _, queued in outs) >= 3, "too few blocking calls were queued"


# ---------------------------------------------------------------------------------------------
# 3. 100 outstanding, waited in reverse order; wait_all in the order given

MANY = 100


def late_rank_1(comm, gate):
    """Every rank meets, then rank 1 holds back its next call until rank 0 opens the gate (the
    path `gate`: procutil.open_gate) when it has seen what it checks while rank 1 is late."""
    comm.barrier()
    if comm.rank == 1:
        wait_gate(gate)


def rank_1_may_go(comm, gate):
    """Rank 0: let rank 1 (held back by late_rank_1) make its call."""
    if comm.rank == 0:
        open_gate(gate)


def many_worker(comm, gate):
    P, me = comm.size, comm.rank
    late_rank_1(comm, gate)                    # rank 0 holds all 100 outstanding meanwhile
    reqs = [mixed_step(comm, i, False) for i in range(MANY)]
    outstanding = sum(not r.done() for r in reqs)
    rank_1_may_go(comm, gate)
    errors = []
    for i in reversed(range(MANY)):
        got = reqs[i].wait()
        want = mixed_expected(i, P, me)
        if (want is None) != (got is None) or (want is not None and
                                               not np.array_equal(got, want)):
            errors.append(i)
    numbers = [r.number for r in reqs]
    # wait_all: results in the order given (not the issue order)
    order = [7, 2, 9, 0, 4, 1, 8, 3, 6, 5]
    batch = [comm.iallreduce(ints(2000 if j % 2 else 4, j, me)) for j in range(10)]
    got = shmtree.wait_all([batch[j] for j in order])
    wait_all_ok = all(np.array_equal(g, sum(ints(2000 if j % 2 else 4, j, r) for r in range(P)))
                      for g, j in zip(got, order))
    return outstanding, errors, numbers, wait_all_ok, isinstance(got, list) and len(got) == 10


@pytest.mark.timeout(120)
def test_hundred_outstanding_waited_in_reverse_and_wait_all_order(tmp_path):
    outs = run_ok(many_worker, 2, args=(str(tmp_path / "gate"),))
    outstanding, errors, numbers, wait_all_ok, is_list = outs[0]
    assert outstanding == MANY, f"rank 0 had only {outstanding} requests outstanding"
    for rank, (_, errors, numbers, wait_all_ok, is_list) in enumerate(outs):
        assert errors == [], (rank, errors)
        assert numbers == sorted(numbers) and len(set(numbers)) == MANY, numbers
        assert wait_all_ok and is_list, rank


# ---------------------------------------------------------------------------------------------
# 4. callbacks, concurrent.futures.wait, asyncio

class Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage() + " " + str(record.exc_info and
                                                            record.exc_info[1]))


def callbacks_worker(comm, gate):
    P, me = comm.size, comm.rank
    total = float(sum(range(1, P + 1)))
    rep = {}
    # a callback added while the request is pending runs in the progress thread
    late_rank_1(comm, gate)
    seen, ev = [], threading.Event()
    req = comm.iallreduce(np.full(4, me + 1.0))
    req.add_done_callback(lambda f: (seen.append((threading.current_thread().name,
                                                  f.result().tolist())), ev.set()))
    rank_1_may_go(comm, gate)
    rep["wait"] = req.wait().tolist()
    rep["callback_ran"] = ev.wait(5)
    rep["callback"] = seen

    # a callback that raises is logged (concurrent.futures' logger) and changes nothing else
    cap = Capture()
    logging.getLogger("concurrent.futures").addHandler(cap)
    try:
        if me == 1:
            time.sleep(0.2)
        after, ev2 = [], threading.Event()

        def bad(f):
            raise RuntimeError("callback boom")

        req = comm.iallreduce(np.full(3, me + 1.0))
        req.add_done_callback(bad)
        req.add_done_callback(lambda f: (after.append(f.result().tolist()), ev2.set()))
        rep["raising_result"] = req.wait().tolist()
        ev2.wait(5)
        rep["after_bad"] = after
        rep["later"] = [comm.iallreduce(np.full(2, me + 1.0)).wait().tolist(),
                        comm.allreduce(np.full(2, me + 1.0)).tolist()]
        rep["logged"] = [r for r in cap.records if "callback boom" in r]
    finally:
        logging.getLogger("concurrent.futures").removeHandler(cap)

    # concurrent.futures.wait
    reqs = [comm.iallreduce(np.full(LARGE if i % 2 else 5, i + me + 0.0)) for i in range(4)]
    done, not_done = concurrent.futures.wait(reqs, timeout=30)
    rep["cf_wait"] = (len(done), len(not_done),
                      all(float(r.result()[0]) == sum(i + r_ for r_ in range(P))
                          for i, r in enumerate(reqs)))
    first = comm.ibarrier()
    done, _ = concurrent.futures.wait([first], timeout=30,
                                      return_when=concurrent.futures.FIRST_COMPLETED)
    rep["cf_first"] = first in done

    # asyncio
    async def main():
        a = await asyncio.wrap_future(comm.iallreduce(np.full(3, me + 1.0)))
        b, c = await asyncio.gather(asyncio.wrap_future(comm.iallgather(np.array([me]))),
                                    asyncio.wrap_future(comm.ibarrier()))
        return a.tolist(), b.tolist(), c
    rep["asyncio"] = asyncio.run(main())
    rep["total"] = total
    return rep


@pytest.mark.timeout(90)
def test_callbacks_futures_wait_and_asyncio(tmp_path):
    for rank, rep in enumerate(run_ok(callbacks_worker, 2, args=(str(tmp_path / "gate"),))):
        total = rep["total"]
        assert rep["wait"] == [total] * 4
        assert rep["callback_ran"], rank
        [(thread, value)] = rep["callback"]
        if rank == 0:           # (rank 1's call may be over before it adds its callback)
            assert thread.startswith(PROGRESS_PREFIX), f"callback ran in thread {thread!r}"
        assert value == [total] * 4
        assert rep["raising_result"] == [total] * 3
        assert rep["after_bad"] == [[total] * 3], "the callback after a raising one did not run"
        assert rep["later"] == [[total] * 2, [total] * 2]
        assert rep["logged"], "the raising callback was not logged"
        assert rep["cf_wait"] == (4, 0, True)
        assert rep["cf_first"]
        assert rep["asyncio"] == ([total] * 3, [[0], [1]], None)


# ---------------------------------------------------------------------------------------------
# 5. result(timeout) vs the call's own timeout=

WAIT_TIMEOUT_S = 0.05
WAIT_RETURNS_S = 2.0        # result(timeout=WAIT_TIMEOUT_S) returns within this (rank 1 holds
                            # back its matching call up to procutil.GATE_HOLD_S: a wait that does
                            # not honour its timeout shows as one that took that long)


def wait_timeout_worker(comm, gate):
    """rank 1 makes its matching call only when rank 0 has waited with short timeouts."""
    me = comm.rank
    rep = {}
    late_rank_1(comm, gate)
    req = comm.iallreduce(np.full(5, me + 1.0))
    if me == 0:
        t0 = time.monotonic()
        try:
            req.result(timeout=WAIT_TIMEOUT_S)
            rep["result"] = ("returned", None, None, time.monotonic() - t0)
        except concurrent.futures.TimeoutError as e:
            rep["result"] = ("TimeoutError", isinstance(e, TimeoutError),
                             isinstance(e, shmtree.ShmtreeError), time.monotonic() - t0)
        rep["wait"] = outcome(lambda: req.wait(timeout=WAIT_TIMEOUT_S))[0]
        rep["exception"] = outcome(lambda: req.exception(timeout=WAIT_TIMEOUT_S))[0]
        rep["wait_all"] = outcome(lambda: shmtree.wait_all([req], timeout=WAIT_TIMEOUT_S))[0]
        rep["done_then"] = req.done()
    rank_1_may_go(comm, gate)
    rep["late"] = req.wait(timeout=30).tolist()
    rep["after"] = comm.allreduce(np.full(2, me + 1.0)).tolist()
    rep["after_i"] = comm.iallreduce(np.full(2, me + 1.0)).wait().tolist()
    return rep


@pytest.mark.timeout(90)
def test_wait_timeout_aborts_nothing(tmp_path):
    reps = run_ok(wait_timeout_worker, 2, args=(str(tmp_path / "gate"),))
    name, is_builtin, is_shmtree, took = reps[0]["result"]
    assert name == "TimeoutError", f"result(timeout={WAIT_TIMEOUT_S}) {name} after {took:.2f} s"
    assert (is_builtin, is_shmtree) == (True, False), reps[0]
    assert took < WAIT_RETURNS_S, f"result(timeout={WAIT_TIMEOUT_S}) took {took:.2f} s"
    assert reps[0]["wait"] == reps[0]["exception"] == reps[0]["wait_all"] == "TimeoutError"
    assert reps[0]["done_then"] is False
    for rep in reps:
        assert rep["late"] == [3.0] * 5
        assert rep["after"] == rep["after_i"] == [3.0] * 2


CALL_TIMEOUT_S = 0.2
CALL_TIMED_OUT_S = CALL_TIMEOUT_S + 5.0     # it fires by then (rank 1 holds back its matching
                                            # call up to procutil.GATE_HOLD_S)


def call_timeout_worker(comm, gate):
    """rank 1 makes its matching call only when rank 0's iallreduce, timeout=0.2, has failed
    (or after procutil.GATE_HOLD_S)."""
    me = comm.rank
    rep = {}
    if me == 0:
        t0 = time.monotonic()
        req = comm.iallreduce(np.ones(5), timeout=CALL_TIMEOUT_S)
        behind = comm.iallreduce(np.ones(5))          # posted behind it: fails too
        rep["req"] = outcome(req.result)[:2] + (time.monotonic() - t0,)
        open_gate(gate)
        rep["behind"] = outcome(behind.result)[0]
        rep["exception_type"] = type(req.exception()).__name__
    else:
        wait_gate(gate)
        rep["req"] = outcome(lambda: comm.iallreduce(np.ones(5)).result(timeout=10))
        rep["behind"] = None
    rep["later"] = outcome(lambda: comm.allreduce(np.ones(2), timeout=10))[0]
    rep["later_i"] = outcome(lambda: comm.iallreduce(np.ones(2), timeout=10).result(10))[0]
    return rep


@pytest.mark.timeout(90)
def test_call_timeout_fails_request_and_aborts_group(tmp_path):
    reps = run_ok(call_timeout_worker, 2, args=(str(tmp_path / "gate"),))
    name, msg, took = reps[0]["req"]
    assert name == "CollectiveTimeoutError", reps[0]
    assert reps[0]["exception_type"] == "CollectiveTimeoutError"
    assert CALL_TIMEOUT_S * 0.9 <= took < CALL_TIMED_OUT_S, f"timed out after {took:.2f} s"
    assert reps[0]["behind"] in ("PeerLostError", "ShmtreeError"), reps[0]
    assert reps[1]["req"][0] in ("PeerLostError", "ShmtreeError"), reps[1]
    for rep in reps:
        assert rep["later"] in ("PeerLostError", "ShmtreeError"), rep
        assert rep["later_i"] in ("PeerLostError", "ShmtreeError"), rep


# ---------------------------------------------------------------------------------------------
# 6. a peer SIGKILLed while requests are outstanding

PEER_LOST_S = 10.0


def killed_peer_worker(comm, outdir):
    me = comm.rank
    first = comm.iallreduce(np.ones(LARGE))
    first.wait(30)
    if me == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    reqs = [comm.iallreduce(np.ones(n)) for n in (5, LARGE, 3)] + [comm.ibarrier()]
    rep = {"results": [], "post_after": None}
    for r in reqs:
        name, msg, _ = outcome(lambda: r.result(timeout=60))
        rep["results"].append((name, time.monotonic() - t0, msg[:300]))
    rep["post_after"] = outcome(lambda: comm.iallreduce(np.ones(2)).result(timeout=10))[0]
    with open(os.path.join(outdir, f"rank{me}.json"), "w") as f:
        json.dump(rep, f)
    return rep


@pytest.mark.timeout(90)
def test_peer_killed_with_requests_outstanding(tmp_path):
    with pytest.raises(shmtree.WorkerError) as info:
        shmtree.run(killed_peer_worker, 3, args=(str(tmp_path),))
    assert info.value.rank == 1 and "SIGKILL" in str(info.value), info.value
    for rank in (0, 2):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} did not report"
        rep = json.loads(path.read_text())
        for name, took, msg in rep["results"]:
            assert name == "PeerLostError", (rank, name, msg)
            assert took < PEER_LOST_S, f"rank {rank}: PeerLostError after {took:.1f} s"
        assert rep["post_after"] in ("PeerLostError", "ShmtreeError"), rep


# ---------------------------------------------------------------------------------------------
# 7. a mismatch fails the request on every rank; the group stays usable

MISMATCH_CASES = {
    "shape": lambda c: c.iallreduce(np.ones(5 if c.rank != 2 else 6)),
    "large_shape": lambda c: c.iallreduce(np.ones(LARGE + (c.rank == 1))),
    "dtype": lambda c: c.iallreduce(np.ones(4, np.float32 if c.rank else np.float64)),
    "kind": lambda c: c.ireduce(np.ones(3)) if c.rank else c.iallreduce(np.ones(3)),
    "bcast_root": lambda c: c.ibroadcast(np.ones(3), root=0 if c.rank != 1 else 1),
    "allgather0_rest": lambda c: c.iallgather(np.ones((2, 3 if c.rank else 4)), axis=0),
    "rs_large_shape": lambda c: c.ireduce_scatter(np.ones(LARGE + (c.rank == 2))),
}


def mismatch_worker(comm, names):
    me = comm.rank
    rep = []
    for name in names:
        bad = MISMATCH_CASES[name](comm)
        good = comm.iallreduce(np.full(3, me + 1.0))            # queued behind the bad one
        res = outcome(bad.result)
        rep.append((name, res[0], res[1][:200], repr(bad), outcome(good.result)[1].tolist()
                    if good.exception() is None else repr(good.exception())))
    # wait_all raises the failure of the request posted first
    ok1 = comm.iallreduce(np.ones(2))
    bad1 = MISMATCH_CASES["shape"](comm)
    bad2 = MISMATCH_CASES["dtype"](comm)
    try:
        shmtree.wait_all([bad2, ok1, bad1])
        first = "no error"
    except shmtree.CollectiveMismatchError as e:
        first = "bad1" if e is bad1.exception() else "bad2" if e is bad2.exception() else "?"
    after = comm.allreduce(np.full(2, me + 1.0)).tolist()
    return rep, first, after


@pytest.mark.timeout(120)
def test_mismatch_fails_request_on_every_rank_then_usable():
    P = 3
    total = float(sum(range(1, P + 1)))
    outs = run_ok(mismatch_worker, P, args=(list(MISMATCH_CASES),), chunk_bytes=8192)
    for rank, (rep, first, after) in enumerate(outs):
        for name, err, msg, rep_bad, good in rep:
            assert err == "CollectiveMismatchError", (rank, name, err, msg)
            assert "disagree" in msg, (rank, name, msg)
            assert "failed" in rep_bad, rep_bad
            assert good == [total] * 3, (rank, name, good)
        assert first == "bad1", (rank, first)
        assert after == [total] * 2


# ---------------------------------------------------------------------------------------------
# 8. local errors: raised by the posting call, on one rank only, before any communication

def local_error_calls(c):
    x = np.ones(3)
    return {
        "bad op for dtype": lambda: c.iallreduce(x, "band"),
        "unknown op": lambda: c.iallreduce(x, "nope"),
        # (ireduce of an unreducible dtype is no longer local to one rank: DESIGN section 6
        # has it said in the call's round, tests/test_root_errors.py)
        "complex max": lambda: c.iallreduce(np.ones(3, complex), "max"),
        "rs bad op": lambda: c.ireduce_scatter(x, "bor"),
        "bcast root = size": lambda: c.ibroadcast(x, root=c.size),
        "bcast root -1": lambda: c.ibroadcast(x, root=-1),
        "bcast root str": lambda: c.ibroadcast(x, root="0"),
        "reduce root": lambda: c.ireduce(x, root=c.size + 3),
        "bcast None at root": lambda: c.ibroadcast(None, root=c.rank),
        "out shape": lambda: c.iallreduce(x, out=np.empty(4)),
        "out dtype": lambda: c.iallreduce(x, out=np.empty(3, np.float32)),
        "reduce out shape": lambda: c.ireduce(x, root=c.rank, out=np.empty(2)),
        "rs out shape": lambda: c.ireduce_scatter(np.ones(6), out=np.empty(17)),
        "ag out shape": lambda: c.iallgather(x, out=np.empty((c.size, 4))),
        "ag axis 1": lambda: c.iallgather(x, axis=1),
        "ag axis0 scalar": lambda: c.iallgather(np.float64(1.0), axis=0),
        "rs scalar": lambda: c.ireduce_scatter(np.float64(1.0)),
        "timeout -1": lambda: c.iallreduce(x, timeout=-1),
        "timeout str": lambda: c.ibroadcast(x, timeout="1"),
        "barrier timeout": lambda: c.ibarrier(timeout=-0.5),
        "ag timeout bool": lambda: c.iallgather(x, timeout=True),
        "object dtype": lambda: c.iallgather(np.array([object()])),
    }


def local_errors_worker(comm, gate):
    me = comm.rank
    late_rank_1(comm, gate)
    pending = comm.iallreduce(np.full(4, me + 1.0))     # outstanding while rank 0 errs
    errs = {}
    if me == 0:
        for name, call in local_error_calls(comm).items():
            try:
                req = call()
                errs[name] = f"no error: {req!r}"
            except (TypeError, ValueError) as e:
                errs[name] = type(e).__name__
            except BaseException as e:  # noqa: B036
                errs[name] = f"{type(e).__name__}: {e}"
        errs["pending done early"] = pending.done()
    rank_1_may_go(comm, gate)
    got = pending.wait(30).tolist()
    after = [comm.iallreduce(np.full(2, me + 1.0)).wait(30).tolist(),
             comm.allreduce(np.full(2, me + 1.0), timeout=30).tolist(),
             comm.ibroadcast(np.arange(3.0) if me == 1 else None, root=1).wait(30).tolist()]
    return errs, got, after


@pytest.mark.timeout(90)
def test_local_errors_raised_by_posting_call(tmp_path):
    outs = run_ok(local_errors_worker, 2, args=(str(tmp_path / "gate"),))
    errs, got, after = outs[0]
    early = errs.pop("pending done early")
    assert early is False, "rank 0's request completed before rank 1 posted its own"
    for name, what in errs.items():
        assert what in ("TypeError", "ValueError"), (name, what)
    for errs_, got, after in outs:
        assert got == [3.0] * 4
        assert after == [[3.0] * 2, [3.0] * 2, [0.0, 1.0, 2.0]]


# ---------------------------------------------------------------------------------------------
# 9. cancel, test, done, wait, repr

def api_worker(comm, gate):
    me = comm.rank
    rep = {}
    late_rank_1(comm, gate)
    req = comm.iallreduce(np.full(3, me + 1.0))
    if me == 0:
        rep["types"] = (isinstance(req, shmtree.Request),
                        isinstance(req, concurrent.futures.Future))
        rep["pending"] = (req.cancel(), req.cancelled(), req.test(), req.done(), repr(req))
    rank_1_may_go(comm, gate)
    result = req.wait()
    rep["result"] = result.tolist()
    rep["same_object"] = req.result() is result and req.wait(0) is result
    rep["done"] = (req.cancel(), req.cancelled(), req.test(), req.done(), req.exception(),
                   repr(req))
    b = comm.ibarrier()
    rep["barrier"] = (b.wait(), repr(b))
    rep["numbers"] = (req.number, b.number, req.name, b.name)
    return rep


@pytest.mark.timeout(60)
def test_cancel_test_done_wait_repr(tmp_path):
    reps = run_ok(api_worker, 2, args=(str(tmp_path / "gate"),))
    assert reps[0]["types"] == (True, True)
    cancel, cancelled, test, done, text = reps[0]["pending"]
    assert (cancel, cancelled, test, done) == (False, False, False, False), reps[0]["pending"]
    assert "iallreduce" in text and "pending" in text, text
    for rep in reps:
        assert rep["result"] == [3.0] * 3
        assert rep["same_object"]
        cancel, cancelled, test, done, exc, text = rep["done"]
        assert (cancel, cancelled, test, done, exc) == (False, False, True, True, None)
        assert "iallreduce" in text and "done" in text, text
        assert rep["barrier"][0] is None and "ibarrier" in rep["barrier"][1]
        n1, n2, name1, name2 = rep["numbers"]
        assert n1 < n2 and (name1, name2) == ("iallreduce", "ibarrier")


# ---------------------------------------------------------------------------------------------
# 10. close() waits for outstanding requests, and ends the progress thread

def close_worker(comm, gate):
    me = comm.rank
    late_rank_1(comm, gate)
    reqs = [comm.iallreduce(np.full(n, me + 1.0)) for n in (3, LARGE, 5)] + \
        [comm.ibroadcast(np.arange(4.0) if me == 0 else None), comm.ibarrier()]
    before = [r.done() for r in reqs]
    threads_before = progress_threads()
    rank_1_may_go(comm, gate)
    t0 = time.monotonic()
    comm.close()
    took = time.monotonic() - t0
    after = [r.done() for r in reqs]
    results = [outcome(lambda: r.result(0))[0] for r in reqs]
    values = [float(reqs[0].result(0)[0]), float(reqs[1].result(0)[-1]),
              reqs[3].result(0).tolist()] if all(n == "ok" for n in results) else None
    closed = outcome(lambda: comm.iallreduce(np.ones(1)))
    return (before, threads_before, took, after, results, values, progress_threads(),
            closed[0], closed[1])


@pytest.mark.timeout(60)
def test_close_waits_for_outstanding_requests(tmp_path):
    outs = run_ok(close_worker, 2, args=(str(tmp_path / "gate"),))
    before, threads_before, took, after, results, values, threads, closed, msg = outs[0]
    assert not any(before), "rank 0's requests were done before rank 1 posted its own"
    for rank, (before, threads_before, took, after, results, values, threads, closed,
               msg) in enumerate(outs):
        assert threads_before == [f"{PROGRESS_PREFIX}rank{rank}"], threads_before
        assert all(after), (rank, after)
        assert results == ["ok"] * 5, (rank, results)
        assert values == [3.0, 3.0, [0.0, 1.0, 2.0, 3.0]], (rank, values)
        assert threads == [], f"rank {rank}: progress thread still alive after close: {threads}"
        assert closed == "ShmtreeError" and "closed" in msg, (closed, msg)


# ---------------------------------------------------------------------------------------------
# 11. fork while requests are outstanding

CHILD_CHECKS = ("wait", "result_timeout", "exception", "wait_all", "allreduce", "iallreduce",
                "barrier", "module_iallreduce")


CHILD_RAISES_S = 2.0        # each check in the child raises within this (result(timeout=5) and
                            # the child's 10 s alarm are what a wait would run into)


def fork_worker(comm, gate):
    me = comm.rank
    comm.barrier()
    if me == 1:
        comm.iallreduce(np.full(2, me + 1.0)).wait()
        wait_gate(gate)                    # rank 0's request is outstanding at the fork
        return comm.iallreduce(np.full(3, me + 1.0)).wait().tolist(), \
            comm.allreduce(np.ones(2)).tolist()
    done = comm.iallreduce(np.full(2, me + 1.0))
    done.wait()
    req = comm.iallreduce(np.full(3, me + 1.0))
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:                           # the child: never returns
        code = 1
        try:
            os.close(rfd)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(10)               # a hang kills the child (the parent sees SIGALRM)
            rep = {"done_at_fork": req.done()}
            calls = {"wait": lambda: req.wait(),
                     "result_timeout": lambda: req.result(timeout=5),
                     "exception": lambda: req.exception(),
                     "wait_all": lambda: shmtree.wait_all([req]),
                     "allreduce": lambda: comm.allreduce(np.ones(3)),
                     "iallreduce": lambda: comm.iallreduce(np.ones(3)),
                     "barrier": lambda: comm.barrier(),
                     "module_iallreduce": lambda: shmtree.iallreduce(np.ones(3))}
            for name in CHILD_CHECKS:
                got = outcome(calls[name])
                rep[name] = (got[0], str(got[1])[:200], got[2])
            got = outcome(done.wait)             # done before the fork: its result or a
            rep["done_request"] = (got[0], got[1].tolist() if got[0] == "ok" else got[1],
                                   got[2], done.done())                 # ShmtreeError
            os.write(wfd, json.dumps(rep).encode())
            code = 0
        finally:
            os._exit(code)
    open_gate(gate)                        # (forked: rank 1 may complete the request now)
    os.close(wfd)
    chunks = []
    while True:
        chunk = os.read(rfd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    child = json.loads(b"".join(chunks).decode()) if chunks else None
    return req.wait(30).tolist(), (os.waitstatus_to_exitcode(status), child,
                                   comm.allreduce(np.ones(2)).tolist())


@pytest.mark.timeout(60)
def test_fork_with_requests_outstanding(tmp_path):
    (parent, (code, child, after)), (peer, peer_after) = run_ok(fork_worker, 2,
                                                                args=(str(tmp_path / "gate"),))
    assert parent == peer == [3.0] * 3
    assert after == peer_after == [2.0, 2.0]
    assert code != -signal.SIGALRM, "the child hung (killed by its 10 s alarm)"
    assert code == 0 and child is not None, f"the child exited with {code}: {child}"
    assert child["done_at_fork"] is False
    for name in CHILD_CHECKS:
        what, msg, took = child[name]
        assert what == "ShmtreeError", (name, what, msg)
        assert took < CHILD_RAISES_S, f"{name} took {took:.2f} s in the child"
    what, value, took, is_done = child["done_request"]
    assert is_done and took < CHILD_RAISES_S, child["done_request"]
    assert (what, value) == ("ok", [3.0, 3.0]) or what == "ShmtreeError", child["done_request"]


# ---------------------------------------------------------------------------------------------
# 12. Ctrl-C while waiting

INTERRUPT_AFTER_S = 0.1     # SIGINT comes this long after the wait began
INTERRUPT_S = 2.0           # ... and interrupts it within this (rank 1 holds back its matching
                            # call up to procutil.GATE_HOLD_S: a wait that cannot be interrupted
                            # ends only then)


def ctrl_c_worker(comm, gate):
    me = comm.rank
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rep = {}
    comm.barrier()
    if me == 1:
        wait_gate(gate)
        rep["result"] = comm.iallreduce(np.full(4, me + 1.0)).wait().tolist()
    else:
        req = comm.iallreduce(np.full(4, me + 1.0))
        timer = threading.Timer(INTERRUPT_AFTER_S, os.kill, (os.getpid(), signal.SIGINT))
        t0 = time.monotonic()
        timer.start()
        try:
            req.wait()
            rep["first"] = ("returned", time.monotonic() - t0, req.done())
        except KeyboardInterrupt:
            rep["first"] = ("KeyboardInterrupt", time.monotonic() - t0, req.done())
        finally:
            timer.join()
            open_gate(gate)
        rep["result"] = req.wait(30).tolist()
    rep["after"] = comm.allreduce(np.full(2, me + 1.0), timeout=30).tolist()
    rep["after_i"] = comm.iallreduce(np.full(2, me + 1.0), timeout=30).wait(30).tolist()
    return rep


@pytest.mark.timeout(60)
def test_ctrl_c_while_waiting_interrupts_the_wait_only(tmp_path):
    reps = run_ok(ctrl_c_worker, 2, args=(str(tmp_path / "gate"),))
    what, took, done = reps[0]["first"]
    assert what == "KeyboardInterrupt", reps[0]
    assert took < INTERRUPT_AFTER_S + INTERRUPT_S, \
        f"KeyboardInterrupt {took:.2f} s after the wait began"
    assert done is False
    for rep in reps:
        assert rep["result"] == [3.0] * 4
        assert rep["after"] == rep["after_i"] == [3.0] * 2


def ctrl_c_blocking_worker(comm, gate):
    """As above, but rank 0 is waiting in a blocking allreduce queued behind its request: the
    interrupt leaves a call half-issued, so the group is aborted (docs/guide/nonblocking.md)."""
    me = comm.rank
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rep = {}
    comm.barrier()
    if me == 1:
        wait_gate(gate)
        rep["req"] = outcome(lambda: comm.iallreduce(np.ones(4)).wait(10))[0]
    else:
        req = comm.iallreduce(np.ones(4))
        timer = threading.Timer(INTERRUPT_AFTER_S, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            rep["blocking"] = outcome(lambda: comm.allreduce(np.ones(2)))[::2]
        finally:
            timer.join()
            open_gate(gate)
        rep["req"] = outcome(lambda: req.wait(10))[0]
    rep["after"] = outcome(lambda: comm.allreduce(np.ones(2), timeout=10))[0]
    return rep


@pytest.mark.timeout(60)
def test_ctrl_c_in_blocking_call_queued_behind_requests_aborts(tmp_path):
    reps = run_ok(ctrl_c_blocking_worker, 2, args=(str(tmp_path / "gate"),))
    what, took = reps[0]["blocking"]
    assert what == "KeyboardInterrupt" and took < INTERRUPT_AFTER_S + INTERRUPT_S, reps[0]
    for rep in reps:
        assert rep["req"] in ("PeerLostError", "ShmtreeError"), rep
        assert rep["after"] in ("PeerLostError", "ShmtreeError"), rep


# ---------------------------------------------------------------------------------------------
# 13. an idle progress thread burns no CPU

IDLE_S = 0.5
IDLE_CPU_S = 0.05


def idle_worker(comm):
    for n in (3, LARGE, 5):
        comm.iallreduce(np.ones(n)).wait()
    reqs = [comm.ibarrier(), comm.iallgather(np.ones(2))]
    shmtree.wait_all(reqs)
    time.sleep(0.05)                    # (past the progress thread's short poll)
    c0 = time.process_time()
    time.sleep(IDLE_S)
    return time.process_time() - c0, progress_threads()


@pytest.mark.timeout(60)
def test_idle_progress_thread_burns_no_cpu():
    for rank, (cpu, threads) in enumerate(run_ok(idle_worker, 2)):
        assert threads, "no progress thread: the test proves nothing"
        assert cpu < IDLE_CPU_S, f"rank {rank} used {cpu:.3f} s of CPU in {IDLE_S} s idle"


# ---------------------------------------------------------------------------------------------
# 14. a collective or a wait inside a completion callback raises instead of deadlocking

IN_CALLBACK_TIMEOUT_S = 5.0     # timeout= of the collectives a callback makes ...
IN_CALLBACK_RAISES_S = IN_CALLBACK_TIMEOUT_S / 2    # ... which raise well before it runs out


def callback_blocking_worker(comm, gate):
    me = comm.rank
    rep = {}
    late_rank_1(comm, gate)                    # (the callback is added while the call waits)
    seen, ev = {}, threading.Event()
    first = comm.iallreduce(np.full(2, me + 1.0))
    second = comm.iallreduce(np.full(3, me + 1.0))          # still outstanding when the
    if me == 0:                                              # callback of `first` runs

        def cb(f):
            seen["allreduce"] = outcome(lambda: comm.allreduce(
                np.ones(2), timeout=IN_CALLBACK_TIMEOUT_S))
            seen["broadcast"] = outcome(lambda: comm.broadcast(
                np.ones(2), timeout=IN_CALLBACK_TIMEOUT_S))
            seen["iallreduce"] = outcome(lambda: comm.iallreduce(
                np.ones(2), timeout=IN_CALLBACK_TIMEOUT_S))
            seen["wait"] = outcome(lambda: second.wait())
            seen["wait_all"] = outcome(lambda: shmtree.wait_all([second]))
            seen["close"] = outcome(comm.close)
            ev.set()
        first.add_done_callback(cb)
        rank_1_may_go(comm, gate)
        if not ev.wait(10):
            os._exit(17)            # the callback hangs: close() would wait for it forever
    rep["first"] = first.wait(30).tolist()
    rep["second"] = second.wait(30).tolist()
    if me == 0:
        rep["seen"] = {k: (v[0], str(v[1])[:200], v[2]) for k, v in seen.items()}
    rep["after"] = comm.allreduce(np.full(2, me + 1.0), timeout=30).tolist()
    return rep


@pytest.mark.timeout(60)
def test_collective_or_wait_inside_callback_raises(tmp_path):
    reps = run_ok(callback_blocking_worker, 2, args=(str(tmp_path / "gate"),))
    for name, (what, msg, took) in reps[0]["seen"].items():
        assert what == "ShmtreeError", (name, what, msg)
        assert took < IN_CALLBACK_RAISES_S, f"{name} in a callback took {took:.2f} s"
    for rep in reps:
        assert rep["first"] == [3.0] * 2 and rep["second"] == [3.0] * 3
        assert rep["after"] == [3.0] * 2


def callback_last_request_worker(comm, gate, gate_after):
    """The callback of the only outstanding request makes a blocking collective and posts an
    i-call; rank 1 makes no matching call until they are over (or timed out)."""
    me = comm.rank
    seen, ev = {}, threading.Event()
    late_rank_1(comm, gate)                    # (the callback is added while the call waits)
    req = comm.iallreduce(np.full(2, me + 1.0))
    if me == 0:

        def cb(f):
            seen["thread"] = ("ok", threading.current_thread().name, 0.0)
            seen["allreduce"] = outcome(lambda: comm.allreduce(
                np.ones(2), timeout=IN_CALLBACK_TIMEOUT_S))
            seen["iallreduce"] = outcome(lambda: comm.iallreduce(
                np.ones(2), timeout=IN_CALLBACK_TIMEOUT_S))
            ev.set()
        req.add_done_callback(cb)
        rank_1_may_go(comm, gate)
    req.wait(30)
    if me == 0:
        if not ev.wait(10 + 2 * IN_CALLBACK_TIMEOUT_S):
            os._exit(17)
        open_gate(gate_after)
    else:
        wait_gate(gate_after)
    after = outcome(lambda: comm.allreduce(np.full(2, me + 1.0), timeout=10))
    return {k: (v[0], str(v[1])[:200], v[2]) for k, v in seen.items()}, after[:2]


@pytest.mark.timeout(60)
def test_collective_inside_callback_of_last_request_raises(tmp_path):
    """(Nothing else outstanding: the collective would otherwise run in the progress thread at
    a place in this rank's call order that depends on timing.)"""
    reps = run_ok(callback_last_request_worker, 2,
                  args=(str(tmp_path / "gate"), str(tmp_path / "gate_after")))
    assert reps[0][0].pop("thread")[1].startswith(PROGRESS_PREFIX), reps[0][0]
    for name, (what, msg, took) in reps[0][0].items():
        assert what == "ShmtreeError", (name, what, msg)      # (not CollectiveTimeoutError)
        assert took < IN_CALLBACK_RAISES_S, f"the callback's {name} took {took:.2f} s"
    for seen, after in reps:
        assert after[0] == "ok" and after[1].tolist() == [3.0] * 2, after


# ---------------------------------------------------------------------------------------------
# 15. the module-level forms

def module_level_worker(comm):
    P, me = shmtree.size(), shmtree.rank()
    x = ints(SMALL, 0, me)
    big = ints(LARGE, 1, me)
    reqs = [shmtree.iallreduce(x), shmtree.iallreduce(big, "max"),
            shmtree.ibroadcast(big if me == 1 else None, root=1),
            shmtree.ireduce(x, root=P - 1), shmtree.iallgather(np.array([me, me])),
            shmtree.iallgather(np.arange(me + 1), axis=0), shmtree.ireduce_scatter(big),
            shmtree.ibarrier()]
    kinds = [type(r).__name__ for r in reqs]
    got = shmtree.wait_all(reqs)
    xs = [ints(SMALL, 0, r) for r in range(P)]
    bigs = [ints(LARGE, 1, r) for r in range(P)]
    checks = [np.array_equal(got[0], sum(xs)),
              np.array_equal(got[1], np.maximum.reduce(bigs)),
              np.array_equal(got[2], bigs[1]),
              np.array_equal(got[3], sum(xs)) if me == P - 1 else got[3] is None,
              got[4].tolist() == [[r, r] for r in range(P)],
              got[5].tolist() == [i for r in range(P) for i in range(r + 1)],
              np.array_equal(got[6], np.array_split(sum(bigs), P)[me]),
              got[7] is None]
    return kinds, checks


@pytest.mark.timeout(60)
def test_module_level_forms():
    assert shmtree.Request is shmtree.api.Request
    for kinds, checks in run_ok(module_level_worker, 3):
        assert kinds == ["Request"] * 8
        assert all(checks), checks
