"""Point-to-point messages (DESIGN section 12, docs/design.md "How messages travel"): send, recv,
sendrecv, isend, irecv.  Every multi-process test runs under a timeout (shmtree.run's workers are
stopped when one fails; the hand-made processes are killed in `finally`) and the autouse
fixture of conftest.py checks for leaks (/dev/shm, descriptors, mappings, children)."""
import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

import shmtree
from procutil import error_name, run_ok, stop_processes

DETECT_S = 5.0
MiB = 1 << 20

try:
    import ml_dtypes
    ML = [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4]
except ImportError:                       # pragma: no cover
    ML = []

DTYPES = ["?", "i1", "u1", "<i2", ">i2", "<u4", ">i8", "<f2", "<f4", ">f8", "c8", ">c16",
          np.longdouble, "S5", "<U3", ">U2", "M8[ns]", "m8[s]", "V7",
          [("a", "<i4"), ("b", ">f8", (2,)), ("c", "S3")],
          np.dtype({"names": ["x", "y"], "formats": ["u1", "<f4"], "offsets": [0, 8],
                    "itemsize": 16})] + ML


def _values(dtype, shape, seed):
    """Arbitrary bytes of dtype (every bit pattern: NaNs and padding included)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return raw.view(dt).reshape(shape) if dt.itemsize else np.empty(shape, dt)


def _same(a, b):
    return (a.dtype == b.dtype and a.dtype.str == b.dtype.str and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())


# ---------------------------------------------------------------------------------------------
# contents: dtypes, shapes, layouts, sizes

def _dtypes_fn(comm):
    cases = []
    for i, dt in enumerate(DTYPES):
        for shape in [(), (0,), (3, 4)]:
            cases.append(_values(dt, shape, i))
    base = _values("<f8", (6, 8), 99)
    cases += [base[::2, 1::3], base.T, np.asfortranarray(base), base[:, 0]]
    if comm.rank == 0:
        for k, a in enumerate(cases):
            comm.send(a, 1, tag=k % 3)
        return None
    bad = []
    for k, a in enumerate(cases):
        got = comm.recv(0, tag=k % 3)
        if not _same(got, a):
            bad.append((k, str(a.dtype), a.shape, str(got.dtype), got.shape))
    return bad


def test_every_dtype_and_shape_kept_exactly():
    assert run_ok(_dtypes_fn, 2)[1] == []


# what the quick paths remember of the last message on a channel (_p2p.quick_send/quick_recv):
# each case differs from the one before in one thing only - dtype of the same itemsize, byte
# order, shape of the same size, number of dimensions, tag - and comes round again
_MEMO = [("<f8", (3,), 0), ("<i8", (3,), 0), ("<i8", (3, 1), 0), (">i8", (3, 1), 0),
         (">i8", (1, 3), 0), (">i8", (1, 3), 1), ("<u2", (12,), 1), ("<f2", (12,), 1),
         ("<f2", (), 1), ("<f2", (0,), 1), ("<f2", (2, 0), 1), ("<f8", (3,), 0)]


def _memo_fn(comm):
    cases = [(np.dtype(dt), shape, tag) for dt, shape, tag in _MEMO] * 3
    if comm.rank == 0:
        for k, (dt, shape, tag) in enumerate(cases):
            comm.send(_values(dt, shape, k), 1, tag=tag)
            comm.recv(1, tag=9)                     # (one at a time: each goes the quick way)
        return True
    bad = []
    for k, (dt, shape, tag) in enumerate(cases):
        want = _values(dt, shape, k)
        out = np.empty(shape, dt) if k % 2 else None
        got = comm.recv(0, tag=tag, out=out)
        if not (_same(got, want) and (out is None or got is out)):
            bad.append((k, str(dt), shape, str(got.dtype), got.shape))
        comm.send(np.zeros(1), 0, tag=9)
    return bad


def test_the_quick_paths_memo_never_confuses_two_descriptions():
    assert run_ok(_memo_fn, 2)[1] == []


@pytest.mark.timeout(60)
def test_the_transport_lock_is_a_mutex_between_threads():
    """_p2p.Lock (a flag under the GIL, waiters on a token): one holder at a time while the
    holders release the GIL inside, every waiter woken, acquire(False) and locked() as
    threading.Lock's, release of an unlocked lock refused, a waiter interruptible."""
    import _thread

    from shmtree._p2p import Lock
    lock, inside, most, count = Lock(), [0], [0], [0]

    def hold(times):
        for _ in range(times):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                time.sleep(0)                   # (the GIL goes to the others meanwhile)
                count[0] += 1
                inside[0] -= 1

    threads = [threading.Thread(target=hold, args=(2000,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert (most[0], count[0]) == (1, 12000)
    assert lock.acquire(False) and lock.locked() and not lock.acquire(False)
    lock.release()
    assert not lock.locked()
    with pytest.raises(RuntimeError, match="release unlocked lock"):
        lock.release()
    lock.acquire()                              # a waiter: woken by the release, or
    woke = []                                   # interrupted (KeyboardInterrupt) meanwhile
    t = threading.Thread(target=lambda: (lock.acquire(), woke.append(1), lock.release()))
    t.start()
    time.sleep(0.1)
    assert woke == []
    lock.release()
    t.join(10)
    assert woke == [1] and not lock.locked()
    lock.acquire()
    timer = threading.Timer(0.1, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            lock.acquire()
    finally:
        timer.join()
        lock.release()
    assert not lock.locked()


SIZES = [0, 1, 100, 256 * 1024 + 5, 4 * MiB - 1, 4 * MiB + 5, 5 * MiB + 3, 64 * MiB]   # (around
                                                 # records.CMA_BYTES, the single copy's)


def _sizes_fn(comm, sizes):
    if comm.rank == 0:
        for n in sizes:
            comm.send(_values("u1", (n,), n), 1, tag=7)
        return True
    ok = []
    for n in sizes:
        want = _values("u1", (n,), n)
        out = np.empty(n, np.uint8) if n % 2 else None       # both with and without out=
        got = comm.recv(0, tag=7, out=out)
        ok.append(_same(got, want) and (out is None or got is out))
    return ok


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cma", ["1", "0"])
def test_sizes_up_to_64_MiB(monkeypatch, cma):
    """Through the ring (streamed in pieces when larger than it) and read straight from the
    sender's memory (cma=1, from records.CMA_BYTES: 4 MiB)."""
    monkeypatch.setenv("SHMTREE_P2P_CMA", cma)
    assert run_ok(_sizes_fn, 2, args=(SIZES,))[1] == [True] * len(SIZES)


def _wrap_fn(comm, count):
    sizes = np.random.default_rng(5).integers(1, 150_000, count)
    if comm.rank == 0:
        for i, n in enumerate(sizes):
            comm.send(_values("u1", (int(n),), i), 1)
        return None
    return all(_same(comm.recv(0), _values("u1", (int(n),), i)) for i, n in enumerate(sizes))


@pytest.mark.timeout(120)
def test_records_across_the_ring_end():
    """Messages of odd sizes (up to 150 KB, so ~15 MB in all: the 1 MiB ring wraps many
    times, records cut at its end) arrive intact."""
    assert run_ok(_wrap_fn, 2, args=(200,))[1] is True


# ---------------------------------------------------------------------------------------------
# order, tags, out=, modifying after send

def _order_fn(comm, count):
    if comm.rank == 0:
        for i in range(count):
            n = 1 if i % 100 else 70_000 if i % 200 else 300_000  # some large ones between
            comm.send(np.full(n, i, np.int32), 1, tag=3)
        reqs = [comm.isend(np.array([i], np.int64), 1, tag=4) for i in range(64)]
        shmtree.wait_all(reqs, timeout=60)
        return None
    got = [int(comm.recv(0, tag=3)[-1]) for _ in range(count)]
    reqs = [comm.irecv(0, tag=4) for _ in range(64)]
    later = [int(a[0]) for a in shmtree.wait_all(reqs, timeout=60)]
    return got == list(range(count)) and later == list(range(64))


@pytest.mark.timeout(120)
def test_1000_messages_arrive_in_order():
    assert run_ok(_order_fn, 2, args=(1000,))[1] is True


def _tags_fn(comm, big):
    if comm.rank == 0:
        comm.send(np.full(big, 1.0), 1, tag=1)    # (small: not waiting for the recv)
        comm.send(np.full(3, 2.0), 1, tag=2)
        comm.send(np.full(5, 3.0), 1, tag=1)
        return None
    b = comm.recv(0, tag=2)
    a = comm.recv(0, tag=1)
    c = comm.recv(0, tag=1)
    return (b.tolist(), float(a[0]), a.size, c.tolist())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("big", [10, 100_000])
def test_tags_out_of_order(big):
    assert run_ok(_tags_fn, 2, args=(big,))[1] == ([2.0] * 3, 1.0, big, [3.0] * 5)


def _mismatch_fn(comm, n, how):
    if comm.rank == 0:
        comm.send(np.arange(n, dtype=np.float64), 1)
        comm.send(np.arange(n, dtype=np.float64), 1)
        comm.send(np.arange(4, dtype=np.int16), 1)
        return None
    errors = []
    for wrong in (np.empty(n + 1), np.empty(n, np.float32)):
        try:
            if how == "irecv":
                comm.irecv(0, out=wrong).result(60)
            else:
                comm.recv(0, out=wrong)
            errors.append("no error")
        except ValueError as e:
            errors.append("consumed" in str(e))
    nxt = comm.recv(0)
    return errors, nxt.dtype.str, nxt.tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n,how", [(5, "recv"), (400_000, "recv"), (5, "irecv"),
                                   (400_000, "irecv")])
def test_out_mismatch_consumes_the_message(n, how):
    """A receiver whose out= does not match raises ValueError; the message is gone, and the
    next one arrives intact."""
    errors, dt, values = run_ok(_mismatch_fn, 2, args=(n, how))[1]
    assert errors == [True, True]
    assert dt == "<i2" and values == [0, 1, 2, 3]


def _modify_fn(comm, n):
    if comm.rank == 0:
        x = np.full(n, 7.0)
        comm.send(x, 1)
        x[:] = -1.0                    # allowed once send returned
        req = comm.isend(np.full(n, 8.0), 1, tag=1)
        req.result(60)
        comm.barrier()
        return None
    comm.barrier()                      # rank 0 has modified x before this rank receives it
    a = comm.recv(0)
    b = comm.recv(0, tag=1)
    return bool((a == 7.0).all() and (b == 8.0).all())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [10, 1_000_000])
def test_modify_after_send(n):
    """A small send returns before the recv is posted (the barrier comes after it on rank 0,
    before the recv on rank 1): the array is a copy.  A large one returns once read."""
    if n > 100_000:                     # a large send waits for its recv: recv first there
        def fn(comm):
            if comm.rank == 0:
                x = np.full(n, 7.0)
                comm.send(x, 1)
                x[:] = -1
                return None
            return bool((comm.recv(0) == 7.0).all())
        assert shmtree.run(fn, 2)[1] is True
    else:
        assert run_ok(_modify_fn, 2, args=(n,))[1] is True


# ---------------------------------------------------------------------------------------------
# sendrecv rings, isend/irecv, collectives in between

def _ring_fn(comm, n):
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    x = np.full(n, comm.rank, np.int64)
    y = comm.sendrecv(x, nxt, prv, sendtag=1, recvtag=1)
    out = np.empty(n, np.int64)
    z = comm.sendrecv(x * 2, nxt, prv, out=out)
    r = comm.irecv(prv, tag=5)
    s = comm.isend(x * 3, nxt, tag=5)
    w = shmtree.wait_all([s, r], timeout=60)[1]
    return bool((y == prv).all() and z is out and (z == 2 * prv).all() and (w == 3 * prv).all())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 20_000, 3_000_000])
