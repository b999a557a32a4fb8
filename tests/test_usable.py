"""Ordinary use never hangs or lies: regression tests for the paths a new user takes first.

Each test names the failure it guards against: a spawned member that planned the group again
from its own CPU mask, a member left pinned after close, counters that lag after a mismatch,
shapes compared only up to 12 dims, a timeout checked only when nothing moves, signed-zero ties
that depend on the tree, descriptors of dropped Group copies, Pools that hang on ordinary
map/apply use, and run() calling a peer that returned early "dead".
"""
import gc
import multiprocessing as mp
import os
import pickle
import re
import time
import warnings

import numpy as np
import pytest

import shmtree
import shmtree.machine.plan
from shmtree import api
from procutil import run_ok, stop_processes, wait_aborted, wait_in_call


def memfd_fds():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shmtree"):
                out.append(int(fd))
        except OSError:
            pass
    return out


# ---------------------------------------------------------------------------------------------
# 1. a spawned member runs the creator's plan


def spawned_member(group, n, queue):
    comm = group.join(1)
    try:
        y = comm.allreduce(np.arange(n, dtype=np.float64), timeout=30)
        queue.put(("ok", int(np.count_nonzero(y != 2 * np.arange(n)))))
    except BaseException as exc:
        queue.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        comm.close()
        group.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("options", [dict(small_bytes=4096), {}])
def test_spawned_member_runs_the_creators_plan(options):
    """Rank 0 joins in the parent (which pins the parent to one core), rank 1 is spawned: it
    must run the creator's plan, not one made from its own (inherited, one-core) mask."""
    ctx = mp.get_context("spawn")
    n = 200_000
    with shmtree.Group(2, **options) as group:
        comm = group.join(0)
        queue = ctx.Queue()
        p = ctx.Process(target=spawned_member, args=(group, n, queue))
        try:
            p.start()
            y = comm.allreduce(np.arange(n, dtype=np.float64), timeout=60)
            status, detail = queue.get(timeout=60)
            assert status == "ok", detail
            assert detail == 0, f"rank 1: {detail} of {n} items wrong"
            np.testing.assert_array_equal(y, 2 * np.arange(n))
            p.join(30)
        finally:
            comm.close()
            stop_processes([p])


def test_plan_pickles_with_its_digest():
    plan = shmtree.machine.plan.plan_group(4, topology="2x2", tree="ring", chunk_bytes=8192)
    again = pickle.loads(pickle.dumps(plan))
    assert again.digest() == plan.digest()
    assert again.large_tree == plan.large_tree and again.small_tree == plan.small_tree
    other = shmtree.machine.plan.plan_group(4, topology="2x2", tree="ring", chunk_bytes=8192,
                                            ncpus=1)
    assert other.digest() != plan.digest()       # planned for another machine: another digest


# ---------------------------------------------------------------------------------------------
# 3. a member gets its CPU mask back; plans see the machine, not shmtree's pin


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["comm.close", "group.close"])
def test_cpu_mask_restored_after_membership(how):
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two usable CPUs to see pinning")
    group = shmtree.Group(2, pin=True)
    comm = group.join(0)
    try:
        assert len(os.sched_getaffinity(0)) == 1, "rank 0 was not pinned"
        # planning inside a member sees the cores the process had, not shmtree's pin
        assert shmtree.machine.plan.plan_group(2).ncpus == len(before)
        assert shmtree.machine.plan.usable_cpus() == sorted(before)
    finally:
        if how == "comm.close":
            comm.close()
            assert os.sched_getaffinity(0) == before
        group.close()
    assert os.sched_getaffinity(0) == before


def child_mask(comm):
    return sorted(os.sched_getaffinity(0)), comm.rank


@pytest.mark.timeout(60)
def test_children_of_a_pinned_member_get_the_original_mask():
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two usable CPUs to see pinning")
    with shmtree.Group(2, pin=True) as group:
        comm = group.join(0)
        try:
            # a run() started by a pinned member: its workers are not all on the member's core
            masks = shmtree.run(child_mask, 2, pin=False)
        finally:
            comm.close()
    assert all(mask == sorted(before) for mask, _ in masks), masks


# ---------------------------------------------------------------------------------------------
# 4. counters after a mismatch; shapes beyond 12 dims; timeout on every slice; signed zeros


def mismatch_then_counters(comm):
    x = np.ones(3 if comm.rank == 0 else 4)
    try:
        comm.allreduce(x)
        raise AssertionError("no mismatch raised")
    except shmtree.CollectiveMismatchError:
        pass
    after_mismatch = comm._seg.completed(comm.rank)
    comm.allreduce(np.ones(5))
    return after_mismatch, comm._seg.completed(comm.rank)


