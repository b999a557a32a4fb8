"""Sub-communicators (issue 24; DESIGN section 12, first half): comm.split(color, key), dup(),
split_by(level), and their lifetime.

Worker functions are module-level so that they pickle for spawn and forkserver.  Every
multi-process test has a timeout; the autouse fixture of conftest.py checks that nothing is left
behind (processes, /dev/shm, memfd descriptors and mappings, the test process's CPU mask).
SHMTREE_SPLIT_LOOPS=1000 makes the leak loop run 1000 splits (200 by default).
"""
import gc
import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import psutil
import pytest

import shmtree
from procutil import error_name, run_ok, stop_processes

DETECT_S = 5.0                  # a member's death -> the others' PeerLostError
LOOPS = int(os.environ.get("SHMTREE_SPLIT_LOOPS", "200"))


def expected_groups(P, colors, keys):
    """{color: parent ranks in their new order} for a split of P ranks."""
    groups = {}
    for r in range(P):
        if colors[r] is not None:
            groups.setdefault(colors[r], []).append(r)
    for c in groups:
        groups[c].sort(key=lambda r: (r if keys[r] is None else keys[r], r))
    return groups


# every (colors, keys) pattern, as functions of (rank, P)
PATTERNS = {
    "one color": (lambda r, P: 0, lambda r, P: None),
    "even and odd": (lambda r, P: r % 2, lambda r, P: None),
    "halves, reversed": (lambda r, P: r // ((P + 1) // 2), lambda r, P: -r),
    "each its own": (lambda r, P: r, lambda r, P: None),
    "rank 0 out": (lambda r, P: None if r == 0 else 7, lambda r, P: None),
    "only rank 1": (lambda r, P: 3 if r == 1 else None, lambda r, P: 0),
    "nobody": (lambda r, P: None, lambda r, P: None),
    "equal keys": (lambda r, P: (1 << 40) + r % 2, lambda r, P: 5),
    "numpy ints": (lambda r, P: np.int16(r // 2), lambda r, P: np.int64(P - r)),
    "keys mixed": (lambda r, P: 0, lambda r, P: [3, -1, 3, 0, -7][r % 5]),
}


# ---------------------------------------------------------------------------------------------
# the plan of a sub-communicator (pure data)


def test_sub_plan_lies_on_the_members_slots():
    from shmtree.machine.plan import plan_group
    from shmtree.communicators.subcomm import sub_plan
    parent = plan_group(4, topology="2x2", ncpus=4)       # sockets {0, 1} and {2, 3}
    across = sub_plan(parent, [2, 0])                      # one rank on each socket
    assert across.size == 2 and across.topology.nsockets == 2
    assert across.small_tree.kind == "topology" and across.pin is False
    assert [s.socket for s in across.topology.placement(2)] == [1, 0]
    within = sub_plan(parent, [3, 2])
    assert within.topology.nsockets == 1
    assert sub_plan(parent, [2, 0]).digest() == across.digest()        # every member alike
    assert within.digest() != across.digest()


def test_sub_plan_takes_its_own_sizes_defaults_unless_the_parent_was_given_values():
    from shmtree.machine.plan import DEFAULT_SMALL_BYTES, OVERSUBSCRIBED_SMALL_BYTES, plan_group
    from shmtree.communicators.subcomm import sub_plan
    over = plan_group(4, topology="4", ncpus=2)           # 4 ranks on 2 cores: no spinning
    assert over.spin_ns == 0 and over.small_bytes == OVERSUBSCRIBED_SMALL_BYTES
    two = sub_plan(over, [0, 1])                          # 2 ranks fit: a group of 2's defaults
    assert two.spin_ns == 20_000 and two.small_bytes == DEFAULT_SMALL_BYTES
    assert sub_plan(over, [0, 1, 2]).spin_ns == 0         # 3 do not
    given = plan_group(4, topology="4", ncpus=2, spin_us=5, small_bytes=100, chunk_bytes=4096)
    sub = sub_plan(given, [0, 1])
    assert (sub.spin_ns, sub.small_bytes, sub.chunk_bytes) == (5000, 100, 4096)


def patterns_worker(comm):
    seen = {}
    for name, (color_of, key_of) in PATTERNS.items():
        sub = comm.split(color_of(comm.rank, comm.size), key=key_of(comm.rank, comm.size))
        if sub is None:
            seen[name] = None
            continue
        with sub:
            order = sub.allgather(np.array(comm.rank)).tolist()
            total = int(sub.allreduce(np.array([comm.rank]))[0])
            root = sub.size - 1
            b = sub.broadcast(np.array([comm.rank]) if sub.rank == root else None, root=root)
            seen[name] = dict(rank=sub.rank, size=sub.size, order=order, total=total,
                              bcast=int(b[0]), parent_ranks=list(sub.parent_ranks))
        assert sub._closed
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [5, 1])
def test_every_color_and_key_pattern(P):
    results = run_ok(patterns_worker, P)
    for name, (color_of, key_of) in PATTERNS.items():
        colors = [color_of(r, P) for r in range(P)]
        keys = [key_of(r, P) for r in range(P)]
        groups = expected_groups(P, colors, keys)
        for r in range(P):
            got = results[r][name]
            if colors[r] is None:
                assert got is None, (name, r)
                continue
            members = groups[colors[r]]
            assert got == dict(rank=members.index(r), size=len(members), order=members,
                               total=sum(members), bcast=members[-1],
                               parent_ranks=members), (name, r)


def local_errors_worker(comm):
    out = []
    for color, key in ((-1, None), ("a", None), (True, None), (1.5, None), (1 << 63, None),
                       (0, "x"), (0, 1.0), (0, 1 << 64)):
        try:
            comm.split(color, key)
            out.append("returned")
        except ValueError as exc:
            out.append(f"ValueError: {'color' if 'color' in str(exc) else 'key'}")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    try:
        comm.split_by("rack")
    except ValueError as exc:
        out.append(f"ValueError: {exc}")
    with comm.dup() as d:                 # nothing was communicated: the group is in step
        out.append(int(d.allreduce(np.array([1]))[0]))
    return out


@pytest.mark.timeout(60)
def test_bad_color_key_or_level_raise_locally_and_leave_the_group_usable():
    for out in run_ok(local_errors_worker, 3):
        assert out[:8] == ["ValueError: color"] * 5 + ["ValueError: key"] * 3
        assert out[8].startswith("ValueError: shmtree: split_by's level must be one of")
        assert out[9] == 3


def split_by_worker(comm):
    out = {}
    for level in ("socket", "numa", "l3", "node"):
        with comm.split_by(level) as sub:
            out[level] = (sub.allgather(np.array(comm.rank)).tolist(),
                          sub.group.plan.topology.nsockets, sub.group.plan.topology.nnodes,
                          sub.group.plan.large_tree.kind)
    with comm.dup() as d:
        out["dup"] = (d.rank, d.size, d.allgather(np.array(comm.rank)).tolist())
    return out


@pytest.mark.timeout(90)
def test_split_by_levels_of_the_machine_and_dup():
    """topology "2x2x1": 2 sockets of 2 NUMA nodes of 1 core (one L3 per node)."""
    results = run_ok(split_by_worker, 4, topology="2x2x1")
    for r, out in enumerate(results):
        half = [0, 1] if r < 2 else [2, 3]
        assert out["socket"] == (half, 1, 2, "topology")       # one socket, two nodes
        assert out["numa"][0] == [r] and out["l3"][0] == [r]
        assert out["node"] == ([0, 1, 2, 3], 2, 4, "topology")  # the whole (one) machine
        assert out["dup"] == (r, 4, [0, 1, 2, 3])


def nested_worker(comm):
    half = comm.split(comm.rank // 2)                    # {0,1} {2,3}
    quarter = half.split(half.rank)                      # each alone
    pair = half.split(0, key=-half.rank)                 # the half, reversed
    across = comm.split(comm.rank % 2)                   # {0,2} {1,3}
    x = np.arange(1000.0) + comm.rank
    got = [float(half.allreduce(x)[0]), float(quarter.allreduce(x)[0]),
           float(pair.allreduce(x, op="max")[0]), float(across.allreduce(x)[0]),
           float(comm.allreduce(x)[0])]
    inner = pair.split(0)                                # a split of a split of a split
    got.append((inner.rank, float(inner.allreduce(x)[0])))
    quarter.close()
    pair.close()
    got.append(float(half.allreduce(x)[0]))              # closing children leaves it working
    # closing, even aborting, the parent closes none of its sub-communicators
    comm.barrier()
    if comm.rank == 0:
        comm.group.abort()
    try:
        comm.barrier()
        got.append("parent barrier returned")
    except shmtree.PeerLostError:
        got.append("parent aborted")
    comm.close()
    got.append(float(half.allreduce(x)[0]))
    got.append(float(inner.allreduce(x)[0]))
    got.append(float(across.allreduce(x)[0]))
    for c in (half, inner, across):
        c.close()
    return got


@pytest.mark.timeout(90)
def test_nested_splits_and_parents_closed_or_aborted_first():
    for r, got in enumerate(run_ok(nested_worker, 4)):
        mates = [r - r % 2, r - r % 2 + 1]
        h = float(sum(mates))
        a = float(r % 2 + r % 2 + 2)
        assert got[:5] == [h, r, max(mates), a, 6.0]
        assert got[5] == (1 - r % 2, h)
        assert got[6] == h
        assert got[7] == "parent aborted"
        assert got[8:] == [h, h, a]


def concurrent_worker(comm, n):
    row = comm.split(comm.rank // 2)
    col = comm.split(comm.rank % 2)
    x = np.arange(n, dtype=np.float64) * (comm.rank + 1)
    reqs = []
    for i in range(4):
        reqs.append(row.iallreduce(x))
        reqs.append(comm.iallreduce(x, op="max"))
        reqs.append(col.iallgather(np.array([comm.rank, i])))
        reqs.append(row.ibroadcast(x if row.rank == 0 else None))
    blocking = [float(col.allreduce(x)[-1]), float(comm.allreduce(x)[-1])]
    got = shmtree.wait_all(reqs, timeout=60)
    for c in (row, col):
        c.close()
    last = n - 1
    return blocking, [float(g[-1]) if g.ndim == 1 else g.tolist() for g in got], last


@pytest.mark.timeout(120)
def test_concurrent_collectives_on_disjoint_subs_interleaved_with_the_parent():
    n = 300_000                           # 2.4 MB: many chunks on the bandwidth channel
    for r, (blocking, got, last) in enumerate(run_ok(concurrent_worker, 4, args=(n,))):
        row = [r - r % 2, r - r % 2 + 1]
        col = [r % 2, r % 2 + 2]
        assert blocking == [last * sum(c + 1 for c in col), last * 10]
        for i in range(4):
            assert got[4 * i] == last * sum(c + 1 for c in row)
            assert got[4 * i + 1] == last * 4
            assert got[4 * i + 2] == [[c, i] for c in col]
            assert got[4 * i + 3] == last * (row[0] + 1)


def behind_worker(comm):
    x = np.ones(200_000)
    reqs = [comm.iallreduce(x), comm.iallgather(np.array(comm.rank))]     # outstanding
    sub = comm.split(comm.rank % 2)          # runs behind them, in issue order
    got = [float(reqs[0].wait(30)[0]), reqs[1].wait(30).tolist(),
           sub.allgather(np.array(comm.rank)).tolist()]
    sub.close()
    return got


@pytest.mark.timeout(60)
def test_split_behind_outstanding_nonblocking_calls_of_the_parent():
    """(The split's agreement then goes through the parsed path: a 0-d allgather there raised
    ValueError once.)"""
    for r, got in enumerate(run_ok(behind_worker, 3)):
        assert got == [3.0, [0, 1, 2], [0, 2] if r % 2 == 0 else [1]]


def shared_worker(comm):
    sub = comm.split(comm.rank % 2)
    a = sub.zeros((1000 + comm.rank % 2,))  # (a collective of the sub's members only)
    a[:] = comm.rank + 1
    sub.allreduce(a, out=a)
    b = sub.empty((3, 5), dtype=np.int32, order="F")
    b[...] = comm.rank
    g = sub.allgather(b)
    p = comm.zeros(64)                       # the parent's shared array, in a sub's call
    p[:] = comm.rank
    s = sub.allreduce(p)
    out = (float(a[0]), float(a[-1]), g[:, 0, 0].tolist(), float(s[0]))
    sub.close()
    out += (float(a[5]),)                    # still valid memory after the close
    return out


@pytest.mark.timeout(90)
def test_shared_arrays_on_sub_communicators():
    for r, out in enumerate(run_ok(shared_worker, 4)):
        mates = [r % 2, r % 2 + 2]
        assert out == (sum(m + 1 for m in mates),) * 2 + (mates, float(sum(mates)),
                                                         float(sum(m + 1 for m in mates)))


def close_worker(comm):
    sub = comm.split(0)
    sub.barrier()
    if sub.rank == 0:                      # the leader, whose process made the segment
        sub.close()
        comm.barrier()
        return "closed"
    comm.barrier()
    try:
        sub.barrier(timeout=20)
        return "returned"
    except shmtree.ShmtreeError as exc:
        return error_name(exc), "left the group" in str(exc)
    finally:
        sub.close()


@pytest.mark.timeout(60)
def test_closing_a_sub_is_local_even_for_its_leader():
    """The others' next call fails because a member left (not because the group was closed
    for everyone), as in a group of its own."""
    got = run_ok(close_worker, 3)
    assert got[0] == "closed" and all(g[1] and g[0] in ("ShmtreeError", "PeerLostError")
                                      for g in got[1:]), got


# ---------------------------------------------------------------------------------------------
# where the parent came from: Pool, Group.join under every start method


def pool_spmd(comm):
    sub = comm.split(comm.rank // 2)
    got = int(sub.allreduce(np.array([comm.rank]))[0])
    # module-level calls keep using the pool's communicator
    cur = shmtree.current() is comm and shmtree.size() == 4 and shmtree.rank() == comm.rank
    total = int(shmtree.allreduce(np.array([1]))[0])
    sub.close()
    return got, cur, total


def pool_task(i):
    with shmtree.current().split(shmtree.rank() % 2) as sub:
        return sub.rank, int(sub.allreduce(np.array([shmtree.rank()]))[0]), shmtree.size()


@pytest.mark.timeout(120)
def test_split_in_pool_workers():
    with shmtree.Pool(4) as pool:
        for r, (got, cur, total) in enumerate(pool.run(pool_spmd)):
            assert (got, cur, total) == (1 if r < 2 else 5, True, 4)
        results = pool.map(pool_task, range(4))
    assert sorted(results) == [(0, 2, 4), (0, 4, 4), (1, 2, 4), (1, 4, 4)]


def stall_task(nested):
    sub = shmtree.current().split(0)
    if nested:                            # (a split of a split: the pool's states still count)
        outer, sub = sub, sub.split(0)
        outer.close()
    if shmtree.rank() != 0:
        return "idle"                     # (its sub is dropped unclosed: never left it)
    t = time.monotonic()
    try:
        sub.allreduce(np.ones(2))
        return "returned"
    except shmtree.ShmtreeError as exc:
        return error_name(exc), "idle" in str(exc), time.monotonic() - t
    finally:
        sub.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("nested", [False, True])
def test_a_sub_collective_that_a_pool_task_never_makes_fails_by_the_stall_timeout(nested):
    with shmtree.Pool(2, stall_timeout=1.0) as pool:
        got = pool.map(stall_task, [nested] * 2)
        again = pool.map(pool_task, range(2))        # the pool's own group is untouched
    assert sorted(got, key=str)[0][:2] == ("ShmtreeError", True), got
    assert 1.0 <= sorted(got, key=str)[0][2] < 10, got
    assert "idle" in got
    assert sorted(again) == [(0, 0, 2), (0, 1, 2)]


def join_member(group, rank, queue):
    try:
        with group.join(rank) as comm:
            sub = comm.split(0 if rank > 0 else None)
            row = comm.dup()
            got = [sub is None, row.rank, int(row.allreduce(np.array([rank]))[0])]
            if sub is not None:
                got.append(int(sub.allreduce(np.array([rank]))[0]))
                sub.close()
            row.close()
            queue.put((rank, got))
    except BaseException as exc:
        queue.put((rank, f"{type(exc).__name__}: {exc}"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_split_after_group_join(method):
    P = 3
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    procs = []
    try:
        with shmtree.Group(P) as group:
            for r in range(P):
                p = ctx.Process(target=join_member, args=(group, r, queue))
                p.start()
                procs.append(p)
            got = dict(queue.get(timeout=90) for _ in range(P))
            for p in procs:
                p.join(30)
    finally:
        stop_processes(procs)
        queue.close()
        queue.join_thread()
    assert got == {0: [True, 0, 3], 1: [False, 1, 3, 3], 2: [False, 2, 3, 3]}


# ---------------------------------------------------------------------------------------------
# a member's death


def death_member(group, rank, queue, survivors):
    """Ranks 0-3: halves A={0,1}, B={2,3}, and C={0,2}; rank 1 dies (SIGKILL) once every
    communicator has made one call."""
    report = {}
    try:
        comm = group.join(rank)
        half = comm.split(rank // 2)
        c = comm.split(0 if rank in (0, 2) else None)
        half.barrier()
        comm.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x = np.ones(10)
        if rank == 0:
            t = time.monotonic()
            try:
                half.allreduce(x)
                report["half"] = "returned"
            except Exception as exc:
                report["half"] = error_name(exc)
            report["half_s"] = time.monotonic() - t
        if rank in (2, 3):
            report["half"] = [float(half.allreduce(x)[0]) for _ in range(20)]
        if rank in (0, 2):
            report["c"] = [float(c.allreduce(x)[0]) for _ in range(20)]
        t = time.monotonic()
        try:
            comm.allreduce(x)
            report["parent"] = "returned"
        except Exception as exc:
            report["parent"] = error_name(exc)
            report["parent_text"] = str(exc)
        report["parent_s"] = time.monotonic() - t
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    queue.put((rank, report))
    survivors.wait(60)                    # (none leaves before every survivor has seen it)


@pytest.mark.timeout(120)
def test_death_of_a_member_fails_its_communicators_only():
    P = 4
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    survivors = ctx.Event()
    procs = []
    try:
        with shmtree.Group(P) as group:
            for r in range(P):
                p = ctx.Process(target=death_member, args=(group, r, queue, survivors))
                p.start()
                procs.append(p)
            got = dict(queue.get(timeout=90) for _ in range(P - 1))
            survivors.set()
            for p in procs:
                p.join(30)
    finally:
        stop_processes(procs)
        queue.close()
        queue.join_thread()
    assert procs[1].exitcode == -signal.SIGKILL
    assert got[0]["half"] == "PeerLostError" and got[0]["half_s"] < DETECT_S, got[0]
    for r in (2, 3):
        assert got[r]["half"] == [2.0] * 20, got[r]
    for r in (0, 2):
        assert got[r]["c"] == [2.0] * 20, got[r]
    for r in (0, 2, 3):
        assert got[r]["parent"] == "PeerLostError" and got[r]["parent_s"] < DETECT_S, (r, got[r])


# ---------------------------------------------------------------------------------------------
# mismatched calls


def mismatch_worker(comm, other):
    out = []
    try:
        if comm.rank == 0:
            comm.split(0)
        elif other == "allreduce":
            comm.allreduce(np.ones(3))
        elif other == "allgather":
            comm.allgather(np.ones(2, np.int64))
        else:
            comm.split_by("node")          # the same call: no mismatch
        out.append("returned")
    except shmtree.CollectiveMismatchError as exc:
        out.append(("mismatch", "split" in str(exc) or comm.rank != 0))
    with comm.split(comm.rank % 2) as sub:  # in step, and the group usable
        out.append(int(sub.allreduce(np.array([comm.rank]))[0]))
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("other", ["allreduce", "allgather"])
def test_split_against_another_collective_is_a_mismatch_on_every_rank(other):
    results = run_ok(mismatch_worker, 3, args=(other,))
    assert results == [[("mismatch", True), 2], [("mismatch", True), 1],
                       [("mismatch", True), 2]]


def interrupted_split_worker(comm):
    """Rank 1 never makes the split: its peers wait in it until rank 1 leaves (returns)."""
    if comm.rank == 1:
        time.sleep(0.3)
        return "left"
    try:
        comm.split(0)
        return "returned"
    except shmtree.ShmtreeError as exc:
        return error_name(exc)


@pytest.mark.timeout(60)
def test_a_rank_that_never_splits_fails_the_others():
    got = run_ok(interrupted_split_worker, 3)
    assert got[1] == "left" and {got[0], got[2]} <= {"ShmtreeError", "PeerLostError"}, got


def interrupt_worker(comm):
    """Rank 1 is interrupted between two rounds of the split (as it attaches): the others,
    waiting for it in the next round, fail at once instead of waiting for ever."""
    from shmtree.communicators import subcomm
    if comm.rank == 1:
        def attach(*args):
            raise KeyboardInterrupt
        subcomm.SubGroup.attach = attach
    t = time.monotonic()
    try:
        comm.split(0)
        return "returned"
    except KeyboardInterrupt:
        return "KeyboardInterrupt", comm.group.aborted()
    except shmtree.ShmtreeError as exc:
        return error_name(exc), "interrupted inside split" in str(exc), time.monotonic() - t < 5


@pytest.mark.timeout(60)
def test_an_interrupt_between_the_rounds_aborts_the_parent():
    got = run_ok(interrupt_worker, 3)
    assert got == [("PeerLostError", True, True), ("KeyboardInterrupt", True),
                   ("PeerLostError", True, True)], got


# ---------------------------------------------------------------------------------------------
# lifetime: pinning, leaks


def _masks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
        except OSError:
            pass
    return out


def pin_worker(comm):
    pinned = frozenset(os.sched_getaffinity(0))
    sub = comm.split(0)
    sub.ibarrier().wait(30)               # (its progress thread starts on this core)
    sub.close()
    after_sub = frozenset(os.sched_getaffinity(0))
    keep = comm.dup()
    keep.iallreduce(np.ones(3)).wait(30)
    threads = len(_masks())
    comm.close()                          # the parent's close restores every thread it pinned
    masks = set(_masks().values())
    works = float(keep.allreduce(np.ones(1))[0])
    keep.close()
    return sorted(pinned), sorted(after_sub), [sorted(m) for m in masks], threads, works


@pytest.mark.timeout(60)
def test_a_sub_never_unpins_and_the_parents_close_unpins_its_threads():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two usable cores")
    original = sorted(os.sched_getaffinity(0))
    results = run_ok(pin_worker, 2, pin=True)
    assert {tuple(r[0]) for r in results} == {(c,) for c in original[:2]}
    for pinned, after_sub, masks, threads, works in results:
        assert len(pinned) == 1 and after_sub == pinned       # the sub's close kept the pin
        assert threads >= 3                                   # main + two progress threads
        assert masks == [original]                            # nobody left on the pinned core
        assert works == 2.0


def _memfd_fds():
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:")
        except OSError:
            pass
    return n


def _memfd_maps():
    with open("/proc/self/maps") as f:
        return len({line.split()[4] for line in f if "/memfd:" in line})


def _fd_count():
    """(The least of a few listings: the worker's parent watch opens a file now and then.)"""
    counts = []
    for _ in range(5):
        counts.append(len(os.listdir("/proc/self/fd")))
        time.sleep(0.01)
    return min(counts)


def _state():
    me = psutil.Process()
    return dict(fds=_fd_count(), memfds=_memfd_fds(),
                maps=_memfd_maps(), threads=threading.active_count(),
                tasks=len(os.listdir("/proc/self/task")), rss=me.memory_info().rss)


def leak_worker(comm, loops):
    def once(i):
        sub = comm.split(i % 2 if i % 3 else 0)
        if i % 5 == 0:
            sub.iallreduce(np.ones(4)).wait(30)     # (a progress thread, stopped by close)
        else:
            sub.allreduce(np.ones(4))
        sub.close()
    for i in range(30):
        once(i)
    open_sub = comm.dup()
    while_open = _state()                 # every member attached: no descriptor of it left
    open_sub.close()
    before = _state()
    t = time.monotonic()
    for i in range(loops):
        once(i)
    per_split = (time.monotonic() - t) / loops
    import gc
    gc.collect()
    return while_open, before, _state(), per_split


@pytest.mark.timeout(600)
def test_split_and_close_in_a_loop_leaves_nothing_behind():
    baseline = _memfd_fds()
    for while_open, before, after, per_split in run_ok(leak_worker, 4, args=(LOOPS,)):
        assert while_open["memfds"] == before["memfds"], (while_open, before)
        assert while_open["maps"] == before["maps"] + 1, (while_open, before)
        for what in ("fds", "memfds", "maps", "threads", "tasks"):
            assert after[what] == before[what], (what, before, after)
        assert after["rss"] - before["rss"] < 8 << 20, (before, after)
        assert per_split < 0.25
    assert _memfd_fds() == baseline


# ---------------------------------------------------------------------------------------------
# descriptors: every split's go with it (issue 34, item 3)

FD_CYCLES, FD_FROM = 300, 50    # split+close cycles, and the cycle the count is compared with
FD_SLACK = 4                    # growth allowed from cycle FD_FROM to the last
WAIT_EVERY, WAIT_S = 15, 0.06   # rank 1 comes late to the sub's allreduce every WAIT_EVERY-th
                                # cycle: rank 0 waits past a time slice (20 ms), and its
                                # liveness check of rank 1 opens a pidfd in the sub's group


def _fd_kinds():
    """{kind of descriptor: how many} of this process ("memfd:shmtree-p2p", "anon_inode:[pidfd]",
    "pipe" ...)."""
    kinds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            t = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        k = t.split("[")[0] if not t.startswith("/memfd:") else t[:len("/memfd:shmtree-p2p")]
        k = "anon_inode:" + t.split(":", 1)[1] if t.startswith("anon_inode:") else k
        kinds[k] = kinds.get(k, 0) + 1
    return kinds


def _one_cycle(comm, i, close):
    """A split, used (a late peer now and then, messages both ways, a shared array), then
    closed, or dropped without close() (close=False: collected)."""
    sub = comm.split(0)
    if comm.rank == 1 and i % WAIT_EVERY == 0:
        time.sleep(WAIT_S)
    sub.allreduce(np.ones(4))
    peer = 1 - sub.rank
    got = sub.sendrecv(np.full(3, sub.rank, np.float64), peer, source=peer)
    assert int(got[0]) == peer
    if i % 7 == 0:
        a = sub.zeros(1024)
        a[:] = 1
        sub.allreduce(a, out=a)
        del a
    sub.barrier()                   # (every message read before either drops its channels)
    if close:
        sub.close()
    else:
        del sub
        gc.collect()


def fd_worker(comm, cycles, close):
    counts = {}
    for i in range(1, cycles + 1):
        _one_cycle(comm, i, close)
        if i in (FD_FROM, cycles):
            n, kinds = _fd_count(), _fd_kinds()     # (closed by close() itself: no gc here)
            gc.collect()          # (a closed Transport's mappings of its peers' homes go with
            counts[i] = (n, _memfd_maps(), kinds)   # its objects, in reference cycles)
    works = float(comm.allreduce(np.ones(2))[0])
    return counts, works


def _check_bounded(outs, cycles):
    for rank, (counts, works) in enumerate(outs):
        (n0, maps0, kinds0), (n1, maps1, kinds1) = counts[FD_FROM], counts[cycles]
        grown = {k: v - kinds0.get(k, 0) for k, v in kinds1.items() if v != kinds0.get(k, 0)}
        assert n1 - n0 <= FD_SLACK, (f"rank {rank}: {n0} descriptors after split {FD_FROM}, "
                                     f"{n1} after split {cycles}; grown: {grown}")
        assert maps1 == maps0, (rank, maps0, maps1)
        assert works == 2.0


@pytest.mark.timeout(120)
def test_split_and_close_leave_no_descriptor_behind():
    """300 split+close cycles at P=2, with what makes a split hold descriptors (pidfds of its
    liveness checks, the memory files of its messages and shared arrays): rank 0's descriptor
    count after the last is within FD_SLACK of its count after cycle 50 (was 20 -> 110 from
    the 100th to the 1000th: every split's descriptors must go with its close)."""
    _check_bounded(run_ok(fd_worker, 2, args=(FD_CYCLES, True)), FD_CYCLES)


@pytest.mark.timeout(120)
def test_a_split_dropped_without_close_leaves_no_descriptor_behind():
    """The same, each sub-communicator dropped without close() and collected: its group's
    pidfds (SubGroup.__del__) and its messages' memory files (SubCommunicator.__del__) go."""
    _check_bounded(run_ok(fd_worker, 2, args=(150, False)), 150)


# ---------------------------------------------------------------------------------------------
# across nodes (tests/mpi_split_prog.py under mpiexec)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nprocs,mode,n", [(4, "from_mpi", 2), (5, "from_mpi", 3),
                                           (6, "from_mpi", 2), (2, "launch", 2),
                                           (2, "launch-fail", 2), (3, "launch", 2),
                                           (3, "launch-fail", 2)])
def test_splits_of_communicators_across_nodes(nprocs, mode, n):
    """Node-local splits of from_mpi's and inter='s communicators work (split_by("node"),
    nested, reversed, None), and so do splits whose new communicators span nodes (every
    collective, i-calls with the parent's calls meanwhile, nested splits across nodes and
    node-local): from_mpi's over MPI splits, inter='s through proxies its launchers start.
    Messages between nodes too (from_mpi: over MPI; inter=: relayed by the launchers), and
    launch-fail: a timeout in a message between nodes makes every worker raise."""
    pytest.importorskip("mpi4py")
    import subprocess
    import sys
    from test_multinode import _import_root, _mpiexec, _reap, _unlink_own_mpich_segments, _shm
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich)")
    prog = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_split_prog.py")
    before = _shm()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), _import_root()) if p]))
    proc = subprocess.Popen([mpiexec, "-n", str(nprocs), sys.executable, prog, mode, str(n)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mpiexec hung:\n{out.decode(errors='replace')[-3000:]}")
    finally:
        _reap(proc.pid)
        _unlink_own_mpich_segments(before)
    text = out.decode(errors="replace")
    assert proc.returncode == 0 and f"OK {mode}" in text, text[-4000:]
    if mode == "launch-fail":
        assert text.count("raised as expected") == nprocs * n, text[-4000:]


def test_bench_split_runs(capsys, tmp_path):
    """shmtree-bench split (shmtree only here; the MPI side is split_worker.py under mpiexec):
    every figure measured and positive, and the dup's ratio printed."""
    import json

    from shmtree.bench.cli import main
    path = tmp_path / "split.json"
    assert main(["split", "--no-mpi", "-n", "3", "--rounds", "1", "--splits", "2", "--calls",
                 "20", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "split into halves" in out and "a dup's 8 B allreduce over the parent's" in out
    got = json.loads(path.read_text())["shmtree"]
    assert sorted(got) == ["dup_ms", "dup_us", "half_us", "parent_us", "split_ms"]
    assert all(v > 0 for v in got.values()), got