@pytest.mark.parametrize("cma", ["1", "0"])
def test_sendrecv_ring_completes(monkeypatch, n, cma):
    """Every rank sends to rank+1 and receives from rank-1 at once: no deadlock, whatever the
    size (3 M int64: 24 MiB, far larger than a channel's ring)."""
    monkeypatch.setenv("SHMTREE_P2P_CMA", cma)
    assert run_ok(_ring_fn, 3, args=(n,)) == [True] * 3


def _interleave_fn(comm):
    r = comm.rank
    big = np.full(2_000_000, float(r))
    if r == 0:
        req = comm.isend(big, 1, tag=7)           # pending: rank 1 receives it only later
        comm.send(np.array([1.5]), 2)             # in the ring: rank 2 takes it later too
        s = comm.allreduce(np.ones(4) * r)
        comm.barrier()
        b = comm.broadcast(np.arange(3.0), root=0)
        req.result(60)
    elif r == 1:
        s = comm.allreduce(np.ones(4) * r)
        comm.barrier()
        b = comm.broadcast(None, root=0)
        got = comm.recv(0, tag=7)
        assert (got == 0.0).all()
    else:
        pending = comm.irecv(1, tag=3)            # waits through the collectives
        s = comm.allreduce(np.ones(4) * r)
        comm.barrier()
        b = comm.broadcast(None, root=0)
        assert comm.recv(0).tolist() == [1.5]
    if r == 1:
        comm.send(np.array([42]), 2, tag=3)
    if r == 2:
        assert pending.result(60).tolist() == [42]
    c = comm.iallreduce(np.ones(2))
    return s.tolist(), b.tolist(), c.result(60).tolist()


