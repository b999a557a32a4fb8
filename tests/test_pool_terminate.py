"""Pool.terminate never hangs on a lock that a dead process held.

multiprocessing's Pool sends results through one queue whose write lock every worker takes to
send: a worker killed while it holds it (SIGKILLed by the user, or terminated by terminate()
while it sends a result) left terminate() blocked for good on the task handler's last put (a CI
run of test_faults.py::test_pool_worker_sigkilled_mid_task hung so, at load 6).  Here a
process that holds the lock dies, as does a worker, and terminate() must still return.
"""
import multiprocessing as mp
import os
import signal
import threading

import numpy as np
import pytest

import shmtree
from shmtree.launching import pool as _pool


def _task(_):
    return float(shmtree.allreduce(np.ones(1))[0])


@pytest.mark.timeout(120)
def test_terminate_returns_when_a_dead_process_held_the_result_lock():
    pool = shmtree.Pool(2)
    try:
        assert pool.map(_task, range(2)) == [2.0, 2.0]
        lock = pool._outqueue._wlock
        holder = mp.get_context("fork").Process(target=lock.acquire)   # takes it, exits
        holder.start()
        holder.join(30)
        assert holder.exitcode == 0 and not lock.acquire(timeout=0.2), "the lock is held"
        victim = pool._pool[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(30)
    except BaseException:
        pool.terminate()
        raise
    done = threading.Event()
    t = threading.Thread(target=lambda: (pool.terminate(), done.set()), daemon=True)
    t.start()
    t.join(4 * _pool.POOL_LOCK_S + 30)
    assert done.is_set(), "Pool.terminate hung on the result queue's lock a dead process held"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["with", "close_join"])
def test_no_thread_of_a_pool_outlives_it(how):
    """A fork after a Pool (run's workers) must not copy a thread of it: Python >= 3.12 warns
    that forking a multi-threaded process may deadlock the child."""
    before = set(threading.enumerate())
    if how == "with":
        with shmtree.Pool(2) as pool:
            assert pool.map(_task, range(2)) == [2.0, 2.0]
    else:
        pool = shmtree.Pool(2)
        try:
            assert pool.map(_task, range(2)) == [2.0, 2.0]
            pool.close()
            pool.join()
        finally:
            pool.terminate()
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not left, f"threads of the pool still running after it: {left}"
