"""Survive (issue 38): revoke, agree, failed_ranks, shrink; pools that heal; run(on_failure=).

- the chaos matrix: SIGKILL, SIGSTOP (the survivors pass timeout=) and os._exit of a rank, at a
  random point of a collective, a point-to-point call, a shared-array copy or a split, P = 2..8
  (more processes than cores: the waits yield).  Every survivor gets PeerLostError or
  RevokedError (CollectiveTimeoutError where its own timeout ran out), never a hang; every
  call it completed before was right (checked against numpy); agree and failed_ranks give the
  same answer on every survivor; shrink gives a communicator of the survivors whose next 100
  collectives (and a split, messages, shared arrays) are checked against numpy.  The default
  run takes one case per call kind (a fault, P and victim each); SHMTREE_LONG=1 runs every
  fault x kind x P.
- agree: the same value and failed set on every survivor while a rank (the decider too) dies
  during the call; a stopped rank is left out after the timeout, and learns it when it runs.
- revoke: reaches ranks blocked in collectives and in messages, from any rank or thread; later
  calls raise RevokedError; agree still works; sub-communicators are not revoked.
- sub-communicators made before a failure: revoked if they held the dead rank, going on if not.
- pools: a worker dies during map; its task fails with PeerLostError naming its rank, the other
  tasks run, and the healed pool's collectives are right (shrink and respawn).
- the sentinel: its thread and descriptors go with the communicator; a member that closed and
  exited, or died between calls, does not abort the group by itself.
- across nodes: agree and shrink are refused naming ULFM; revoke reaches every node.
- torch: abort() reaches the other ranks, get_error(), shmtree.torch.shrink_group.

Nothing is left behind (the autouse fixture: /dev/shm, descriptors, mappings, children).
"""
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import shmtree
from procutil import memfd_mappings, own_process_group, run_ok

OPS = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall", "gather",
       "scatter", "scan", "exscan", "barrier", "sendrecv", "shared", "split")
FAULTS = ("kill", "stop", "exit")
STOP_TIMEOUT_S = 1.0        # timeout= the survivors pass (calls, shrink) when the victim stops
SHRINK_TIMEOUT_S = 20.0     # shrink's timeout otherwise (a bound on a hang, never reached)
MAX_OPS = 400               # a survivor that completes this many calls after the fault: a hang
CHECKED = 100               # collectives checked on the shrunk communicator


# ---------------------------------------------------------------------------------------------
# calls checked against numpy


def _x(r, i, n=4):
    return np.arange(n, dtype=np.float64) + 10.0 * r + i


def one_op(comm, op, i, timeout=None, shared=None):
    """Make call `op` number i on comm and check its result against numpy (AssertionError on
    wrong data); the error of a call that fails propagates."""
    P, me = comm.size, comm.rank
    x = _x(me, i)
    every = [_x(q, i) for q in range(P)]
    root = i % P
    if op == "allreduce":
        np.testing.assert_array_equal(comm.allreduce(x, timeout=timeout), sum(every))
    elif op == "broadcast":
        got = comm.broadcast(x if me == root else None, root=root, timeout=timeout)
        np.testing.assert_array_equal(got, every[root])
    elif op == "reduce":
        got = comm.reduce(x, root=root, timeout=timeout)
        if me == root:
            np.testing.assert_array_equal(got, sum(every))
    elif op == "allgather":
        np.testing.assert_array_equal(comm.allgather(x, timeout=timeout), np.stack(every))
    elif op == "reduce_scatter":
        rows = [np.stack([_x(q, i + s) for s in range(P)]) for q in range(P)]
        got = comm.reduce_scatter(rows[me], timeout=timeout)
        np.testing.assert_array_equal(got, np.array_split(sum(rows), P)[me])
    elif op == "alltoall":
        rows = [np.stack([_x(q, i + s) for s in range(P)]) for q in range(P)]
        got = comm.alltoall(rows[me], timeout=timeout)
        np.testing.assert_array_equal(got, np.stack([rows[q][me] for q in range(P)]))
    elif op == "gather":
        got = comm.gather(x, root=root, timeout=timeout)
        if me == root:
            np.testing.assert_array_equal(got, np.stack(every))
    elif op == "scatter":
        blocks = np.stack([_x(root, i + s) for s in range(P)])
        got = comm.scatter(blocks if me == root else None, root=root, timeout=timeout)
        np.testing.assert_array_equal(got, blocks[me])
    elif op == "scan":
        np.testing.assert_array_equal(comm.scan(x, timeout=timeout), sum(every[:me + 1]))
    elif op == "exscan":
        got = comm.exscan(x, timeout=timeout)
        if me > 0:
            np.testing.assert_array_equal(got, sum(every[:me]))
    elif op == "barrier":
        comm.barrier(timeout=timeout)
    elif op == "sendrecv":
        got = comm.sendrecv(x, (me + 1) % P, (me - 1) % P, timeout=timeout)
        np.testing.assert_array_equal(got, every[(me - 1) % P])
    elif op == "shared":
        sx, sy = shared
        sx[:] = x
        comm.allreduce(sx, out=sy, timeout=timeout)
        np.testing.assert_array_equal(sy, sum(every))
    elif op == "split":
        color = (lambda q: q % 2) if i % 2 == 0 else (lambda q: 0)   # (halves, or a dup)
        sub = comm.split(color(me))
        try:
            mine = [q for q in range(P) if color(q) == color(me)]
            np.testing.assert_array_equal(sub.allreduce(x, timeout=timeout),
                                          sum(every[q] for q in mine))
        finally:
            sub.close()
    else:
        raise ValueError(op)