@pytest.mark.timeout(60)
def test_messages_and_collectives_do_not_block_each_other():
    got = run_ok(_interleave_fn, 3)
    assert got == [([3.0] * 4, [0.0, 1.0, 2.0], [3.0, 3.0])] * 3


def _pending_fn(comm):
    if comm.rank == 0:
        never = comm.irecv(1, tag=99)          # not sent until the end
        reqs = [comm.isend(np.full(10, i), 1, tag=1) for i in range(5)]
        shmtree.wait_all(reqs, timeout=30)      # done although `never` is still pending
        first = not never.done()
        comm.barrier()
        return first and never.result(30).tolist() == [0.0]
    got = [int(comm.recv(0, tag=1)[0]) for _ in range(5)]
    comm.barrier()
    comm.send(np.zeros(1), 0, tag=99)
    return got == list(range(5))


@pytest.mark.timeout(60)
def test_a_pending_irecv_does_not_hold_up_other_requests():
    assert run_ok(_pending_fn, 2) == [True, True]


def _self_fn(comm):
    comm.send(np.arange(3), comm.rank, tag=2)
    return comm.recv(comm.rank, tag=2).tolist()


def test_send_to_self():
    assert run_ok(_self_fn, 2) == [[0, 1, 2]] * 2


# ---------------------------------------------------------------------------------------------
# failures: dead peer, timeout, bad arguments

def _victim(group, rank, ready):
    comm = group.join(rank)
    comm.send(np.zeros(1), 1 - rank, tag=99)      # the channel exists (first contact done)
    ready.set()
    time.sleep(600)


def _survivor(group, rank, how, queue):
    comm = group.join(rank)
    comm.recv(1 - rank, tag=99)
    start = time.monotonic()
    try:
        if how == "recv":
            comm.recv(1 - rank, tag=1)
        else:
            comm.send(np.zeros(2_000_000), 1 - rank, tag=1)   # waits for a recv
        queue.put(("returned", "", 0.0))
    except BaseException as e:
        queue.put((error_name(e), str(e), time.monotonic() - start))
    finally:
        comm.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["recv", "send"])
def test_dead_peer(how):
    """A SIGKILLed peer: the rank blocked in recv from it (or send to it) raises PeerLostError
    within a few seconds."""
    ctx = mp.get_context("fork")
    with shmtree.Group(2) as group:
        ready, queue = ctx.Event(), ctx.Queue()
        victim = ctx.Process(target=_victim, args=(group, 0, ready))
        survivor = ctx.Process(target=_survivor, args=(group, 1, how, queue))
        procs = [victim, survivor]
        try:
            victim.start()
            survivor.start()
            assert ready.wait(30)
            time.sleep(0.3)                     # (the survivor is in its call by now)
            os.kill(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            name, text, _ = queue.get(timeout=30)
            assert name == "PeerLostError", text
            assert "rank 0 died" in text
            assert time.monotonic() - killed < DETECT_S
        finally:
            stop_processes(procs)
            queue.close()


def _timeout_fn(comm):
    if comm.rank == 0:
        start = time.monotonic()
        try:
            comm.recv(1, timeout=0.3)
        except shmtree.CollectiveTimeoutError as e:
            return ("timeout", time.monotonic() - start, "timed out in recv from rank 1" in str(e))
        return ("returned",)
    try:
        comm.barrier(timeout=30)
    except shmtree.PeerLostError:
        return ("lost",)
    return ("returned",)


@pytest.mark.timeout(60)
def test_timeout_aborts_the_group():
    a, b = run_ok(_timeout_fn, 2)
    assert a[0] == "timeout" and 0.25 <= a[1] < 5 and a[2]
    assert b == ("lost",)


class _Alarm(Exception):
    pass


def _interrupt_fn(comm):
    if comm.rank == 0:
        def ring(signum, frame):
            raise _Alarm()
        signal.signal(signal.SIGALRM, ring)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            comm.recv(1, tag=5)                 # never sent: the alarm interrupts it
        except _Alarm:
            pass
        try:
            comm.send(np.zeros(1), 1)
        except shmtree.PeerLostError:
            return "aborted"
        return "usable"
    try:
        comm.barrier(timeout=30)
    except shmtree.PeerLostError as e:
        return "lost" if "interrupted" in str(e) or "_Alarm" in str(e) else str(e)
    return "returned"


@pytest.mark.timeout(60)
def test_an_interrupted_recv_aborts_the_group():
    """An exception in a blocked recv (a signal handler's) cannot leave a receive half-posted:
    the group is aborted, as for an interrupted collective."""
    assert run_ok(_interrupt_fn, 2) == ["aborted", "lost"]


def _shared_fn(comm, n):
    x = comm.empty(n, np.float32)
    out = comm.zeros(n, np.float32)
    x[:] = np.arange(n, dtype=np.float32) + comm.rank
    other = 1 - comm.rank
    got = comm.sendrecv(x, other, other, out=out)
    return bool(got is out and (out == np.arange(n, dtype=np.float32) + other).all())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [100, 3_000_000])
def test_shared_arrays(n):
    """Arrays of comm.empty as the message and as out= (a single copy from 256 KiB)."""
    assert run_ok(_shared_fn, 2, args=(n,)) == [True, True]


