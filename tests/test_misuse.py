"""Misuse of the API (docs/design.md, "Errors"): each a clear exception with an actionable message,
and the group still usable where the contract says a local error leaves it usable.

- local errors (read-only out, unsupported dtypes, bad op / timeout / out): TypeError or
  ValueError before any communication; the next valid call on every rank works;
- out overlapping the input partially: the result is still right (the library copies the input);
- membership: a rank joining twice, a rank out of range, joining a closed group, calls after
  comm.close(), a process that is not a member, a forked grandchild using its parent's
  communicator: ShmtreeError (ValueError for a bad rank), never a hang;
- two threads of one rank inside a collective at once: the second raises ShmtreeError at once;
- mismatched shape / dtype / op / collective across ranks: CollectiveMismatchError on every rank,
  naming what each rank passed, and the group usable afterwards.

Every call here that could hang if the library got it wrong carries a timeout.
"""
import multiprocessing as mp
import os
import threading
import time
import traceback

import numpy as np
import pytest

import shmtree
from procutil import open_gate, run_ok, wait_gate

P = 3


def good_call(comm, n=5):
    """A valid allreduce: True when its result is right (the group still works)."""
    y = comm.allreduce(np.full(n, comm.rank + 1.0), timeout=30)
    return bool(np.array_equal(y, np.full(n, comm.size * (comm.size + 1) / 2)))


def attempt(fn):
    """(exception class name or 'returned', message, seconds)."""
    t0 = time.monotonic()
    try:
        fn()
        return "returned", "", time.monotonic() - t0
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# local errors: raised before any communication, the group stays usable

def _readonly(n):
    a = np.zeros(n)
    a.flags.writeable = False
    return a


LOCAL_ERRORS = {
    # name: (make (args, kwargs) for a message of n float64, exception, words (regexes) the
    # message must contain)
    "readonly_out": (lambda n: ((np.ones(n),), dict(out=_readonly(n))), ValueError,
                     ["read-only"]),
    "readonly_out_view": (lambda n: ((np.ones(n),), dict(out=_readonly(2 * n)[::2])),
                          ValueError, ["read-only"]),
    "object": (lambda n: ((np.array([1, 2], dtype=object),), {}), TypeError,
               ["dtype", "object|O", "float64"]),
    "str": (lambda n: ((np.array(["a", "bc"]),), {}), TypeError, ["dtype", "U2"]),
    "str_literal": (lambda n: (("abc",), {}), TypeError, ["dtype"]),
    "structured": (lambda n: ((np.zeros(3, dtype=[("a", "i4"), ("b", "f8")]),), {}),
                   TypeError, ["dtype"]),
    "datetime64": (lambda n: ((np.array(["2020-01-01"], dtype="datetime64[D]"),), {}),
                   TypeError, ["dtype", "M8|datetime"]),
    "timedelta64": (lambda n: ((np.array([1], dtype="timedelta64[s]"),), {}), TypeError,
                    ["dtype", "m8|timedelta"]),
    "longdouble": (lambda n: ((np.ones(4, dtype=np.longdouble),), {}), TypeError,
                   ["dtype", "float128|longdouble|float96"]),
    "complex_max": (lambda n: ((np.ones(n, np.complex128),), dict(op="max")), TypeError,
                    ["max", "complex128"]),
    "op_add_string": (lambda n: ((np.ones(n),), dict(op="add")), ValueError, ["op", "sum"]),
    "op_none": (lambda n: ((np.ones(n),), dict(op=None)), ValueError, ["op", "sum"]),
    "timeout_negative": (lambda n: ((np.ones(n),), dict(timeout=-1)), ValueError,
                         ["timeout"]),
    "timeout_str": (lambda n: ((np.ones(n),), dict(timeout="1")), ValueError, ["timeout"]),
    "out_shape": (lambda n: ((np.ones(n),), dict(out=np.zeros(n + 1))), ValueError,
                  ["shape", "out"]),
    "out_dtype": (lambda n: ((np.ones(n),), dict(out=np.zeros(n, np.float32))), ValueError,
                  ["dtype", "float32", "float64"]),
    "out_list": (lambda n: ((np.ones(n),), dict(out=[0.0] * n)), ValueError, ["out"]),
}