@pytest.mark.timeout(60)
def test_completed_counter_counts_a_mismatched_call():
    for after_mismatch, after_good in run_ok(mismatch_then_counters, 2):
        assert (after_mismatch, after_good) == (1, 2)


def deep_shapes(comm):
    base = (1,) * 12
    x = np.ones(base + ((2, 3) if comm.rank == 0 else (3, 2)))
    try:
        comm.allreduce(x, timeout=20)
    except shmtree.CollectiveMismatchError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(60)
def test_shapes_differing_after_dim_12_are_a_mismatch():
    for msg in run_ok(deep_shapes, 2):
        assert msg is not None and "ranks disagree" in msg


def timed_out_large(comm, n):
    x = np.ones(n, dtype=np.float32)
    t0 = time.monotonic()
    comm.allreduce(x, timeout=60)           # the whole call, timed: what the 5 ms must cut short
    full_s = time.monotonic() - t0
    t0 = time.monotonic()
    try:
        comm.allreduce(x, timeout=0.005)
        return "returned", time.monotonic() - t0, full_s
    except (shmtree.CollectiveTimeoutError, shmtree.PeerLostError) as exc:
        return type(exc).__name__, time.monotonic() - t0, full_s


@pytest.mark.timeout(120)
def test_timeout_is_checked_while_the_call_makes_progress():
    """A 256 MiB call takes far longer than 5 ms: timeout=0.005 must stop it, even though its
    chunks keep moving (the deadline was only checked after 20 ms without progress).  The
    stopped call must take no longer than a whole call did (timed on the same ranks just
    before, so a loaded machine stretches both), or 2 s, whichever is longer."""
    results = run_ok(timed_out_large, 2, args=(64 << 20,))
    names = [name for name, _, _ in results]
    assert "returned" not in names, results
    assert "CollectiveTimeoutError" in names, results
    assert all(secs < max(2.0, full_s) for _, secs, full_s in results), results


def signed_zero_worker(comm, pattern):
    x = np.array([-0.0 if sign else 0.0 for sign in pattern[comm.rank]], dtype=np.float64)
    out = {}
    for op in ("min", "max"):
        for dt in (np.float16, np.float32, np.float64):
            out[op, np.dtype(dt).name] = np.signbit(comm.allreduce(x.astype(dt), op=op)).tolist()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tree", ["binary", "ring", "chain", "flat"])
def test_signed_zero_ties_resolved_one_way_whatever_the_tree(tree):
    P = 4
    # column j: which ranks contribute -0.0 (every mix of 4 ranks)
    pattern = [[bool(j >> r & 1) for j in range(16)] for r in range(P)]
    for out in run_ok(signed_zero_worker, P, args=(pattern,), tree=tree):
        for (op, dt), signs in out.items():
            any_neg = [any(pattern[r][j] for r in range(P)) for j in range(16)]
            all_neg = [all(pattern[r][j] for r in range(P)) for j in range(16)]
            expect = any_neg if op == "min" else all_neg
            assert signs == expect, f"{tree} {op} {dt}: {signs} != {expect}"


def bitwise_worker(comm):
    rng = np.random.default_rng(comm.rank)
    out = {}
    for dt in (np.int8, np.uint16, np.int32, np.uint64, np.bool_):
        x = rng.integers(0, 255, size=1001).astype(dt)
        for op in ("band", "bor", "bxor", np.bitwise_and, np.bitwise_or, np.bitwise_xor):
            name = op if isinstance(op, str) else op.__name__
            out[np.dtype(dt).name, name] = (x, comm.allreduce(x, op=op),
                                            comm.allreduce(x[::2], op=op))
    try:
        comm.allreduce(np.ones(3), op="bxor")
        out["float"] = None
    except TypeError as exc:
        out["float"] = str(exc)
    return out


@pytest.mark.timeout(60)
def test_bitwise_ops_match_numpy():
    outs = run_ok(bitwise_worker, 3)
    ufunc = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
             "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or,
             "bitwise_xor": np.bitwise_xor}
    for key in outs[0]:
        if key == "float":
            assert all("bitwise" in o["float"] for o in outs)
            continue
        inputs = np.stack([o[key][0] for o in outs])
        want = ufunc[key[1]].reduce(inputs, axis=0)
        for o in outs:
            np.testing.assert_array_equal(o[key][1], want, err_msg=str(key))
            np.testing.assert_array_equal(o[key][2], want[::2], err_msg=str(key))


# ---------------------------------------------------------------------------------------------
# 5. a dropped Group copy closes its descriptor


class _DupFd:
    def __init__(self, fd):
        self.fd = fd

    def detach(self):
        return self.fd


