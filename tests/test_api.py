"""The public API surface (docs/guide/launching.md): run, Pool, Group, Communicator, module level.

Worker functions are module-level so that they pickle for spawn and forkserver.  Hand-made
processes are always terminated, killed and joined in a finally block.
"""
import multiprocessing as mp
import multiprocessing.pool
import os
import time
import traceback

import numpy as np
import pytest

import shmtree
from procutil import stop_processes, run_ok

# set by a test in the parent right before starting workers: a forked worker sees the new value,
# a spawned one re-imports this module and sees the initial one
_PARENT_MARK = "import-time"


# ---------------------------------------------------------------------------------------------
# no processes

def test_exception_hierarchy():
    assert issubclass(shmtree.ShmtreeError, RuntimeError)
    for name in ("PeerLostError", "CollectiveTimeoutError", "WorkerError"):
        assert issubclass(getattr(shmtree, name), shmtree.ShmtreeError), name
    assert issubclass(shmtree.CollectiveTimeoutError, TimeoutError)
    assert issubclass(shmtree.CollectiveMismatchError, ValueError)


def test_current_outside_group_raises():
    with pytest.raises(shmtree.ShmtreeError):
        shmtree.current()


@pytest.mark.timeout(60)
def test_parent_is_not_a_member():
    """run, Pool and Group make the workers members, never the parent."""
    run_ok(describe_worker_noargs, 2)
    with shmtree.Group(2):
        with pytest.raises(shmtree.ShmtreeError):
            shmtree.current()
    with pytest.raises(shmtree.ShmtreeError):
        shmtree.current()


def test_public_names():
    for name in ("run", "Pool", "Group", "Communicator", "allreduce", "rank", "size", "barrier",
                 "current", "Topology"):
        assert hasattr(shmtree, name), name



def test_api_module_reexports():
    """shmtree.api is the public face of the split modules: the same objects, and
    _rebuild_group, which Group pickles of older versions name as shmtree.api._rebuild_group."""
    from shmtree import api
    from shmtree.communicators import communicator
    from shmtree.launching import launch, pool
    from shmtree.groups import group
    assert api.Group is shmtree.Group is group.Group
    assert api.Communicator is shmtree.Communicator is communicator.Communicator
    assert api.run is shmtree.run is launch.run and api.Pool is shmtree.Pool is pool.Pool
    for name in ("allreduce", "barrier", "rank", "size", "current"):
        assert getattr(api, name) is getattr(shmtree, name) is getattr(communicator, name), name
    assert api._rebuild_group is group._rebuild_group


# ---------------------------------------------------------------------------------------------
# shmtree.run

def contract_step(comm, scale):
    """The example of README.md and examples/run_allreduce.py, verbatim."""
    x = np.arange(10.0) * (comm.rank + 1) * scale
    y = comm.allreduce(x)
    comm.allreduce(x, op="max", out=x)
    return float(y.sum())


@pytest.mark.timeout(60)
def test_run_contract_example():
    results = run_ok(contract_step, 4, args=(2.0,))
    assert results == [45.0 * 2.0 * (1 + 2 + 3 + 4)] * 4


def describe_worker(comm, a, b=None, *, c="default"):
    y = comm.allreduce(np.array([comm.rank], dtype=np.int64))
    return dict(rank=comm.rank, size=comm.size, rank_type=type(comm.rank),
                size_type=type(comm.size), a=a, b=b, c=c, total=int(y[0]), pid=os.getpid(),
                mark=_PARENT_MARK)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nprocs", [1, 2, 5])