def _args_fn(comm):
    out = []
    for call in (lambda: comm.send(np.zeros(1), 2), lambda: comm.send(np.zeros(1), -1),
                 lambda: comm.send(np.zeros(1), 1, tag=-1),
                 lambda: comm.send(np.array([object()]), 1),
                 lambda: comm.recv(1, tag="x"), lambda: comm.recv(1, out=[1.0]),
                 lambda: comm.isend(np.zeros(1), 5)):
        try:
            call()
            out.append("ok")
        except (TypeError, ValueError) as e:
            out.append(type(e).__name__)
    comm.barrier()                                # the group is usable
    return out


def _refused_sendrecv_fn(comm):
    """A sendrecv whose receive's arguments are refused raises and sends nothing (the native
    quick path sends only when the general path would take the call as it is)."""
    other = 1 - comm.rank
    x = np.zeros(1)
    for _ in range(3):                            # channels and descriptions known: quick
        comm.sendrecv(x, other, other, sendtag=7, recvtag=7)
    out = []
    if comm.rank == 0:
        for k, kw in enumerate(({"source": 5}, {"source": -2}, {"recvtag": -2},
                                {"recvtag": "x"}, {"out": [1.0]}, {"timeout": True},
                                {"source": 1.0})):
            args = {"source": 1, **kw}
            try:
                comm.sendrecv(np.full(1, k + 1.0), 1, sendtag=7, **args)
                out.append("ok")
            except (TypeError, ValueError) as e:
                out.append(type(e).__name__)
        comm.send(np.full(1, -1.0), 1, tag=7)
    comm.barrier()
    if comm.rank == 1:
        out = comm.recv(0, tag=7).tolist()        # the first message after the warm-up
    return out


def test_a_refused_sendrecv_sends_nothing():
    got = run_ok(_refused_sendrecv_fn, 2)
    assert got[0] == ["ValueError", "ValueError", "ValueError", "TypeError", "TypeError",
                      "ValueError", "TypeError"], got
    assert got[1] == [-1.0], got


def test_local_errors():
    got = run_ok(_args_fn, 2)
    assert got[0] == ["ValueError", "ValueError", "ValueError", "TypeError", "TypeError",
                      "TypeError", "ValueError"]


def _left_fn(comm):
    if comm.rank == 1:
        comm.send(np.arange(3.0), 0)              # then returns: leaves the group
        return None
    time.sleep(0.5)
    first = comm.recv(1).tolist()                 # sent before it left: still delivered
    try:
        comm.recv(1, tag=4)
    except shmtree.ShmtreeError as e:
        return first, "left the group" in str(e) or str(e)
    return first, "returned"


@pytest.mark.timeout(60)
def test_a_sender_that_left():
    assert run_ok(_left_fn, 2)[0] == ([0.0, 1.0, 2.0], True)


def _left_unread_fn(comm):
    if comm.rank == 0:
        comm.send(np.arange(3.0), 1)              # never received; then leaves
        return time.monotonic()
    try:
        comm.barrier(timeout=20)                  # rank 0 never makes it
    except shmtree.ShmtreeError as e:
        return "left the group" in str(e) or str(e)
    return "returned"


@pytest.mark.timeout(60)
def test_a_sender_leaving_with_an_unread_message_is_seen_as_gone():
    """Its close waits for the receiver to map the channel, but as a member that has left: the
    receiver's collective fails at once (it does not wait for the sender, nor the sender for it)."""
    start = time.monotonic()
    got = run_ok(_left_unread_fn, 2)
    assert got[1] is True and time.monotonic() - start < 15


def _isend_then_close_fn(comm, n):
    if comm.rank == 0:
        comm.isend(np.full(n, 5.0), 1, tag=1)     # not waited for: close (at return) finishes it
        comm.isend(np.full(3, 6.0), 1, tag=2)
        return None
    time.sleep(0.5)
    a = comm.recv(0, tag=1)
    b = comm.recv(0, tag=2)
    return bool((a == 5.0).all() and a.size == n and b.tolist() == [6.0] * 3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [10, 2_000_000])
def test_close_finishes_outstanding_isends(n):
    assert run_ok(_isend_then_close_fn, 2, args=(n,))[1] is True


# ---------------------------------------------------------------------------------------------
# memory: channels only between the pairs that talk

def _neighbours_fn(comm):
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for _ in range(3):
        comm.sendrecv(np.zeros(1000), nxt, prv)
        comm.sendrecv(np.zeros(300_000), prv, nxt)
    comm.barrier()
    tr = comm._p2p_transport
    with open("/proc/self/maps") as f:
        maps = {line.split()[4] for line in f if "shmtree-p2p" in line}
    return len(tr.out), len(tr.inn), len(maps)


@pytest.mark.timeout(180)
def test_memory_per_rank_does_not_grow_with_P():
    small = run_ok(_neighbours_fn, 4)
    large = run_ok(_neighbours_fn, 16)
    # 2 channels out, 2 in, own home + 2 peers' homes: the same at P = 4 and P = 16
    assert set(small) == set(large) == {(2, 2, 7)}


# ---------------------------------------------------------------------------------------------
# start methods, a Pool, the test process itself

def _ping_fn(comm):
    other = 1 - comm.rank
    got = comm.sendrecv(np.array([comm.rank, 10]), other, other)
    return got.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_start_methods(method):
    assert run_ok(_ping_fn, 2, start_method=method) == [[1, 10], [0, 10]]


def _pool_task(comm):
    if comm.rank == 0:
        try:
            comm.recv(1, tag=5)          # rank 1 never sends: it is idle
        except shmtree.ShmtreeError as e:
            return "idle" in str(e)
        return "returned"
    return None


@pytest.mark.timeout(60)
def test_pool_stall_detector():
    """A recv from a Pool member that stays idle fails after stall_timeout (the pool is then
    broken: its watch thread may fail the call itself with the same cause first).  pool.run,
    not map: map deals tasks one at a time, and one worker could take both."""
    with shmtree.Pool(2, stall_timeout=1.0) as pool:
        try:
            assert pool.run(_pool_task) == [True, None]
        except shmtree.PeerLostError as e:
            assert "idle" in str(e) and "recv from rank 1" in str(e), str(e)