@pytest.mark.timeout(30)
def test_dropped_group_copy_closes_its_descriptor():
    with shmtree.Group(2) as g:
        before = memfd_fds()
        # what unpickling in another process runs (private), with a descriptor of its own
        copy = api._rebuild_group(g.plan, _DupFd(os.dup(g._fd)), g._nonce, g.layout.total)
        assert len(memfd_fds()) == len(before) + 1
        del copy
        gc.collect()
        assert memfd_fds() == before, "the copy's descriptor outlived it"


# ---------------------------------------------------------------------------------------------
# 6. Pool: dealt one at a time, stalls detected, failures explained, options checked


def one_allreduce(i):
    return float(shmtree.allreduce(np.array([1.0]))[0]), shmtree.rank()


def raise_on_rank_1(i):
    if shmtree.rank() == 1:
        raise ValueError(f"boom in task {i}")
    return float(shmtree.allreduce(np.array([1.0]), timeout=60)[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ntasks", [4, 20, 40])
def test_pool_map_deals_multiples_of_the_size(ntasks):
    with shmtree.Pool(4) as pool:
        out = pool.map(one_allreduce, range(ntasks))
        assert [v for v, _ in out] == [4.0] * ntasks
        assert sorted(r for _, r in out) == sorted(list(range(4)) * (ntasks // 4))
        assert [v for v, _ in pool.imap(one_allreduce, range(8))] == [4.0] * 8
        assert pool.starmap(one_allreduce, [(i,) for i in range(8)]) is not None


STALL_SLACK_S = 15.0        # how late a stall may be reported on a loaded machine: a stall that
                            # is never detected is a hang until the test's own timeout


@pytest.mark.timeout(120)
def test_pool_map_with_idle_members_fails_naming_them():
    """map(task, range(6)) on Pool(4): the second round has two tasks for four workers."""
    stall = 1.0
    with shmtree.Pool(4, stall_timeout=stall) as pool:
        t0 = time.monotonic()
        with pytest.raises(shmtree.ShmtreeError) as info:
            pool.map(one_allreduce, range(6))
        took = time.monotonic() - t0
        msg = str(info.value)
        assert took < stall + STALL_SLACK_S, took
        assert re.search(r"allreduce #2", msg), msg
        assert re.search(r"ranks? [\d,]+ waited in it", msg), msg
        assert re.search(r"ranks? [\d,]+ (was|were) idle", msg), msg
        # the pool says it is broken, with the same cause, and never 'not joined'
        with pytest.raises(shmtree.PeerLostError, match="idle"):
            pool.map(one_allreduce, range(4))


@pytest.mark.timeout(60)
def test_pool_one_collective_task_fails_within_the_stall_timeout():
    with shmtree.Pool(2, stall_timeout=1.0) as pool:
        t0 = time.monotonic()
        with pytest.raises(shmtree.ShmtreeError, match="idle"):
            pool.apply_async(one_allreduce, (0,)).get(timeout=30)
        assert time.monotonic() - t0 < 1.0 + STALL_SLACK_S


@pytest.mark.timeout(60)
def test_pool_task_that_raises_while_others_wait():
    with shmtree.Pool(3, stall_timeout=30) as pool:
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:
            pool.map(raise_on_rank_1, range(3))
        assert time.monotonic() - t0 < 10          # not the 30 s stall timeout
        assert "boom" in str(info.value), info.value
        with pytest.raises(shmtree.PeerLostError, match="boom"):
            pool.map(raise_on_rank_1, range(3))


def init_fails_on_rank_1():
    if shmtree.rank() == 1:
        raise ValueError("bad initializer")


@pytest.mark.timeout(60)
def test_pool_initializer_that_raises_is_reported_once():
    t0 = time.monotonic()
    with pytest.raises(shmtree.WorkerError, match="bad initializer") as info:
        shmtree.Pool(3, initializer=init_fails_on_rank_1)
    assert info.value.rank == 1
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs,match", [(dict(maxtasksperchild=2), "maxtasksperchild"),
                                          (dict(chunk_size=4096), "chunk_size")])
def test_pool_rejects_bad_options_cleanly(kwargs, match):
    seen = []
    old = __import__("sys").unraisablehook
    __import__("sys").unraisablehook = seen.append
    try:
        with pytest.raises(TypeError, match=match):
            shmtree.Pool(2, **kwargs)
        gc.collect()
    finally:
        __import__("sys").unraisablehook = old
    assert not seen, [str(u.exc_value) for u in seen]


@pytest.mark.timeout(120)
def test_pool_terminate_with_a_python_sigterm_handler_in_the_parent():
    """Workers inherit the parent's Python SIGTERM handler, which only the main thread can run:
    terminate() hung when the signal landed in a worker's watch thread."""
    import signal

    old = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        for _ in range(40):
            with shmtree.Pool(2) as pool:
                assert sorted(pool.map(one_allreduce, range(2))) == [(2.0, 0), (2.0, 1)]
    finally:
        signal.signal(signal.SIGTERM, old)


def spmd(comm, scale, offset=0):
    return float(comm.allreduce(np.array([comm.rank * scale + offset]))[0]), comm.rank


def spmd_raises(comm):
    if comm.rank == 2:
        raise KeyError("rank two")
    # rank 2's task has raised (its note says so) before the others call: they stall on it
    deadline = time.monotonic() + 20
    while "rank two" not in comm._seg.note(2) and time.monotonic() < deadline:
        time.sleep(0.002)
    return float(comm.allreduce(np.ones(1), timeout=60)[0])


@pytest.mark.timeout(120)
def test_pool_run_is_spmd_with_results_by_rank():
    with shmtree.Pool(3) as pool:
        assert pool.run(spmd, 2.0, offset=1) == [(9.0, 0), (9.0, 1), (9.0, 2)]
        assert pool.run(spmd, 1.0) == [(3.0, 0), (3.0, 1), (3.0, 2)]
        with pytest.raises(shmtree.WorkerError, match="rank two") as info:
            pool.run(spmd_raises)
        assert info.value.rank == 2


@pytest.mark.timeout(120)
def test_pool_takes_a_start_method_name():
    with shmtree.Pool(2, context="spawn") as pool:
        assert sorted(pool.map(one_allreduce, range(2))) == [(2.0, 0), (2.0, 1)]


# ---------------------------------------------------------------------------------------------
# 7. run: what happened, said plainly


def returns_early(comm):
    if comm.rank == 1:
        for r in (0, 2):                          # until the others wait in allreduce #1
            wait_in_call(comm.group, r, 1, timeout=20.0)
        return "bye"
    comm.allreduce(np.ones(4))
    comm.allreduce(np.ones(4))


@pytest.mark.timeout(60)
def test_run_names_a_rank_that_returned_early():
    t0 = time.monotonic()
    with pytest.raises(shmtree.WorkerError) as info:
        shmtree.run(returns_early, 3)
    msg = str(info.value)
    assert "rank 1 left the group" in msg and "returned from its function" in msg, msg
    assert re.search(r"ranks 0,2 waited in allreduce #1", msg), msg
    assert "died" not in msg and "is gone" not in msg, msg
    # a rank that returned is reported as soon as it is seen gone; a run that waited for the
    # others instead would hang (their allreduce has no timeout) until the test's timeout
    assert time.monotonic() - t0 < 40


def late_rank_2(comm):
    comm.barrier()                            # every rank has joined: the timeout counts from here
    if comm.rank == 2:
        wait_aborted(comm.group, timeout=30.0)   # arrives only after the others' timeout
    try:
        comm.allreduce(np.ones(3), timeout=0.5)
    except shmtree.ShmtreeError as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.timeout(60)
def test_timeout_names_the_ranks_that_had_not_arrived():
    out = run_ok(late_rank_2, 3)
    timeouts = [msg for name, msg in out if name == "CollectiveTimeoutError"]
    assert timeouts, out
    assert all("rank 2 had not arrived" in msg for msg in timeouts), timeouts


def pickle_comm(comm):
    try:
        pickle.dumps(comm)
    except TypeError as exc:
        return str(exc)


@pytest.mark.timeout(60)
def test_pickling_a_communicator_gives_a_hint():
    for msg in run_ok(pickle_comm, 1):
        assert msg and "send the Group" in msg and "join" in msg


@pytest.mark.timeout(30)
def test_lambda_under_spawn_gives_a_hint():
    with pytest.raises(TypeError, match="module level"):
        shmtree.run(lambda comm: 1, 2, start_method="spawn")


@pytest.mark.timeout(60)
def test_lambda_task_gives_a_hint():
    with shmtree.Pool(2) as pool:
        with pytest.raises(TypeError, match="module level"):
            pool.map(lambda i: i, range(2))
        assert sorted(pool.map(one_allreduce, range(2))) == [(2.0, 0), (2.0, 1)]


def masked(comm):
    try:
        comm.allreduce(np.ma.masked_array([1.0, 2.0], mask=[0, 1]))
    except TypeError as exc:
        return str(exc)


@pytest.mark.timeout(30)
def test_masked_array_is_refused():
    assert all("masked" in msg for msg in run_ok(masked, 1))


def numpy_int_size(comm):
    return comm.size


@pytest.mark.timeout(30)
def test_run_takes_a_numpy_int():
    assert shmtree.run(numpy_int_size, np.int64(2)) == [2, 2]


def second_group(comm):
    with shmtree.Group(1) as other:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inner = other.join(0)
        inner.close()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.timeout(30)
def test_joining_a_second_group_warns():
    (msgs,) = run_ok(second_group, 1)
    assert msgs and "second" in msgs[0]