def test_run_args_kwargs_and_results_by_rank(nprocs):
    global _PARENT_MARK
    _PARENT_MARK = "set-by-parent"
    try:
        results = run_ok(describe_worker, nprocs, args=("A",), kwargs=dict(b=[1, 2], c="C"))
    finally:
        _PARENT_MARK = "import-time"
    assert isinstance(results, list) and len(results) == nprocs
    for i, r in enumerate(results):
        assert r["rank"] == i and r["size"] == nprocs
        assert r["rank_type"] is int and r["size_type"] is int
        assert (r["a"], r["b"], r["c"]) == ("A", [1, 2], "C")
        assert r["total"] == nprocs * (nprocs - 1) // 2
        assert r["mark"] == "set-by-parent", "run's default start method should be fork"
    pids = {r["pid"] for r in results}
    assert len(pids) == nprocs and os.getpid() not in pids, "one new process per rank"


@pytest.mark.timeout(60)
def test_run_without_args():
    assert run_ok(describe_worker_noargs, 3) == [0, 1, 2]


def describe_worker_noargs(comm):
    comm.barrier()
    return comm.rank


def module_level_worker(comm):
    cur = shmtree.current()
    x = np.full(3, float(shmtree.rank() + 1))
    y = shmtree.allreduce(x)
    z = shmtree.allreduce(x, op="max")
    out = np.empty(3)
    w = shmtree.allreduce(x, op=np.minimum, out=out)
    shmtree.barrier()
    return dict(cur_is_comm=cur is comm, cur_rank=cur.rank, cur_size=cur.size,
                rank=shmtree.rank(), size=shmtree.size(), comm_rank=comm.rank,
                y=y.tolist(), z=z.tolist(), w_is_out=w is out, out=out.tolist(),
                is_communicator=isinstance(cur, shmtree.Communicator))


@pytest.mark.timeout(60)
def test_run_module_level_functions():
    P = 4
    for r, res in enumerate(run_ok(module_level_worker, P)):
        assert res["rank"] == res["comm_rank"] == res["cur_rank"] == r
        assert res["size"] == res["cur_size"] == P
        assert res["is_communicator"]
        assert res["y"] == [10.0] * 3 and res["z"] == [4.0] * 3 and res["out"] == [1.0] * 3
        assert res["w_is_out"]


# ---------------------------------------------------------------------------------------------
# shmtree.Pool

def pool_task(i):
    """The Pool task of README.md (examples/pool_tasks.py), plus what the test wants to see."""
    y = shmtree.allreduce(np.ones(3) * shmtree.rank())
    shmtree.barrier()
    return dict(i=i, rank=shmtree.rank(), size=shmtree.size(), y=y.tolist(), pid=os.getpid(),
                current_rank=shmtree.current().rank, mark=_PARENT_MARK,
                init=_POOL_INIT)


_POOL_INIT = None


def pool_initializer(value):
    global _POOL_INIT
    _POOL_INIT = value