def _warm(comm):
    """Send to itself until the quick paths take the call (the channel made, the memo warm):
    the native send then succeeds with no Python-level check before it."""
    x = np.arange(4.0)
    for _ in range(3):
        comm.send(x, 0, tag=3)
        assert comm.recv(0, tag=3).tolist() == x.tolist()
    assert comm._p2p_quick is not None and comm._p2p_quick.send(x, 0, 3)
    assert comm.recv(0, tag=3).tolist() == x.tolist()
    return x


def _error_of(call):
    try:
        call()
    except Exception as e:
        return error_name(e), str(e)
    return "returned", ""


def _fork_child(comm, x, queue):
    queue.put([_error_of(lambda: comm.send(x, 0, tag=3)),
               _error_of(lambda: comm.recv(0, tag=3, out=np.empty(4)))])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["abort", "group closed", "closed", "fork"])
def test_the_quick_paths_decline_an_unusable_communicator(how):
    """send and recv call the native quick path first, with no Python-level check
    (Messages._p2p_quick): with the memo warm, a communicator whose group is aborted or closed,
    that is closed, or used in a forked child must still raise what the general path raises,
    never send nor receive.  (A message is waiting in the channel for the recv to take.)"""
    with shmtree.Group(1) as group:
        comm = group.join(0)
        try:
            x = _warm(comm)
            comm.send(x, 0, tag=3)                  # (waiting for the recv)
            if how == "fork":
                ctx = mp.get_context("fork")
                queue = ctx.Queue()
                child = ctx.Process(target=_fork_child, args=(comm, x, queue))
                try:
                    child.start()
                    got = queue.get(timeout=30)
                finally:
                    stop_processes([child])
                    queue.close()
                assert all(name == "ShmtreeError" and "a forked child cannot use it" in text
                           for name, text in got), got
                assert comm.recv(0, tag=3).tolist() == x.tolist()    # (still there: untaken)
                return
            if how == "abort":
                group.abort()
                want = ("PeerLostError", "the group is aborted")
            elif how == "group closed":
                group._closed = True        # (a group closed under an open communicator, as
                want = ("ShmtreeError", "the group is closed")     # a SubGroup's can be)
            else:
                comm.close()
                want = ("ShmtreeError", "this communicator is closed")
            try:
                for got in [_error_of(lambda: comm.send(x, 0, tag=3)),
                            _error_of(lambda: comm.recv(0, tag=3)),
                            _error_of(lambda: comm.recv(0, tag=3, out=np.empty(4), timeout=5))]:
                    assert got[0] == want[0] and want[1] in got[1], got
            finally:
                group._closed = False if how == "group closed" else group._closed
        finally:
            comm.close()


def test_in_the_test_process_nothing_leaks():
    """Join a group of one here, send to itself, close: no descriptor, mapping or thread left
    (the autouse fixture checks the descriptors and mappings)."""
    threads = set(threading.enumerate())
    with shmtree.Group(1) as group:
        comm = group.join(0)
        try:
            r = comm.irecv(0, tag=1)
            comm.isend(np.arange(5), 0, tag=1).result(30)
            assert r.result(30).tolist() == list(range(5))
            assert comm.sendrecv(np.ones(300_000), 0, 0).sum() == 300_000
        finally:
            comm.close()
    time.sleep(0.05)
    assert set(threading.enumerate()) <= threads


# ---------------------------------------------------------------------------------------------
# any source, any tag (issue 34, item 7): Status, posting order, first contact, failures

_ANY_SIZES = (3, 40_000, 2_000_000)        # a quick record, a ring's worth, more than the ring


def _any_fn(comm, per):
    """Every rank but 0 sends `per` messages to rank 0, their first contact (after a pause,
    so that rank 0 already waits for channels that do not exist yet), tags 0 and 1 in turn,
    of sizes in turn; rank 0 receives them all from ANY_SOURCE with ANY_TAG, the first half
    by recv(status=), the rest by irecv (Request.status)."""
    P = comm.size
    if comm.rank:
        time.sleep(0.2)
        sent_at = time.monotonic()                # (CLOCK_MONOTONIC: one clock for all)
        for k in range(per):
            n = _ANY_SIZES[(k + comm.rank) % len(_ANY_SIZES)]
            comm.send(np.full(n, 1000 * comm.rank + k, np.int32), 0, tag=k % 2)
        return sent_at
    got = []
    total = per * (P - 1)
    for i in range(total):
        if i < total // 2:
            st = shmtree.Status()
            a = comm.recv(shmtree.ANY_SOURCE, tag=shmtree.ANY_TAG, status=st, timeout=60)
        else:
            req = comm.irecv(shmtree.ANY_SOURCE, tag=shmtree.ANY_TAG, timeout=60)
            a = req.result(60)
            st = req.status
        got.append((st.Get_source(), st.Get_tag(), st.count, st.nbytes, str(st.dtype),
                    st.shape, int(a[0]), a.shape, bool((a == a[0]).all()), time.monotonic()))
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [3, 4])
def test_any_source_gets_every_message_with_its_status(P):
    """recv / irecv from ANY_SOURCE with ANY_TAG at P=3 and 4 (P-1 senders that rank 0 has
    never heard from): every message once, its Status its source, tag, bytes, dtype and
    shape, and each source's messages of one tag in the order sent."""
    per = 6
    results = run_ok(_any_fn, P, args=(per,))
    got = results[0]
    assert len(got) == per * (P - 1)
    seen, first_at = {}, {}
    for src, tag, count, nbytes, dtype, shape, first, a_shape, whole, at in got:
        first_at.setdefault(src, at)
        k = first - 1000 * src
        n = _ANY_SIZES[(k + src) % len(_ANY_SIZES)]
        assert 1 <= src < P and 0 <= k < per and whole, (src, first)
        assert (tag, count, nbytes, dtype, shape, a_shape) == (k % 2, 4 * n, 4 * n, "int32",
                                                                (n,), (n,)), (src, k)
        seen.setdefault((src, tag), []).append(k)
    assert sorted(seen) == [(s, t) for s in range(1, P) for t in (0, 1)]
    for (src, tag), ks in seen.items():
        assert ks == list(range(tag, per, 2)), (src, tag, ks)     # never reordered
    # first contact is found when the sender counts its new channel in rank 0's home, not by
    # the periodic look (p2p.records.LOOK_S, 5 s)
    for src in range(1, P):
        assert first_at[src] - results[src] < 2.0, (src, first_at[src] - results[src])