CYCLE = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall", "gather",
         "scatter", "scan", "exscan", "barrier")


def check_collectives(comm, n=CHECKED):
    """n collectives of every kind on comm, each checked against numpy; then a shared-array
    allreduce, messages around the ring and a split.  The number checked."""
    for i in range(n):
        one_op(comm, CYCLE[i % len(CYCLE)], i)
    sx, sy = comm.empty(4), comm.empty(4)
    one_op(comm, "shared", n, shared=(sx, sy))
    one_op(comm, "sendrecv", n + 1)
    one_op(comm, "split", n + 2)
    return n + 3


# ---------------------------------------------------------------------------------------------
# the chaos matrix


def _strike(fault, delay):
    """In the victim: the fault, `delay` seconds from now, from a thread (inside whatever call
    the main thread makes then)."""
    def go():
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            os._exit(3)
    if delay <= 0:
        go()
    threading.Timer(delay, go).start()


def chaos_rank(comm, op, fault, victim, at, delay):
    """Make op (checked) until it fails; the victim strikes itself during its call number at.
    A survivor then shrinks and checks the new communicator.  (error, later error, failed
    ranks, new rank, new size, parent ranks, calls checked, agree, current is new)."""
    P, me = comm.size, comm.rank
    if me == victim and fault == "stop":
        own_process_group()
    timeout = STOP_TIMEOUT_S if fault == "stop" else None
    shared = (comm.empty(4), comm.empty(4)) if op == "shared" else None
    comm.barrier()
    error = None
    for i in range(MAX_OPS):
        if me == victim and i == at:
            _strike(fault, delay)
        # split takes no timeout: against a stopped rank, a watchdog revokes the communicator
        watchdog = threading.Timer(STOP_TIMEOUT_S, comm.revoke) \
            if op == "split" and fault == "stop" else None
        if watchdog is not None:
            watchdog.start()
        try:
            one_op(comm, op, i, timeout, shared)
        except (shmtree.PeerLostError, shmtree.CollectiveTimeoutError) as exc:
            error = type(exc).__name__
            break
        finally:
            if watchdog is not None:
                watchdog.cancel()
    if error is None:
        return ("no error after", MAX_OPS)
    try:
        comm.allreduce(np.ones(1))
        later = "no error"
    except shmtree.PeerLostError as exc:
        later = type(exc).__name__
    pid = comm.group.member(victim)[1]
    new = comm.shrink(timeout=STOP_TIMEOUT_S if fault == "stop" else SHRINK_TIMEOUT_S)
    failed = comm.failed_ranks()
    current = shmtree.current() is new
    checked = check_collectives(new)
    ok = new.agree(True)
    out = (error, later, failed, new.rank, new.size, new.parent_ranks, checked, ok, current)
    new.close()
    if fault == "stop" and new.rank == 0:
        os.kill(pid, signal.SIGKILL)        # (stopped for good: it would never end)
    return out