def check_pool_results(results, P, init=None):
    assert [r["i"] for r in results] == list(range(P))
    assert sorted(r["rank"] for r in results) == list(range(P)), "one task per worker"
    assert len({r["pid"] for r in results}) == P
    expected = [float(P * (P - 1) // 2)] * 3
    for r in results:
        assert r["size"] == P and r["current_rank"] == r["rank"]
        assert r["y"] == expected
        assert r["init"] == init


@pytest.mark.timeout(90)
@pytest.mark.parametrize("P", [1, 3, 4, 8])
def test_pool_map(P):
    global _PARENT_MARK
    _PARENT_MARK = "set-by-parent"
    try:
        with shmtree.Pool(P) as pool:
            assert isinstance(pool, multiprocessing.pool.Pool)
            first = pool.map(pool_task, range(P))
            second = pool.map(pool_task, range(P))      # the group survives between maps
    finally:
        _PARENT_MARK = "import-time"
    check_pool_results(first, P)
    check_pool_results(second, P)
    # the same worker keeps the same rank
    assert {r["pid"]: r["rank"] for r in first} == {r["pid"]: r["rank"] for r in second}
    assert all(r["mark"] == "set-by-parent" for r in first), "Pool's default context is fork"


@pytest.mark.timeout(90)
def test_pool_initializer_and_group_options():
    with shmtree.Pool(3, initializer=pool_initializer, initargs=(("hello", 7),),
                      tree="chain", chunk_bytes=4096) as pool:
        check_pool_results(pool.map(pool_task, range(3)), 3, init=("hello", 7))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_pool_other_context(method):
    with shmtree.Pool(2, context=mp.get_context(method)) as pool:
        assert isinstance(pool, multiprocessing.pool.Pool)
        results = pool.map(pool_task, range(2))
    check_pool_results(results, 2)
    assert all(r["mark"] == "import-time" for r in results)


@pytest.mark.timeout(90)
def test_pool_close_join():
    pool = shmtree.Pool(2)
    try:
        check_pool_results(pool.map(pool_task, range(2)), 2)
        pool.close()
        pool.join()
    finally:
        pool.terminate()


# ---------------------------------------------------------------------------------------------
# shmtree.Group with hand-made processes

def group_member(group, rank, queue):
    """Joins, reduces, reports to the queue; never raises (the report carries the error)."""
    try:
        with group.join(rank) as comm:
            x = np.arange(5.0) * (rank + 1)
            y = comm.allreduce(x)
            out = np.empty(5)
            z = comm.allreduce(x, op="min", out=out)
            comm.barrier()
            queue.put(dict(rank=rank, ok=True, comm_rank=comm.rank, size=comm.size,
                           rank_type=type(comm.rank).__name__, y=y.tolist(),
                           out=out.tolist(), z_is_out=z is out,
                           module_rank=shmtree.rank(), module_size=shmtree.size()))
    except BaseException as e:  # noqa: B036 -- reported to the parent
        queue.put(dict(rank=rank, ok=False, error=repr(e), tb=traceback.format_exc()))


def run_group(P, method, **group_kw):
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    procs = []
    reports = {}
    with shmtree.Group(P, **group_kw) as group:
        assert isinstance(group, shmtree.Group)
        try:
            for rank in range(P):
                p = ctx.Process(target=group_member, args=(group, rank, queue))
                p.start()
                procs.append(p)
            for _ in range(P):
                rep = queue.get(timeout=60)
                reports[rep["rank"]] = rep
            for p in procs:
                p.join(30)
                assert p.exitcode == 0, f"worker exit code {p.exitcode}"
        finally:
            stop_processes(procs)
            queue.close()
            queue.join_thread()
    return reports


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,P", [("fork", 1), ("fork", 3), ("fork", 8), ("spawn", 2),
                                      ("forkserver", 3)])
def test_group_handmade_processes(method, P):
    reports = run_group(P, method)
    assert sorted(reports) == list(range(P))
    for rank, rep in reports.items():
        assert rep["ok"], f"rank {rank}: {rep.get('error')}\n{rep.get('tb')}"
        assert rep["comm_rank"] == rep["module_rank"] == rank
        assert rep["size"] == rep["module_size"] == P
        assert rep["rank_type"] == "int"
        assert rep["y"] == [i * P * (P + 1) / 2 for i in range(5)]
        assert rep["out"] == [float(i) for i in range(5)] and rep["z_is_out"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kw", [dict(tree="binary", chunk_bytes=4096),
                                dict(topology="2x2", tree="topology"),
                                dict(tree=2, pin=False)], ids=str)
def test_group_options(kw):
    reports = run_group(4, "fork", **kw)
    for rank, rep in reports.items():
        assert rep["ok"], f"rank {rank}: {rep.get('error')}\n{rep.get('tb')}"
        assert rep["y"] == [i * 10.0 for i in range(5)]


def test_group_close_without_members():
    group = shmtree.Group(4)
    group.close()
    with shmtree.Group(2) as g:
        assert isinstance(g, shmtree.Group)


# ---------------------------------------------------------------------------------------------
# barrier, Communicator.close

