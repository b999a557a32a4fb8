"""Pinning and unpinning a member (shmtree.machine.plan.pin_to / unpin; issue 21, item 19).

A member is pinned in the thread that joins; the threads it starts while pinned inherit the one
core.  Leaving the group gives every such thread the original mask back, whichever thread
closes (sched_setaffinity(0) restored only the calling thread: a thread started while pinned
kept one CPU for the rest of the process's life).  Tests join in the test process (no peers are
needed to join and close) and end unpinned, as the leak check in conftest.py demands.
"""
import os
import threading

import pytest

import shmtree


def _needs_two_cpus():
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two usable CPUs to see pinning")
    return before


class Parked(threading.Thread):
    """A thread that reports its id and mask, then waits until released."""

    def __init__(self):
        super().__init__(daemon=True)
        self.started_mask, self.ready, self.release = None, threading.Event(), threading.Event()

    def run(self):
        self.started_mask = os.sched_getaffinity(0)
        self.ready.set()
        self.release.wait(60)

    def mask(self):
        return os.sched_getaffinity(self.native_id)


def _start_parked():
    t = Parked()
    t.start()
    assert t.ready.wait(30)
    return t


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["comm.close", "group.close", "close from another thread"])
def test_threads_started_while_pinned_get_the_mask_back(how):
    before = _needs_two_cpus()
    group = shmtree.Group(2, pin=True)
    threads = []
    try:
        comm = group.join(0)
        assert len(os.sched_getaffinity(0)) == 1, "rank 0 was not pinned"
        threads = [_start_parked(), _start_parked()]
        assert all(len(t.started_mask) == 1 for t in threads), "threads did not inherit the pin"
        if how == "comm.close":
            comm.close()
        elif how == "group.close":
            group.close()
        else:
            closer = threading.Thread(target=comm.close)
            closer.start()
            closer.join(30)
            assert not closer.is_alive()
        assert os.sched_getaffinity(0) == before, "the joining thread is still pinned"
        for t in threads:
            assert t.mask() == before, f"a thread started while pinned kept {t.mask()}"
    finally:
        group.close()
        for t in threads:
            t.release.set()
            t.join(30)
        os.sched_setaffinity(0, before)          # (a failure must not poison what follows)


@pytest.mark.timeout(60)
def test_a_thread_the_user_pinned_elsewhere_is_left_alone():
    before = _needs_two_cpus()
    other = sorted(before)[-1]
    t = _start_parked()
    try:
        with shmtree.Group(2, pin=True) as group:
            comm = group.join(0)
            cpu = next(iter(os.sched_getaffinity(0)))
            mine = {c for c in before if c != cpu} or {other}
            os.sched_setaffinity(t.native_id, mine)     # the user's own choice for that thread
            comm.close()
            assert os.sched_getaffinity(0) == before
            assert t.mask() == mine
    finally:
        t.release.set()
        t.join(30)
        os.sched_setaffinity(0, before)