def local_errors_worker(comm, names, n):
    reports = []
    for name in names:
        make, _, _ = LOCAL_ERRORS[name]
        args, kwargs = make(n)
        what, msg, secs = attempt(lambda: comm.allreduce(*args, **kwargs))
        reports.append((name, what, msg, secs, good_call(comm)))
    return reports


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [6, 300000])
def test_local_misuse_raises_and_leaves_group_usable(n):
    import re

    names = list(LOCAL_ERRORS)
    results = run_ok(local_errors_worker, P, args=(names, n), chunk_bytes=16384)
    failures = []
    for rank, reports in enumerate(results):
        for name, what, msg, secs, good in reports:
            _, exc, words = LOCAL_ERRORS[name]
            if what != exc.__name__:
                failures.append(f"rank {rank} {name}: {what}: {msg} (wanted {exc.__name__})")
            for w in words:
                if not re.search(w, msg):
                    failures.append(f"rank {rank} {name}: message lacks {w!r}: {msg}")
            if secs > 1.0:
                failures.append(f"rank {rank} {name}: took {secs:.2f} s (communicated?)")
            if good is not True:
                failures.append(f"rank {rank} {name}: the next valid call failed")
    assert not failures, "\n".join(failures)


def byteorder_worker(comm):
    x = (np.arange(7) * (comm.rank + 1)).astype(">f8")
    what, msg, _ = attempt(lambda: comm.allreduce(x))
    y = None
    if what == "returned":
        y = comm.allreduce(x, timeout=30)
    return what, msg, y, good_call(comm)


@pytest.mark.timeout(60)
def test_non_native_byte_order():
    """'>f8' is float64 in the other byte order: either the right sum or a TypeError that says
    so (the library chose the latter); never a wrong result."""
    for what, msg, y, good in run_ok(byteorder_worker, 2):
        if what == "returned":
            assert np.array_equal(y, np.arange(7) * 3.0)
        else:
            assert what == "TypeError" and "byte order" in msg, (what, msg)
        assert good


# ---------------------------------------------------------------------------------------------
# out overlapping the input