def _any_order_fn(comm):
    """Posting order between receives that name the source and ANY_SOURCE, and arrival order
    among kept messages, made deterministic with acknowledgements."""
    r = comm.rank
    out = []
    if r == 0:
        # 1. a specific receive posted first gets the first message, the ANY_SOURCE one the next
        a = comm.irecv(1, tag=0)
        b = comm.irecv(shmtree.ANY_SOURCE, tag=0)
        comm.send(np.zeros(1), 1, tag=50)                         # (go)
        out.append([int(a.result(60)[0]), int(b.result(60)[0]), b.status.source])
        # 2. the other way round
        c = comm.irecv(shmtree.ANY_SOURCE, tag=0)
        d = comm.irecv(1, tag=0)
        comm.send(np.zeros(1), 1, tag=50)
        out.append([int(c.result(60)[0]), c.status.source, int(d.result(60)[0])])
        # 3. kept messages: the earliest-arrived first, whichever its source (1 then 2, then
        # 2 then 1); tag 99 says "the one before is kept" (it is behind it in the channel)
        for first, second in ((1, 2), (2, 1)):
            for src in (first, second):
                comm.send(np.zeros(1), src, tag=51)               # (go: send yours)
                comm.recv(shmtree.ANY_SOURCE, tag=99, timeout=60)
            order = []
            for _ in range(2):
                st = shmtree.Status()
                v = comm.recv(shmtree.ANY_SOURCE, tag=5, status=st, timeout=60)
                order.append((st.source, int(v[0])))
            out.append(order)
        # 4. ANY_TAG from one source: its messages in the order sent, whatever their tags;
        # then the same through ANY_SOURCE, and a blocking recv that names a tag kept behind
        comm.send(np.zeros(1), 1, tag=52)
        tags = []
        for _ in range(3):
            st = shmtree.Status()
            comm.recv(1, tag=shmtree.ANY_TAG, status=st, timeout=60)
            tags.append(st.tag)
        st = shmtree.Status()
        last = comm.recv(1, tag=8, status=st, timeout=60)         # (sent after a tag 7)
        tags.append((st.tag, int(last[0])))
        st = shmtree.Status()
        comm.recv(shmtree.ANY_SOURCE, tag=shmtree.ANY_TAG, status=st, timeout=60)
        tags.append((st.source, st.tag))
        out.append(tags)
        # 5. sendrecv from ANY_SOURCE, with status=
        st = shmtree.Status()
        got = comm.sendrecv(np.array([7.0]), 2, shmtree.ANY_SOURCE, sendtag=60,
                            recvtag=shmtree.ANY_TAG, status=st, timeout=60)
        out.append([st.source, st.tag, got.tolist()])
        return out
    if r == 1:
        comm.recv(0, tag=50)
        comm.send(np.array([1.0]), 0, tag=0)
        comm.send(np.array([2.0]), 0, tag=0)
        comm.recv(0, tag=50)
        comm.send(np.array([3.0]), 0, tag=0)
        comm.send(np.array([4.0]), 0, tag=0)
    for _ in range(2):
        comm.recv(0, tag=51)
        comm.send(np.array([10.0 * r]), 0, tag=5)
        comm.send(np.zeros(1), 0, tag=99)
    if r == 1:
        comm.recv(0, tag=52)
        for k, tag in enumerate((3, 4, 3, 7, 8)):
            comm.send(np.array([100.0 + k]), 0, tag=tag)
    if r == 2:
        got = comm.recv(0, tag=60)
        comm.send(got * 2, 0, tag=61)
    return None


@pytest.mark.timeout(120)
def test_any_source_matching_order():
    """MPI's rules: receives match in posting order, whether they name the source or
    ANY_SOURCE; a receive takes the earliest-arrived kept message; one source's messages of
    one tag never overtake each other, ANY_TAG included."""
    got = run_ok(_any_order_fn, 3)[0]
    assert got[0] == [1, 2, 1]                    # specific first: it gets message 1
    assert got[1] == [3, 1, 4]                    # ANY_SOURCE first: it gets message 3
    assert got[2] == [(1, 10), (2, 20)]           # kept from 1 first, then from 2
    assert got[3] == [(2, 20), (1, 10)]           # kept from 2 first, then from 1
    assert got[4] == [3, 4, 3, (8, 104), (1, 7)]  # ANY_TAG in order; tag 8 past a kept 7
    assert got[5] == [2, 61, [14.0]]


def _any_quick_fn(comm):
    """A blocking recv that names its source, on a warm channel (the quick path), must not
    take a message that an ANY_SOURCE irecv posted before it is to get: both messages wait in
    the channel when the two receives are posted (the quick path would find them there
    first, before the message thread wakes)."""
    if comm.rank == 1:
        for _ in range(3):                        # (channel and memo warm)
            comm.send(np.zeros(1), 0, tag=0)
        comm.send(np.array([1.0]), 0, tag=0)
        comm.send(np.array([2.0]), 0, tag=0)
        comm.barrier()
        return None
    for _ in range(3):
        comm.recv(1, tag=0)
    comm.barrier()                                # (both are in the channel, unread)
    req = comm.irecv(shmtree.ANY_SOURCE, tag=0)
    second = comm.recv(1, tag=0, timeout=60)
    return int(req.result(60)[0]), int(second[0])


@pytest.mark.timeout(60)
def test_an_any_source_irecv_keeps_its_place_before_a_quick_recv():
    assert run_ok(_any_quick_fn, 2)[0] == (1, 2)


def _any_timeout_fn(comm):
    if comm.rank == 0:
        start = time.monotonic()
        try:
            comm.recv(shmtree.ANY_SOURCE, tag=shmtree.ANY_TAG, timeout=0.3)
        except shmtree.CollectiveTimeoutError as e:
            return ("timeout", time.monotonic() - start, "recv from ANY_SOURCE" in str(e))
        return ("returned",)
    try:
        comm.barrier(timeout=30)
    except shmtree.PeerLostError:
        return ("lost",)
    return ("returned",)


@pytest.mark.timeout(60)
def test_any_source_timeout():
    got = run_ok(_any_timeout_fn, 3)
    assert got[0][0] == "timeout" and 0.25 <= got[0][1] < 5 and got[0][2], got[0]
    assert got[1:] == [("lost",), ("lost",)]