def chaos_case(op, fault, P, victim, at, delay):
    results = shmtree.run(chaos_rank, P, args=(op, fault, victim, at, delay),
                          on_failure="shrink")
    assert isinstance(results[victim], shmtree.WorkerError), results[victim]
    survivors = [r for r in range(P) if r != victim]
    allowed = {"PeerLostError", "RevokedError"} | (
        {"CollectiveTimeoutError"} if fault == "stop" else set())
    seen = []
    for r in survivors:
        got = results[r]
        assert isinstance(got, tuple) and len(got) == 9, (r, got)
        error, later, failed, nrank, nsize, parents, checked, ok, current = got
        assert error in allowed, (r, got)
        assert later in ("PeerLostError", "RevokedError"), (r, got)
        assert failed == [victim], (r, got)
        assert nsize == P - 1 and nrank == survivors.index(r), (r, got)
        assert list(parents) == survivors, (r, got)
        assert checked == CHECKED + 3 and ok is True and current is True, (r, got)
        seen.append((failed, parents))
    assert all(s == seen[0] for s in seen)


def _cases(long):
    """(op, fault, P, victim, at, delay): every fault x op x P (long), else one per op, the
    fault, P, victim and moment drawn from a fixed seed."""
    rng = random.Random(38)
    if long:
        return [(op, fault, P, rng.randrange(P), rng.randrange(3), rng.choice([0, 0.0005, 0.002]))
                for fault in FAULTS for op in OPS for P in range(2, 9)]
    return [(op, FAULTS[k % 3], 2 + (k * 3) % 7, None, rng.randrange(3),
             rng.choice([0, 0.0005, 0.002])) for k, op in enumerate(OPS)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op,fault,P,victim,at,delay", _cases(False))
def test_chaos(op, fault, P, victim, at, delay):
    victim = (P * 7 + len(op)) % P if victim is None else victim
    chaos_case(op, fault, P, victim, at, delay)


@pytest.mark.long
@pytest.mark.timeout(90)
@pytest.mark.parametrize("op,fault,P,victim,at,delay", _cases(True))
def test_chaos_long(op, fault, P, victim, at, delay):
    chaos_case(op, fault, P, victim, at, delay)


# ---------------------------------------------------------------------------------------------
# agree


def agree_rounds(comm, victim, k, delay, rounds):
    """`rounds` agreements, a flag per rank and round; the victim kills itself `delay` s into
    agreement number k.  Every round's (value, failed ranks)."""
    out = []
    comm.barrier()
    for i in range(rounds):
        if comm.rank == victim and i == k:
            _strike("kill", delay)
        flag = (comm.rank + i) % 5 != 0 or i % 3 != 0
        out.append((comm.agree(flag, timeout=SHRINK_TIMEOUT_S), comm.failed_ranks()))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P,victim", [(2, 0), (3, 0), (4, 2), (5, 1), (8, 0), (8, 7)])
def test_agree_is_the_same_on_every_survivor_while_a_rank_dies(P, victim):
    """The victim (rank 0: the decider) dies during an agreement: every survivor returns the
    same value and failed set in every round, the AND of the flags of the ranks not failed."""
    rng = random.Random(P * 10 + victim)
    for attempt in range(3):
        k, delay = rng.randrange(4), rng.choice([0, 0.0002, 0.001, 0.003])
        results = shmtree.run(agree_rounds, P, args=(victim, k, delay, 40),
                              on_failure="shrink")
        survivors = [r for r in range(P) if r != victim]
        rounds = [results[r] for r in survivors]
        assert all(x == rounds[0] for x in rounds), rounds
        fails = [failed for _, failed in rounds[0]]
        first = fails.index([victim]) if [victim] in fails else len(fails)
        assert first >= k and fails == [[]] * first + [[victim]] * (len(fails) - first), fails
        for i, (value, failed) in enumerate(rounds[0]):
            voters = survivors if failed else range(P)
            assert value == all((r + i) % 5 != 0 or i % 3 != 0 for r in voters), (i, value)


def agree_values(comm):
    return [comm.agree(comm.rank != 1), comm.agree(True), comm.failed_ranks()]


@pytest.mark.timeout(60)
def test_agree_is_an_and_over_the_ranks():
    assert run_ok(agree_values, 3) == [[False, True, []]] * 3


def agree_stopped(comm, victim):
    if comm.rank == victim:
        own_process_group()
        comm.barrier()
        os.kill(os.getpid(), signal.SIGSTOP)
        try:
            comm.agree(True)
            return "agreed"
        except shmtree.PeerLostError as exc:
            return f"left out: {exc}"
    comm.barrier()
    got = comm.agree(True, timeout=0.5)
    failed = comm.failed_ranks()
    if comm.rank == 0:
        os.kill(comm.group.member(victim)[1], signal.SIGCONT)
    return got, failed


@pytest.mark.timeout(60)
def test_agree_leaves_a_stopped_rank_out_after_its_timeout_and_it_learns_it():
    got = run_ok(agree_stopped, 3, args=(2,))
    assert got[0] == got[1] == (True, [2])
    assert got[2].startswith("left out: ") and "declared failed" in got[2], got[2]


# ---------------------------------------------------------------------------------------------
# revoke


def revoke_rank(comm, who, how):
    """`who` revokes (how: "main" - from its main thread; "thread" - from another thread while
    its main thread waits for a message) while the others wait for it in a collective."""
    import shmtree.groups.sentinel as sv
    comm.barrier()
    out = {}
    if comm.rank == who and how == "thread":
        threading.Timer(0.05, comm.revoke).start()
    elif comm.rank == who:
        time.sleep(0.05)
        comm.revoke()
    try:
        if comm.rank == who:
            comm.recv((who + 1) % comm.size, tag=9)     # (never sent: revoked meanwhile)
        else:
            comm.allreduce(np.ones(1 << 16))           # (the others wait for `who` in it)
        out["call"] = "no error"
    except shmtree.RevokedError as exc:
        out["call"] = ("RevokedError", f"rank {who} revoked the communicator" in str(exc))
    t = time.monotonic()
    try:
        comm.broadcast(np.ones(2), root=0)
    except shmtree.RevokedError:
        out["later"] = ("RevokedError", time.monotonic() - t < 5)
    out["revoked"] = comm.is_revoked()
    out["agree"] = (comm.agree(comm.rank != who), comm.failed_ranks())
    out["sentinel"] = [t.name for t in threading.enumerate() if t.name == "shmtree-sentinel"]
    comm.close()
    out["after_close"] = [t.name for t in threading.enumerate() if t.name == "shmtree-sentinel"]
    out["entries"] = 0 if sv._SENTINEL is None else len(sv._SENTINEL.entries)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P,who,how", [(2, 1, "main"), (4, 0, "thread"), (5, 3, "main")])
def test_revoke_reaches_every_waiting_rank(P, who, how):
    for r, got in enumerate(run_ok(revoke_rank, P, args=(who, how))):
        assert got["call"] == ("RevokedError", True), (r, got)
        assert got["later"] == ("RevokedError", True), (r, got)
        assert got["revoked"] is True and got["agree"] == (False, []), (r, got)
        assert got["sentinel"] == ["shmtree-sentinel"], (r, got)
        assert got["after_close"] == [] and got["entries"] == 0, (r, got)


def revoke_p2p(comm):
    comm.barrier()
    if comm.rank == 0:
        time.sleep(0.05)
        comm.revoke()
        return "revoked"
    try:
        comm.recv(0, tag=5)                    # (rank 0 never sends)
        return "no error"
    except shmtree.RevokedError:
        return "RevokedError"


@pytest.mark.timeout(60)
def test_revoke_reaches_a_rank_waiting_for_a_message():
    assert run_ok(revoke_p2p, 2) == ["revoked", "RevokedError"]


def revoke_keeps_subs(comm):
    sub = comm.split(comm.rank % 2)
    comm.barrier()
    if comm.rank == 0:
        comm.revoke()
    comm.agree(True)                          # (after the revocation: every rank has seen it)
    got = sub.allreduce(np.ones(1))[0]
    sub.close()
    return comm.is_revoked(), got


@pytest.mark.timeout(60)
def test_revoke_leaves_sub_communicators_alone():
    assert run_ok(revoke_keeps_subs, 4) == [(True, 2.0)] * 4


# ---------------------------------------------------------------------------------------------
# shrink, sub-communicators made before the failure, memory


def _inode_at(address):
    """The inode of the mapping of this process that holds `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return parts[4]
    return None


def subs_rank(comm, victim):
    """Halves by parity made before the victim dies: the victim's half raises, the other half
    goes on; the shrunk communicator works; the memory of the one shrunk goes with it."""
    comm = comm.shrink()                     # (everyone: a communicator whose close unmaps)
    sub = comm.split(comm.rank % 2)
    comm.barrier()
    if comm.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    if comm.rank % 2 == victim % 2:
        try:
            for i in range(MAX_OPS):
                one_op(sub, "allreduce", i)
            half = "no error"
        except shmtree.PeerLostError:
            half = "PeerLostError"
    else:
        half = check_collectives(sub)
    sub.close()
    try:
        comm.barrier()
    except shmtree.PeerLostError:
        pass
    new = comm.shrink()
    checked = check_collectives(new)
    old = _inode_at(comm._seg.abort_address())
    mapped = old in memfd_mappings()
    comm.close()
    gone = old not in memfd_mappings()
    new.close()
    return half, checked, mapped, gone


@pytest.mark.timeout(90)
def test_sub_communicators_of_the_dead_rank_fail_the_others_go_on():
    got = shmtree.run(subs_rank, 5, args=(2,), on_failure="shrink")
    assert isinstance(got[2], shmtree.WorkerError)
    for r in (0, 4):
        assert got[r] == ("PeerLostError", CHECKED + 3, True, True), (r, got[r])
    for r in (1, 3):
        assert got[r] == (CHECKED + 3, CHECKED + 3, True, True), (r, got[r])


def shrink_healthy(comm):
    new = comm.shrink()
    got = (new.rank, new.size, comm.failed_ranks(), check_collectives(new, 20),
           comm.is_revoked(), shmtree.allreduce(np.ones(1))[0])
    new.close()
    return got


@pytest.mark.timeout(60)
def test_shrink_without_a_failure_is_a_communicator_of_everyone():
    got = run_ok(shrink_healthy, 3)
    assert got == [(r, 3, [], 23, False, 3.0) for r in range(3)]


def twice(comm):
    """Two ranks die one after the other: shrink twice."""
    if comm.rank == 3:
        os._exit(1)
    try:
        comm.barrier()
    except shmtree.PeerLostError:
        pass
    a = comm.shrink()
    if a.rank == 0:
        os._exit(1)                              # (old rank 0)
    try:
        a.barrier()
    except shmtree.PeerLostError:
        pass
    b = a.shrink()
    got = (b.rank, b.size, a.failed_ranks(), check_collectives(b, 30))
    b.close()
    a.close()
    return got


@pytest.mark.timeout(60)
def test_shrink_a_shrunk_communicator():
    got = shmtree.run(twice, 5, on_failure="shrink")
    assert [type(g).__name__ for g in (got[0], got[3])] == ["WorkerError"] * 2
    assert [got[1], got[2], got[4]] == [(r, 3, [0], 33) for r in range(3)]


def shrink_refuses(comm):
    comm.close()
    try:
        comm.shrink()
    except shmtree.ShmtreeError as exc:
        return str(exc)


@pytest.mark.timeout(60)
def test_shrink_of_a_closed_communicator_is_refused():
    assert run_ok(shrink_refuses, 2) == ["shmtree: this communicator is closed"] * 2


# ---------------------------------------------------------------------------------------------
# pools that heal


def _pool_init(marker):
    global _INITIALIZED
    _INITIALIZED = (os.getpid(), marker)


def _pool_task(i, victim_task, flag):
    if i == victim_task and not os.path.exists(flag):
        open(flag, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return i * i, shmtree.size()


def _pool_collective(i):
    return float(shmtree.allreduce(np.ones(2) * (shmtree.rank() + 1))[0]), shmtree.size()


def _pool_check(comm):
    return check_collectives(comm, 30), _INITIALIZED[0] == os.getpid(), _INITIALIZED[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["shrink", "respawn"])
def test_pool_loses_a_worker_during_map_and_goes_on(tmp_path, mode):
    P, n, victim_task = 4, 24, 5
    flag = str(tmp_path / "killed")
    with shmtree.Pool(P, on_failure=mode, initializer=_pool_init, initargs=("ok",)) as pool:
        got = []
        it = pool.imap(_pool_task_star, [(i, victim_task, flag) for i in range(n)])
        for i in range(n):
            try:
                got.append(next(it))
            except shmtree.PeerLostError as exc:
                got.append(exc)
        want = P - 1 if mode == "shrink" else P
        failed = [i for i, g in enumerate(got) if isinstance(g, Exception)]
        assert failed == [victim_task], got
        assert "rank " in str(got[victim_task]) and " died " in str(got[victim_task])
        assert f"on_failure={mode!r}" in str(got[victim_task])
        for i, g in enumerate(got):
            if i != victim_task:
                assert g[0] == i * i, (i, g)
        assert pool.group.size == want
        # the tasks given now run in the new group, on every worker
        nonce = pool.group._nonce.hex()
        assert pool.map(_pool_nonce, range(3 * want)) == [(nonce, want)] * (3 * want)
        # the healed pool: SPMD and per-task collectives are right
        assert pool.run(_pool_check) == [(33, True, "ok")] * want
        tri = want * (want + 1) / 2
        assert pool.map(_pool_collective, range(2 * want)) == [(tri, want)] * (2 * want)


def _pool_nonce(i):
    time.sleep(0.005)
    return shmtree.current().group._nonce.hex(), shmtree.size()


def _pool_task_star(args):
    return _pool_task(*args)


def _pool_round(i, flag):
    """A round of collectives, one task per worker: one kills itself in the first round."""
    if i == 1 and not os.path.exists(flag):
        open(flag, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return float(shmtree.allreduce(np.ones(1))[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["shrink", "respawn"])
def test_pool_loses_a_worker_inside_a_collective(tmp_path, mode):
    """The round the worker dies in fails with PeerLostError; the next rounds run in the new
    group (of P - 1, or P again)."""
    P = 3
    flag = str(tmp_path / "killed")
    with shmtree.Pool(P, on_failure=mode) as pool:
        with pytest.raises(shmtree.PeerLostError, match="died"):
            pool.starmap(_pool_round, [(i, flag) for i in range(P)])
        want = P - 1 if mode == "shrink" else P
        deadline = time.monotonic() + 30
        while pool.group.size != want and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(3):
            assert pool.starmap(_pool_round, [(i, flag) for i in range(want)]) == \
                [float(want)] * want


@pytest.mark.timeout(60)
def test_pool_on_failure_is_checked():
    with pytest.raises(ValueError, match="on_failure"):
        shmtree.Pool(2, on_failure="heal")
    with pytest.raises(ValueError, match="on_failure"):
        shmtree.run(agree_values, 2, on_failure="respawn")


# ---------------------------------------------------------------------------------------------
# the sentinel


def _member(group, rank, how, q):
    comm = group.join(rank)
    comm.barrier()
    if rank == 1:
        if how == "close":
            comm.close()
        os._exit(0)
    time.sleep(0.3)                       # (rank 1 is gone, between calls)
    q.put(group.aborted())
    comm.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["close", "die"])
def test_a_member_gone_between_calls_aborts_nothing_by_itself(how):
    """The sentinel aborts a group only while a member waits in a call the dead one has not
    completed (a member that closed first is no loss at all)."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    with shmtree.Group(2) as group:
        procs = [ctx.Process(target=_member, args=(group, r, how, q)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            assert q.get(timeout=30) is False
        finally:
            for p in procs:
                p.join(10)


def _killed_member(group, rank, q):
    comm = group.join(rank)
    comm.barrier()
    if rank == 1:
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.barrier()
        q.put("no error")
    except shmtree.PeerLostError as exc:
        q.put(str(exc))
    comm.close()


@pytest.mark.timeout(60)
def test_the_sentinel_aborts_when_a_waited_for_member_dies(monkeypatch):
    """With the engine's time slices made long (no liveness check of the ranks' own for 30 s),
    rank 0 still raises at once: the sentinel saw rank 1's pidfd."""
    import multiprocessing
    import shmtree.communicators.communicator as communicator
    monkeypatch.setattr(communicator, "SLICE_NS", int(30e9))
    monkeypatch.setattr(communicator, "STALL_SLICE_S", 30.0)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    with shmtree.Group(2) as group:
        procs = [ctx.Process(target=_killed_member, args=(group, r, q)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            t = time.monotonic()
            got = q.get(timeout=20)
            assert "rank 1 died" in got and time.monotonic() - t < 20, got
        finally:
            for p in procs:
                p.join(10)


# ---------------------------------------------------------------------------------------------
# across nodes (MPI), torch


def _mpiexec():
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else None


MPI_PROG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_survive_prog.py")


@pytest.mark.timeout(180)
def test_across_nodes_shrink_is_refused_and_revoke_reaches_every_node():
    pytest.importorskip("mpi4py")
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec beside the interpreter (pip install mpich)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(shmtree.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (root, os.environ.get("PYTHONPATH")) if p]))
    proc = subprocess.Popen([mpiexec, "-n", "4", sys.executable, MPI_PROG], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mpiexec hung:\n{out.decode(errors='replace')[-3000:]}")
    text = out.decode(errors="replace")
    assert proc.returncode == 0 and "OK survive" in text, text[-3000:]


def torch_rank(rank, size, store, outdir):
    import torch
    import torch.distributed as dist

    import shmtree.torch as st
    dist.init_process_group("shmtree", store=dist.FileStore(store, size), rank=rank,
                            world_size=size)
    pg = dist.group.WORLD
    got = {"healthy": str(pg.get_error())}
    t = torch.ones(3)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(1)
    try:
        dist.all_reduce(t)
        got["error"] = "no error"
    except RuntimeError as exc:
        got["error"] = "rank 1 died" in str(exc)
    got["state"] = str(pg.get_error())
    new = st.shrink_group()
    t = torch.ones(3) * (rank + 1)
    dist.all_reduce(t, group=new)
    got["new"] = (dist.get_rank(new), new.size(), t.tolist())
    # abort: a rank blocked in an operation of the new group is released at once
    if dist.get_rank(new) == 0:
        time.sleep(0.2)
        new.abort()
    else:
        try:
            dist.all_reduce(torch.ones(2), group=new)
            got["aborted"] = "no error"
        except RuntimeError as exc:
            got["aborted"] = "revoked" in str(exc)
        got["aborted_state"] = str(new.get_error())
    torch.save(got, os.path.join(outdir, f"{rank}.pt"))
    os._exit(0)


@pytest.mark.timeout(180)
def test_torch_abort_error_state_and_shrink_group(tmp_path):
    torch = pytest.importorskip("torch")
    mp = pytest.importorskip("torch.multiprocessing")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=torch_rank, args=(r, 3, str(tmp_path / "store"),
                                                  str(tmp_path))) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
        if p.exitcode is None:
            p.kill()
            p.join()
    got = {r: torch.load(tmp_path / f"{r}.pt") for r in (0, 2)}
    for r in (0, 2):
        assert got[r]["healthy"] == "ErrorType.SUCCESS"
        assert got[r]["error"] is True and got[r]["state"] == "ErrorType.REMOTE_ERROR", got[r]
    assert got[0]["new"] == (0, 2, [4.0] * 3) and got[2]["new"] == (1, 2, [4.0] * 3)
    assert got[2]["aborted"] is True and got[2]["aborted_state"] == "ErrorType.REMOTE_ERROR"


# ---------------------------------------------------------------------------------------------
# shmtree-bench survive


@pytest.mark.timeout(180)
def test_bench_survive_prints_its_figures(capsys):
    from shmtree.bench.cli import main
    assert main(["survive", "-n", "3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    import re
    for what in ("detect (SIGKILL", "revoke (call", "agree over the survivors",
                 "shrink 3 -> 2 (last in", "shrink 3 -> 2 (slowest", "Pool respawn", "Pool shrink"):
        rows = [line for line in out.splitlines() if what in line]
        assert len(rows) == 1, (what, out)
        cells = re.split(r"\s{2,}", rows[0].strip())
        assert float(cells[1]) > 0 and float(cells[2]) >= float(cells[1]), (what, rows[0])
