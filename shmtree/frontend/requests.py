"""Nonblocking collectives (docs/design.md, "Nonblocking calls"): Request, wait_all, and the
progress thread that runs a communicator's posted calls.

A nonblocking call (Communicator.iallreduce & co.) checks its arguments at once - a local error
is raised by the posting call itself - and hands the prepared call (a function that runs its
engine rounds) to the communicator's progress thread, which runs the posted calls one after the
other, in the order they were posted, on the engine with the GIL released while it waits for
peers.  A blocking call is the same prepared call run at once by the calling thread when nothing
is outstanding, or posted and waited for when something is (so issue order always holds).

Whoever runs a call holds the communicator's executor lock for its duration (the engine runs one
call at a time).  The thread is started on a communicator's first nonblocking call, sleeps on a
lock (a futex) when its queue is empty, and is stopped by Communicator.close after the queue has
drained.  Completion callbacks run in it after the call is over, with no lock held; one that
raises is logged (concurrent.futures does it) and changes nothing else.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from _thread import get_ident as _get_ident

from ..errors import ShmtreeError

__all__ = ["Request", "wait_all"]

_log = logging.getLogger("shmtree")
SPIN_S = 50e-6          # an idle progress thread polls its queue this long before it sleeps


class Request(concurrent.futures.Future):
    """The result of a nonblocking call: a `concurrent.futures.Future`.

    Returned at once by the ``i`` forms (``comm.iallreduce(x)``, ...), by `Persistent.start`
    and by the messages' ``isend`` / ``irecv``.  It has the Future's methods -
    ``result(timeout)``, ``done()``, ``exception(timeout)``, ``add_done_callback(fn)`` - so
    `concurrent.futures.wait` and `asyncio.wrap_future` work, plus ``wait(timeout)``
    (= ``result``) and ``test()`` (= ``done``).

    The call's input must not be modified, nor its `out` read, until the request is done.
    ``result(timeout)`` running out raises `TimeoutError` and leaves the call running;
    ``cancel()`` returns False (every rank must make the call).  Completion callbacks run in
    the communicator's progress thread, after the call; a collective or a wait inside one
    raises `ShmtreeError` (it could never complete there).  A forked child cannot wait for its
    parent's requests (`ShmtreeError`).

    Attributes
    ----------
    name : str
        The call (``"iallreduce"``, ...).
    number : int
        Its place in the issue order of the communicator's calls.
    status : shmtree.Status or None
        An irecv's status (the message's source, tag and size), set before the request
        completes; None otherwise.

    Examples
    --------
    >>> import numpy as np, shmtree
    >>> def step(comm):
    ...     req = comm.iallreduce(np.array([comm.rank + 1.0]))
    ...     local = float(np.arange(4.0) @ np.arange(4.0))  # computes meanwhile
    ...     total = req.wait(timeout=30)
    ...     return float(total[0]), local, req.done()
    >>> shmtree.run(step, 2)
    [(3.0, 14.0, True), (3.0, 14.0, True)]
    """

    status = None

    def __init__(self, name: str, number: int, progress: "Progress"):
        if _LAZY:                     # Future.__init__ less its Condition: made on first use
            self._state = "PENDING"
            self._result = self._exception = None
            self._waiters = []
            self._done_callbacks = []
        else:
            super().__init__()
        self.name = name              # e.g. "iallreduce"
        self.number = number          # issue order among the communicator's calls
        self._pid = _PID[0]
        self._progress = progress

    def _get_condition(self):
        """Future's lock and condition, made by whoever needs it first (most often the
        progress thread, when the call is over): posting stays cheap."""
        cond = self.__dict__.get("_cond")
        if cond is None:
            with _MAKING:
                cond = self.__dict__.get("_cond")
                if cond is None:
                    cond = self.__dict__["_cond"] = threading.Condition()
        return cond

    def _set_condition(self, cond):
        self.__dict__["_cond"] = cond

    def cancel(self):
        """Return False: a collective cannot be cancelled (every rank must make the call)."""
        return False

    def wait(self, timeout=None):
        """The call's result (as result).

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait (None: no limit).

        Returns
        -------
        object
            What the blocking call would have returned.

        Raises
        ------
        TimeoutError
            `timeout` ran out; the call goes on.
        Exception
            The call's own failure (`CollectiveMismatchError`, `PeerLostError`, ...).
        ShmtreeError
            Waited for in a forked child, or inside a completion callback.
        """
        return self.result(timeout)

    def test(self):
        """Is the call over (completed or failed)?  (as done)

        Returns
        -------
        bool
        """
        return self.done()

    def done(self):
        if self._pid != _PID[0]:          # a forked child: the lock may have been held at fork
            return self._state == "FINISHED"
        return super().done()

    def result(self, timeout=None):
        self._check_waitable()
        if self._pid != _PID[0]:          # (done before the fork: what the parent had then)
            if self._exception is not None:
                raise self._exception
            return self._result
        return super().result(timeout)

    def exception(self, timeout=None):
        self._check_waitable()
        if self._pid != _PID[0]:
            return self._exception
        return super().exception(timeout)

    def _check_waitable(self):
        if self.done():
            return
        if self._pid != _PID[0]:
            raise ShmtreeError(f"shmtree: {self.name} #{self.number} was posted by process "
                               f"{self._pid}; a forked child cannot wait for it (the call "
                               "runs in the parent)")
        if self._progress.is_current_thread():
            raise ShmtreeError(f"shmtree: waiting for {self.name} #{self.number} inside a "
                               "completion callback would never end (callbacks run in the "
                               "progress thread, which runs the calls); wait elsewhere")

    def __repr__(self):
        state = "pending" if not self.done() else (
            "failed" if super().exception() is not None else "done")
        return f"<shmtree.Request {self.name} #{self.number} {state}>"


def _future_fields_are_known() -> bool:
    """Does Future.__init__ set exactly the fields Request sets itself (the same in CPython 3.8
    to 3.13)?  If not, Request calls it (posting then costs about a microsecond more)."""
    f = concurrent.futures.Future()
    return set(vars(f)) == {"_condition", "_state", "_result", "_exception", "_waiters",
                            "_done_callbacks"} and f._state == "PENDING"


_LAZY = _future_fields_are_known()
_MAKING = threading.Lock()
_PID = [os.getpid()]                  # (os.getpid, kept up to date across forks)


def _after_fork_in_child():
    global _MAKING
    _PID[0] = os.getpid()
    _MAKING = threading.Lock()        # (another thread may have held it at the fork)


os.register_at_fork(after_in_child=_after_fork_in_child)
if _LAZY:
    Request._condition = property(Request._get_condition, Request._set_condition)


def wait_all(requests, timeout=None) -> list:
    """The results of `requests`, once all are done, in the order given.

    Parameters
    ----------
    requests : iterable of Request
        The requests to wait for.
    timeout : float, optional
        Seconds for all of them together (None: no limit).

    Returns
    -------
    list
        Their results, in the order given.

    Raises
    ------
    TypeError
        Something that is not a `Request`.
    TimeoutError
        `timeout` ran out (the calls keep running).
    Exception
        If any failed: the failure of the one posted first.

    Examples
    --------
    >>> import numpy as np, shmtree
    >>> def step(comm):
    ...     reqs = [comm.iallreduce(np.array([k])) for k in range(3)]
    ...     return [int(r[0]) for r in shmtree.wait_all(reqs)]
    >>> shmtree.run(step, 2)
    [[0, 2, 4], [0, 2, 4]]
    """
    requests = list(requests)
    for r in requests:
        if not isinstance(r, Request):
            raise TypeError(f"shmtree.wait_all: expected shmtree.Request objects, got "
                            f"{type(r).__name__}")
    deadline = None if timeout is None else time.monotonic() + timeout
    for r in requests:
        r._check_waitable()
    # requests posted before a fork (in a forked child) are done (checked above) and are read
    # as they were at the fork, without their Future's lock, which another thread of the parent
    # may have held then: only this process's own are waited for
    own = [r for r in requests if r._pid == _PID[0]]
    done, pending = concurrent.futures.wait(
        own, None if deadline is None else max(0.0, deadline - time.monotonic()))
    if pending:
        raise TimeoutError(f"shmtree.wait_all: {len(pending)} of {len(requests)} request(s) "
                           f"not done after {timeout} s")
    failed = [r for r in requests if r.exception() is not None]
    if failed:
        raise min(failed, key=lambda r: r.number).exception()
    return [r.result() for r in requests]


class Progress:
    """The progress thread of one communicator and its queue of posted calls."""

    def __init__(self, name: str, executor: threading.Lock):
        self._name = name
        self._exec = executor             # held while a call runs (also by blocking callers)
        self._queue = collections.deque() # (request, run)
        self._lock = threading.Lock()     # the queue, outstanding, the sleeping flag
        self._bell = threading.Lock()     # released to wake the sleeping thread
        self._bell.acquire()
        self._sleeping = False
        self._stopping = False
        self._thread = None
        self._ident = None                # the thread's ident, once it runs
        self.outstanding = 0              # posted and not yet over
        self.last = None                  # the request posted last

    def is_current_thread(self) -> bool:
        return _get_ident() == self._ident

    def post(self, request: Request, run) -> Request:
        with self._lock:
            if self._stopping:
                raise ShmtreeError("shmtree: this communicator is closed")
            self._queue.append((request, run))
            self.outstanding += 1
            self.last = request
            ring, self._sleeping = self._sleeping, False
            start = self._thread is None
            if start:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        if start:
            self._thread.start()
        elif ring:
            self._bell.release()
        return request

    def drain(self):
        """Wait until every posted call is over (not from the progress thread)."""
        last = self.last
        if last is not None and self.outstanding:
            concurrent.futures.wait([last])

    def stop(self):
        """Drain, then end the thread."""
        self.drain()
        with self._lock:
            self._stopping = True
            ring, self._sleeping = self._sleeping, False
            thread = self._thread
        if ring:
            self._bell.release()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _loop(self):
        self._ident = _get_ident()
        while True:
            item = self._next()
            if item is None:
                return
            request, run = item
            request.set_running_or_notify_cancel()
            error = result = None
            try:
                with self._exec:
                    result = run()
            except BaseException as exc:      # the request's failure
                error = exc
            with self._lock:
                self.outstanding -= 1
            try:                              # (callbacks run here, after the call)
                if error is None:
                    request.set_result(result)
                else:
                    request.set_exception(error)
            except BaseException:             # a callback that escaped Future's own logging
                _log.exception("shmtree: a completion callback of %r raised", request)

    def _next(self):
        """The next posted call, after a short poll and then sleeping when there is none;
        None once stopping with nothing left."""
        spin_end = time.monotonic() + SPIN_S
        while True:
            with self._lock:
                if self._queue:
                    return self._queue.popleft()
                if self._stopping:
                    return None
                sleep = self._sleeping = time.monotonic() >= spin_end
            if sleep:       # one release (by whoever turns _sleeping off) per acquire
                self._bell.acquire()
                spin_end = time.monotonic() + SPIN_S
            else:
                time.sleep(0)                 # (yields the GIL and the CPU)