def _any_left_fn(comm):
    if comm.rank:
        comm.send(np.array([float(comm.rank)]), 0, tag=3)     # then returns: leaves
        return None
    time.sleep(0.5)
    got = sorted(float(comm.recv(shmtree.ANY_SOURCE, tag=3)[0]) for _ in range(2))
    try:
        comm.recv(shmtree.ANY_SOURCE, timeout=30)
    except shmtree.ShmtreeError as e:
        return got, error_name(e), "every other rank is gone" in str(e) and "left" in str(e)
    return got, "returned"


@pytest.mark.timeout(60)
def test_any_source_when_every_other_rank_left():
    """What the others sent before they left is received; then ANY_SOURCE has nobody left
    to hear from, and says so (not a timeout)."""
    assert run_ok(_any_left_fn, 3)[0] == ([1.0, 2.0], "ShmtreeError", True)


def _any_victim(group, rank, ready):
    comm = group.join(rank)
    ready.put(rank)
    time.sleep(600)


def _any_late_sender(group, rank, go):
    comm = group.join(rank)
    go.wait(60)
    comm.send(np.array([5.0]), 0, tag=4)
    time.sleep(600)


def _any_survivor(group, rank, queue):
    comm = group.join(rank)
    start = time.monotonic()
    try:
        st = shmtree.Status()
        v = comm.recv(shmtree.ANY_SOURCE, tag=4, status=st, timeout=60)
        queue.put(("got", st.source, float(v[0])))
        start = time.monotonic()
        comm.recv(shmtree.ANY_SOURCE, tag=4, timeout=60)
        queue.put(("returned", "", 0.0))
    except BaseException as e:
        queue.put((error_name(e), str(e), time.monotonic() - start))
    finally:
        comm.close()


@pytest.mark.timeout(90)
def test_any_source_with_dead_peers():
    """P=3: rank 2 is SIGKILLed while rank 0 waits in recv(ANY_SOURCE); rank 1 lives, so
    rank 0 keeps waiting and gets rank 1's message; once rank 1 is killed too, nobody can
    send and the receive raises PeerLostError within a few seconds."""
    ctx = mp.get_context("fork")
    with shmtree.Group(3) as group:
        ready, queue, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        survivor = ctx.Process(target=_any_survivor, args=(group, 0, queue))
        late = ctx.Process(target=_any_late_sender, args=(group, 1, go))
        victim = ctx.Process(target=_any_victim, args=(group, 2, ready))
        procs = [survivor, late, victim]
        try:
            for p in procs:
                p.start()
            assert ready.get(timeout=30) == 2
            time.sleep(0.5)                       # (rank 0 waits in its recv by now)
            os.kill(victim.pid, signal.SIGKILL)
            time.sleep(1.0)                       # (it sees rank 2 dead, and waits on)
            go.set()
            assert queue.get(timeout=30) == ("got", 1, 5.0)
            time.sleep(0.3)
            os.kill(late.pid, signal.SIGKILL)
            killed = time.monotonic()
            name, text, _ = queue.get(timeout=30)
            assert name == "PeerLostError", text
            assert "every other rank is gone" in text and "died" in text, text
            assert time.monotonic() - killed < DETECT_S
        finally:
            stop_processes(procs)
            queue.close()
            ready.close()


def _any_misuse_fn(comm):
    out = []
    for call in (lambda: comm.send(np.zeros(1), shmtree.ANY_SOURCE),
                 lambda: comm.isend(np.zeros(1), shmtree.ANY_SOURCE),
                 lambda: comm.sendrecv(np.zeros(1), shmtree.ANY_SOURCE, 0),
                 lambda: comm.send(np.zeros(1), 1 - comm.rank, tag=shmtree.ANY_TAG),
                 lambda: comm.recv(-2), lambda: comm.irecv(-2),
                 lambda: comm.recv(shmtree.ANY_SOURCE, tag=-2),
                 lambda: comm.recv(1 - comm.rank, status=object()),
                 lambda: comm.recv(shmtree.ANY_SOURCE, status={})):
        try:
            call()
            out.append("ok")
        except (TypeError, ValueError) as e:
            named = "ANY_SOURCE" in str(e) or "ANY_TAG" in str(e) or "Status" in str(e) \
                or "outside" in str(e) or ">= 0" in str(e)
            out.append((type(e).__name__, named))
    comm.barrier()                                # the group is usable, nothing was sent
    comm.send(np.array([float(comm.rank)]), 1 - comm.rank, tag=0)
    out.append(float(comm.recv(shmtree.ANY_SOURCE)[0]))
    return out


def test_any_source_misuse():
    """A send to ANY_SOURCE (or with ANY_TAG) is a ValueError naming it; a status= that is
    not a shmtree.Status a TypeError; nothing is sent or posted by a refused call."""
    V, T = ("ValueError", True), ("TypeError", True)
    got = run_ok(_any_misuse_fn, 2)
    for rank, out in enumerate(got):
        assert out == [V, V, V, V, V, V, V, T, T, float(1 - rank)], (rank, out)
    assert shmtree.ANY_SOURCE == -1 and shmtree.ANY_TAG == -1
    assert "Status" in shmtree.__all__ and "ANY_SOURCE" in shmtree.__all__
    st = shmtree.Status()
    assert (st.Get_source(), st.Get_tag(), st.Get_count()) == (-1, -1, 0)
    st.count = 24
    assert st.Get_count(np.float64) == 3
    with pytest.raises(ValueError):
        st.Get_count(np.dtype("V5"))