def overlap_worker(comm, n):
    """Several ways for out to share memory with the input; each result against numpy."""
    r, P_ = comm.rank, comm.size
    checks = []

    def expected(base_slice):
        # every rank's input is base_slice of (arange * (rank + 1)): the sum is (P(P+1)/2) x it
        return np.arange(2 * n, dtype=np.float64)[base_slice] * (P_ * (P_ + 1) / 2)

    cases = {
        "out_after_input": (slice(0, n), slice(n // 2, n // 2 + n)),
        "out_before_input": (slice(n // 2, n // 2 + n), slice(0, n)),
        "same_bytes": (slice(0, n), slice(0, n)),
        "strided_input_in_place": (slice(0, 2 * n, 2), slice(0, 2 * n, 2)),
        "strided_interleaved": (slice(0, 2 * n, 2), slice(1, 2 * n, 2)),
        "strided_out_overlapping": (slice(0, 2 * n - 1, 2), slice(n // 3, n // 3 + n)),
    }
    for name, (src_sl, out_sl) in cases.items():
        buf = np.arange(2 * n, dtype=np.float64) * (r + 1)
        x, out = buf[src_sl], buf[out_sl]
        if x.shape != out.shape:
            continue
        want = expected(src_sl)
        what, msg, _ = attempt(lambda: comm.allreduce(x, out=out, timeout=30))
        ok = what == "returned" and np.array_equal(buf[out_sl], want)
        checks.append((name, what, msg, ok))
    return checks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [10, 200001])
def test_out_overlapping_input(n):
    failures = []
    for rank, checks in enumerate(run_ok(overlap_worker, P, args=(n,), chunk_bytes=32768)):
        assert len(checks) >= 5
        for name, what, msg, ok in checks:
            if what == "ValueError":
                continue          # a clear refusal would be allowed; this library copies
            if not ok:
                failures.append(f"rank {rank} {name}: {what} {msg} (wrong result)")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# membership misuse

def in_child(target, *args, timeout=30):
    """Run target(*args) in a forked process; its return value (or the exception text)."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()

    def body():
        try:
            queue.put(("ok", target(*args)))
        except BaseException as e:  # noqa: B036
            queue.put(("raised", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))

    p = ctx.Process(target=body)
    p.start()
    try:
        deadline = time.monotonic() + timeout
        while queue.empty():
            if time.monotonic() > deadline:
                pytest.fail("the child process hung")
            if p.exitcode is not None and queue.empty():
                time.sleep(0.1)
                if queue.empty():
                    pytest.fail(f"the child died with exit code {p.exitcode}")
            time.sleep(0.01)
        status, value = queue.get()
    finally:
        p.join(10)
        if p.exitcode is None:
            p.kill()
            p.join(5)
    if status != "ok":
        pytest.fail(f"the child raised: {value}")
    return value


def join_twice(group):
    comm = group.join(0)
    second = attempt(lambda: group.join(0))
    other = attempt(lambda: group.join(1)) if group.size > 1 else None
    y = comm.allreduce(np.ones(3), timeout=10) if group.size == 1 else None
    return second, other, None if y is None else y.tolist()


@pytest.mark.timeout(60)
def test_rank_joining_twice():
    with shmtree.Group(1) as g:
        second, _, y = in_child(join_twice, g)
    assert second[0] == "ShmtreeError" and "already joined" in second[1], second
    assert y == [1.0, 1.0, 1.0], "the first join's communicator no longer works"


def claim_then_try(group, rank, ready, go):
    comm = group.join(rank)
    ready.set()
    go.wait(30)
    return good_call(comm)


def late_joiner(group, ready, go):
    ready.wait(30)
    dup = attempt(lambda: group.join(0))           # rank 0 is taken by another process
    comm = group.join(1)
    go.set()
    return dup, good_call(comm)


@pytest.mark.timeout(60)
def test_rank_taken_by_another_process():
    ctx = mp.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    with shmtree.Group(2) as g:
        first = ctx.Process(target=claim_then_try, args=(g, 0, ready, go))
        first.start()
        try:
            dup, good = in_child(late_joiner, g, ready, go)
        finally:
            go.set()
            first.join(30)
            if first.exitcode is None:
                first.kill()
                first.join(5)
    assert dup[0] == "ShmtreeError" and "already joined" in dup[1], dup
    assert good is True
    assert first.exitcode == 0


def bad_ranks(group):
    out = {}
    for bad in (-1, group.size, group.size + 5, 1.0, True, "0", None):
        out[repr(bad)] = attempt(lambda: group.join(bad))
    comm = group.join(0)                            # still joinable after all that
    return out, comm.allreduce(np.ones(2), timeout=10).tolist()


@pytest.mark.timeout(60)
def test_rank_out_of_range():
    with shmtree.Group(1) as g:
        out, y = in_child(bad_ranks, g)
    for bad, (what, msg, _) in out.items():
        assert what == "ValueError", f"join({bad}): {what}: {msg}"
        assert "rank" in msg and "[0, 1)" in msg, f"join({bad}): {msg}"
    assert y == [1.0, 1.0]


def join_after_close(group, closed, queue_ready):
    queue_ready.set()
    closed.wait(30)
    return attempt(lambda: group.join(0))


@pytest.mark.timeout(60)
def test_join_after_group_closed():
    # in the creator: close() then join()
    g = shmtree.Group(2)
    g.close()
    with pytest.raises(shmtree.ShmtreeError, match="closed"):
        g.join(0)
    with pytest.raises(shmtree.ShmtreeError, match="closed"):
        g.claim_rank()
    # a process forked before the creator closed the group, joining after
    ctx = mp.get_context("fork")
    closed, ready = ctx.Event(), ctx.Event()
    g = shmtree.Group(2)
    result = {}

    def close_when_ready():
        ready.wait(30)
        g.close()
        closed.set()

    t = threading.Thread(target=close_when_ready)
    t.start()
    try:
        result = in_child(join_after_close, g, closed, ready)
    finally:
        closed.set()
        t.join()
        g.close()
    what, msg, _ = result
    assert what in ("ShmtreeError", "PeerLostError"), result
    assert "closed" in msg, result


def after_close_worker(comm):
    assert good_call(comm)
    comm.close()
    comm.close()                                    # idempotent
    return {
        "allreduce": attempt(lambda: comm.allreduce(np.ones(3))),
        "barrier": attempt(lambda: comm.barrier()),
        "module_allreduce": attempt(lambda: shmtree.allreduce(np.ones(3))),
        "module_rank": attempt(lambda: shmtree.rank()),
    }


@pytest.mark.timeout(60)
def test_calls_after_comm_close():
    for rank, rep in enumerate(run_ok(after_close_worker, P)):
        for call, (what, msg, secs) in rep.items():
            assert what == "ShmtreeError", f"rank {rank} {call} after close: {what}: {msg}"
            assert "closed" in msg or "not joined" in msg or "has not joined" in msg, msg
            assert secs < 1.0


def non_member_calls():
    return {
        "allreduce": attempt(lambda: shmtree.allreduce(np.ones(3))),
        "barrier": attempt(lambda: shmtree.barrier()),
        "rank": attempt(lambda: shmtree.rank()),
        "size": attempt(lambda: shmtree.size()),
        "current": attempt(lambda: shmtree.current()),
    }


@pytest.mark.timeout(60)
def test_non_member_calls_module_functions():
    here = non_member_calls()                       # the test process itself
    with shmtree.Group(2):                          # a group exists, but nobody joined it here
        there = in_child(non_member_calls)          # a forked process that never joined
    for who, rep in (("parent", here), ("forked non-member", there)):
        for call, (what, msg, _) in rep.items():
            assert what == "ShmtreeError", f"{who} {call}: {what}: {msg}"
            assert "not joined" in msg and ("shmtree.run" in msg or "join" in msg), msg


def grandchild_worker(comm):
    """Rank 0 forks a grandchild that tries its parent's communicator and the module calls."""
    assert good_call(comm)
    report = None
    if comm.rank == 0:
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:                                 # the grandchild
            try:
                rep = {
                    "comm.allreduce": attempt(lambda: comm.allreduce(np.ones(3), timeout=5)),
                    "comm.barrier": attempt(lambda: comm.barrier(timeout=5)),
                    "shmtree.allreduce": attempt(lambda: shmtree.allreduce(np.ones(3),
                                                                           timeout=5)),
                    "group.join(0)": attempt(lambda: comm.group.join(0)),
                }
                os.write(wfd, repr(rep).encode())
            finally:
                os._exit(0)
        os.close(wfd)
        chunks = []
        while True:
            b = os.read(rfd, 65536)
            if not b:
                break
            chunks.append(b)
        os.close(rfd)
        os.waitpid(pid, 0)
        report = eval(b"".join(chunks).decode())    # our own repr of str/float tuples
    return report, good_call(comm), good_call(comm, n=100000)


@pytest.mark.timeout(60)
def test_forked_grandchild_uses_parents_communicator():
    results = run_ok(grandchild_worker, P)
    report = results[0][0]
    for call, (what, msg, secs) in report.items():
        assert what == "ShmtreeError", f"grandchild {call}: {what}: {msg}"
        assert secs < 2.0, f"grandchild {call} took {secs:.2f} s"
    assert "forked child" in report["comm.allreduce"][1], report
    assert all(good and big for _, good, big in results), "the group broke afterwards"


# ---------------------------------------------------------------------------------------------
# two threads of one rank

SECOND_TIMEOUT_S = 5.0          # timeout= of the second thread's call, which must raise ...
SECOND_RAISES_S = SECOND_TIMEOUT_S / 2      # ... well before that runs out


def engine_in_call(comm, timeout=30.0):
    """Wait until a thread of this rank is inside a call of comm's engine (True), or False after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not comm._engine.in_call:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def two_threads_worker(comm, second_kind, gate):
    """Rank 0: thread A enters an allreduce (rank 1 arrives only once the main thread's second
    collective has returned or raised), then the main thread makes a second collective: it must
    raise ShmtreeError at once, not hang or interleave."""
    if comm.rank == 1:
        wait_gate(gate)
        y = comm.allreduce(np.full(1000, 2.0), timeout=30)
        return None, bool(np.all(y == 3.0)), good_call(comm)
    res = {}

    def thread_a():
        try:
            res["y"] = comm.allreduce(np.full(1000, 1.0), timeout=30)
        except BaseException as e:  # noqa: B036
            res["error"] = repr(e)

    t = threading.Thread(target=thread_a)
    t.start()
    try:
        assert engine_in_call(comm), "thread A never entered its call"  # it waits for rank 1
        if second_kind == "barrier":
            second = attempt(lambda: comm.barrier(timeout=SECOND_TIMEOUT_S))
        else:
            second = attempt(lambda: comm.allreduce(np.ones(1000), timeout=SECOND_TIMEOUT_S))
    finally:
        open_gate(gate)
    t.join(30)
    ok = "y" in res and bool(np.all(res["y"] == 3.0))
    return second, ok or res.get("error"), good_call(comm)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("second_kind", ["allreduce", "barrier"])
def test_two_threads_of_one_rank(second_kind, tmp_path):
    results = run_ok(two_threads_worker, 2, args=(second_kind, str(tmp_path / "gate")))
    (what, msg, secs), first_ok, good = results[0]
    assert what == "ShmtreeError", f"second thread: {what}: {msg}"
    assert "thread" in msg, msg
    assert secs < SECOND_RAISES_S, f"the second thread waited {secs:.2f} s before raising"
    assert first_ok is True, f"the first thread's call went wrong: {first_ok}"
    assert good and results[1][1] and results[1][2]


# ---------------------------------------------------------------------------------------------
# mismatched collectives

MISMATCHES = {
    # name: per-rank call (rank 1 differs), words in the message
    "length": lambda r: ("allreduce", np.ones(5 if r == 1 else 4), "sum"),
    "shape_same_bytes": lambda r: ("allreduce", np.ones((3, 2) if r == 1 else (2, 3)), "sum"),
    "ndim_0_vs_1": lambda r: ("allreduce", np.ones(() if r == 1 else (1,)), "sum"),
    "dtype_same_itemsize": lambda r: ("allreduce", np.ones(4, np.int64 if r == 1 else
                                                         np.float64), "sum"),
    "op": lambda r: ("allreduce", np.ones(4), "max" if r == 1 else "sum"),
    "small_vs_chunked": lambda r: ("allreduce", np.ones(10 if r == 1 else 300000), "sum"),
    "chunked_lengths": lambda r: ("allreduce", np.ones(300001 if r == 1 else 300000), "sum"),
    "barrier_vs_allreduce": lambda r: ("barrier", None, None) if r == 1 else
    ("allreduce", np.ones(4), "sum"),
    "allreduce_vs_barrier": lambda r: ("allreduce", np.ones(0), "sum") if r == 1 else
    ("barrier", None, None),
}


def mismatch_worker(comm, names):
    reports = []
    for name in names:
        kind, x, op = MISMATCHES[name](comm.rank)
        if kind == "barrier":
            rep = attempt(lambda: comm.barrier(timeout=20))
        else:
            rep = attempt(lambda: comm.allreduce(x, op=op, timeout=20))
        reports.append((name, *rep, good_call(comm), good_call(comm, n=70000)))
    return reports


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tree", ["auto", "chain", "ring", "flat"])
def test_mismatch_on_every_rank_then_usable(tree):
    names = list(MISMATCHES)
    results = run_ok(mismatch_worker, 4, args=(names,), tree=tree, chunk_bytes=8192)
    failures = []
    for rank, reports in enumerate(results):
        for name, what, msg, secs, good, big in reports:
            if what != "CollectiveMismatchError":
                failures.append(f"rank {rank} {name}: {what}: {msg}")
                continue
            if "rank 1" not in msg or "ranks 0,2,3" not in msg:
                failures.append(f"rank {rank} {name}: the message does not say who passed "
                                f"what: {msg}")
            if not (good and big):
                failures.append(f"rank {rank} {name}: the group is not usable afterwards")
    assert not failures, "\n".join(failures)
    assert issubclass(shmtree.CollectiveMismatchError, ValueError)