def barrier_worker(comm, directory, rounds):
    """Each rank marks its arrival with a file (late ranks arrive later); after the barrier
    every rank must see every mark."""
    missing = []
    for r in range(rounds):
        time.sleep(0.03 * comm.rank)
        open(os.path.join(directory, f"{r}-{comm.rank}"), "w").close()
        comm.barrier() if r % 2 else comm.barrier(timeout=30)
        seen = {f for f in os.listdir(directory) if f.startswith(f"{r}-")}
        if len(seen) != comm.size:
            missing.append((r, sorted(seen)))
    return missing


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", [1, 2, 5])
def test_barrier(P, tmp_path):
    assert run_ok(barrier_worker, P, args=(str(tmp_path), 4)) == [[]] * P


def close_worker(comm):
    x = np.ones(4)
    comm.allreduce(x)
    comm.barrier()
    comm.close()
    rep = {}
    for what, call in (("allreduce", lambda: comm.allreduce(x)), ("barrier", comm.barrier)):
        t0 = time.monotonic()
        try:
            call()
            rep[what] = "returned"
        except shmtree.ShmtreeError as e:
            rep[what] = "ShmtreeError"
        except Exception as e:
            rep[what] = f"{type(e).__name__} (not a ShmtreeError): {e}"
        rep[what + "_s"] = time.monotonic() - t0
    return rep


@pytest.mark.timeout(60)
def test_call_after_close_raises():
    for rank, rep in enumerate(run_ok(close_worker, 3)):
        for what in ("allreduce", "barrier"):
            assert rep[what] == "ShmtreeError", f"rank {rank}, {what} after close: {rep[what]}"
            assert rep[what + "_s"] < 2.0


@pytest.mark.timeout(120)
def test_two_groups_at_once():
    """Two groups alive at the same time, each with its own processes, do not interfere."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = []
    with shmtree.Group(2) as g2, shmtree.Group(3, tree="chain", chunk_bytes=4096) as g3:
        try:
            for group, P in ((g2, 2), (g3, 3)):
                for rank in range(P):
                    p = ctx.Process(target=group_member, args=(group, rank, queue))
                    p.start()
                    procs.append(p)
            reports = [queue.get(timeout=60) for _ in range(5)]
            for p in procs:
                p.join(30)
        finally:
            stop_processes(procs)
            queue.close()
            queue.join_thread()
    by_size = {}
    for rep in reports:
        assert rep["ok"], f"{rep.get('error')}\n{rep.get('tb')}"
        by_size.setdefault(rep["size"], []).append(rep)
    assert sorted(r["rank"] for r in by_size[2]) == [0, 1]
    assert sorted(r["rank"] for r in by_size[3]) == [0, 1, 2]
    for P, reps in by_size.items():
        for rep in reps:
            assert rep["y"] == [i * P * (P + 1) / 2 for i in range(5)]


def second_group_closed_worker(comm):
    """Issue 21 item 17: join a second group (as a torch new_group does), close it, then use
    the module-level calls: they must reach the first group, still joined."""
    import warnings
    rep = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # "now joins a second one"
        second = shmtree.Group(1, pin=False)
        inner = second.join(0)
    rep["inside"] = (shmtree.size(), shmtree.current() is inner)
    how = ("comm.close", "group.close")[comm.rank % 2]
    if how == "comm.close":
        inner.close()
    second.close()
    rep["after"] = (shmtree.rank(), shmtree.size(), shmtree.current() is comm)
    rep["sum"] = shmtree.allreduce(np.ones(3) * (comm.rank + 1), timeout=30).tolist()
    comm.close()
    try:
        shmtree.size()
        rep["closed"] = "no error"
    except shmtree.ShmtreeError as exc:
        rep["closed"] = str(exc)
    return rep


@pytest.mark.timeout(60)
def test_module_level_calls_fall_back_to_the_group_still_joined():
    reps = run_ok(second_group_closed_worker, 2)
    for rank, rep in enumerate(reps):
        assert rep["inside"] == (1, True), rep
        assert rep["after"] == (rank, 2, True), rep
        assert rep["sum"] == [3.0, 3.0, 3.0], rep
        # once no group is left, the message says which one was closed
        assert f"no longer in any group: it was rank {rank} of 2" in rep["closed"], rep
        assert "size=2" in rep["closed"], rep