_ANY_MPI_PROG = r"""
import sys
import numpy as np
from mpi4py import MPI
import shmtree

W = MPI.COMM_WORLD


def refused(comm, calls):
    out = []
    for call in calls:
        try:
            call()
            out.append("returned")
        except NotImplementedError as e:
            out.append(("ANY_SOURCE" in str(e) or "ANY_TAG" in str(e)) and "by name" in str(e))
    return out


def any_tag_in_order(comm, peers):
    # ANY_TAG from each peer: in the order sent, the status naming source and tag
    r = comm.rank
    reqs = [comm.isend(np.array([r, k]), peer, tag=tag)
            for peer in peers for k, tag in enumerate((5, 3, 9))]
    for peer in peers:
        seen = []
        for k in range(2):
            st = shmtree.Status()
            v = comm.recv(peer, tag=shmtree.ANY_TAG, status=st, timeout=60)
            seen.append((st.source, st.tag, v.tolist()))
        req = comm.irecv(peer, tag=shmtree.ANY_TAG, timeout=60)
        v = req.result(60)
        seen.append((req.status.source, req.status.tag, v.tolist()))
        assert seen == [(peer, 5, [peer, 0]), (peer, 3, [peer, 1]), (peer, 9, [peer, 2])], seen
    shmtree.wait_all(reqs, 60)


def inter_worker(comm):
    # a launcher per node (inter=): ANY_SOURCE refused, and ANY_TAG through the relay; ANY_TAG
    # within the node works
    r, P = comm.rank, comm.size
    local, remote = r ^ 1, (r + 2) % P
    got = refused(comm, (lambda: comm.recv(shmtree.ANY_SOURCE, timeout=30),
                         lambda: comm.recv(remote, tag=shmtree.ANY_TAG, timeout=30),
                         lambda: comm.irecv(remote, tag=shmtree.ANY_TAG)))
    assert got == [True, True, True], got
    any_tag_in_order(comm, [local])
    assert comm.allreduce(np.ones(1))[0] == P
    return True


if sys.argv[1] == "inter":
    got = shmtree.run(inter_worker, 2, inter=W)
    assert got == [True, True], got            # (this node's workers)
    print(f"OK any {W.rank}", flush=True)
    sys.exit(0)
comm = shmtree.from_mpi(W, node_size=2)
r, P = comm.rank, comm.size
local, remote = r ^ 1, (r + 2) % P
assert comm.nodes == 2
got = refused(comm, (lambda: comm.recv(shmtree.ANY_SOURCE, timeout=30),
                     lambda: comm.irecv(shmtree.ANY_SOURCE, tag=shmtree.ANY_TAG),
                     lambda: comm.sendrecv(np.zeros(1), local, shmtree.ANY_SOURCE, timeout=30)))
assert got == [True, True, True], got
any_tag_in_order(comm, [local, remote])
assert comm.allreduce(np.ones(1))[0] == P
comm.close()
W.Barrier()
print(f"OK any {r}", flush=True)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode,nprocs", [("from_mpi", 4), ("inter", 2)])
def test_any_source_across_simulated_nodes(tmp_path, mode, nprocs):
    """A communicator across 2 simulated nodes (from_mpi, 4 ranks; inter=, 2 launchers of 2
    workers): ANY_TAG works within a node and, over MPI (from_mpi), between nodes, with its
    Status; ANY_SOURCE is refused with a NotImplementedError that says what to do (and
    ANY_TAG through the launchers' relay), and the communicator stays usable."""
    import subprocess
    import sys
    from test_multinode import _import_root, _mpiexec, _reap, _unlink_own_mpich_segments, _shm
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich)")
    prog = tmp_path / "any_prog.py"
    prog.write_text(_ANY_MPI_PROG)
    before = _shm()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), _import_root()) if p]))
    proc = subprocess.Popen([mpiexec, "-n", str(nprocs), sys.executable, str(prog), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mpiexec hung:\n{out.decode(errors='replace')[-3000:]}")
    finally:
        _reap(proc.pid)
        _unlink_own_mpich_segments(before)
    out = out.decode(errors="replace")
    assert proc.returncode == 0 and all(f"OK any {r}" in out for r in range(nprocs)), \
        out[-4000:]
    assert not [n for n in _shm() - before if "shmtree" in n], _shm() - before


# ---------------------------------------------------------------------------------------------
# across nodes (from_mpi): within a node as on one machine, between nodes over MPI

@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs,mode", [(4, ""), (4, "fail"), (5, "")])
def test_across_simulated_nodes(nprocs, mode):
    """tests/mpi_p2p_prog.py under mpiexec, 4 ranks on 2 simulated nodes (5: nodes of 2, 2 and
    1 ranks, no lanes: the rings and the sub-communicator only): messages within and
    between nodes with the same semantics (dtypes, 0 B .. 64 MiB, tags out of order, out=
    mismatch, the ring, collectives meanwhile, a sub-communicator across nodes); `fail`: a
    timeout between nodes, and every other rank raises PeerLostError instead of hanging.
    Nothing is left in /dev/shm, no process outlives the job."""
    import subprocess
    import sys
    from test_multinode import _import_root, _mpiexec, _reap, _unlink_own_mpich_segments, _shm
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich)")
    prog = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_p2p_prog.py")
    before = _shm()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), _import_root()) if p]))
    proc = subprocess.Popen([mpiexec, "-n", str(nprocs), sys.executable, prog, "2"] +
                            ([mode] if mode else []),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mpiexec hung:\n{out.decode(errors='replace')[-3000:]}")
    finally:
        _reap(proc.pid)
        _unlink_own_mpich_segments(before)
    out = out.decode(errors="replace")
    assert proc.returncode == 0 and "OK p2p" in out, out[-4000:]
    assert not [n for n in _shm() - before if "shmtree" in n], _shm() - before


def test_bench_p2p_runs(capsys):
    from shmtree.bench.cli import main
    assert main(["p2p", "--no-mpi", "--rounds", "1", "--pingpong", "8", "--bandwidth",
                 "64K"]) == 0
    out = capsys.readouterr().out
    assert "half round trip" in out and "sendrecv bandwidth" in out


def test_no_direct_copy_where_yama_forbids_reading_a_sibling(monkeypatch, tmp_path):
    """Yama's ptrace_scope 1 (Ubuntu's default) lets a process read only its descendants'
    memory: then large messages must stream through the ring, not abort on process_vm_readv."""
    import builtins

    from shmtree.p2p import records
    real_open = builtins.open
    for scope, allowed in (("0\n", True), ("1\n", False), ("2\n", False), (None, True)):
        def fake_open(path, *a, _scope=scope, **k):
            if path == "/proc/sys/kernel/yama/ptrace_scope":
                if _scope is None:
                    raise FileNotFoundError(path)
                f = tmp_path / "scope"
                f.write_text(_scope)
                return real_open(f, *a, **k)
            return real_open(path, *a, **k)
        monkeypatch.setattr(builtins, "open", fake_open)
        assert records._yama_allows() is allowed, scope
        monkeypatch.setattr(builtins, "open", real_open)
