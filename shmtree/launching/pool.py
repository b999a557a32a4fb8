"""Pool: a multiprocessing.pool.Pool whose workers form one shmtree group.

Each worker joins once, with its own rank, as it starts (`_pool_worker_init`), then runs tasks
that use the module-level calls.  Around that:
  - tasks: every task is wrapped (`_Task`, `_run_as_task`) so the member is marked busy while it
    runs and idle between tasks (what the stall check of shmtree.communicators.communicator looks for), and a
    task that raises while other members wait for it in a collective aborts the group in its
    words; map and friends deal tasks one at a time; `pool.run` is SPMD on the workers;
  - the watch thread (parent side): once the group is aborted, every outstanding job fails with
    PeerLostError naming the cause (multiprocessing does not notice a dead worker);
  - the multiprocessing.pool internals this needs, in one section of their own (below).
"""
from __future__ import annotations

import multiprocessing.pool
import signal
import threading
import time
import traceback
import weakref

from ..machine import plan as _plan
from ..groups import session
from . import heal
from ..codes import (ABORT_DIED, ABORT_INIT, ABORT_MEMBERSHIP, ABORT_TASK, KIND_NAMES, ST_BUSY,
                    ST_IDLE, ranks_text)
from ..errors import PeerLostError, ShmtreeError, WorkerError
from ..groups.group import Group
from .launch import (GROUP_OPTIONS, _check_args, _check_options, _check_picklable,
                     _context, _refuse_inter, no_mpi_init)
from ..machine.liveness import identity, start_parent_watch
from ..machine.plan import usable_count

__all__ = ["Pool"]

POOL_WATCH_S = 0.05         # how often the parent's watch thread looks at the group
POOL_LOCK_S = 5.0           # terminate(): how long to wait for the task queue's read lock
POOL_START_S = 60.0         # how long Pool() waits for its workers to join before it returns


# ---------------------------------------------------------------------------------------------
# the parent side: the watch thread


def _watch_pool(pool_ref, group, stop):
    """Parent side of a Pool: once the group is aborted (a member died, timed out or failed),
    fail every outstanding job with PeerLostError naming the cause.  Without this, a job given
    to a worker that died would never complete (multiprocessing.Pool does not notice).  Ends
    when `stop` is set (the pool is done: no thread of it is left for a later fork to copy)."""
    while not stop.wait(POOL_WATCH_S):
        pool = pool_ref()
        if pool is None or group.closed:
            return
        if group.aborted():
            _fail_jobs(pool, PeerLostError(f"shmtree.Pool: {_pool_failure(group)}"))
        del pool


def _pool_failure(group) -> str:
    for r in range(group.size):
        how = group.death_of(r)
        if how:
            return f"rank {r} failed: died ({how}); the group is aborted"
    return group.describe_abort()


# ---------------------------------------------------------------------------------------------
# the worker side: joining, tasks


def _pool_worker_init(group, initializer, initargs, parent, heals=None):
    """A Pool worker's start: take the next rank, join, run the user's initializer.  A worker
    whose initializer raises aborts the group in its own words and stays alive (one that exited
    would be replaced, and its replacement fail the same way, over and over)."""
    # (no PDEATHSIG here: it follows the *thread* that forked the worker, and the pool forks
    # replacements from a handler thread that exits at terminate(), which would kill a worker
    # holding the task queue's lock; the watch thread follows the pool's process instead)
    # Pool.terminate() stops workers with SIGTERM and waits for them: a Python-level SIGTERM
    # handler inherited from the parent runs only in the main thread, which may sit blocked on
    # the task queue while the signal lands in the watch thread, and terminate() then waits for
    # ever.  A worker dies on SIGTERM, as multiprocessing's own workers do.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    start_parent_watch(parent)
    if heals is not None:                      # on_failure="shrink" | "respawn": heal.py
        return heal.worker_start(*heals, initializer, initargs)
    session._set_pool_group(group)
    rank = group.claim_rank()
    if rank >= group.size:
        # a replacement for a worker that died: the group lost a member for good
        dead = [r for r in range(group.size) if group.death_of(r)]
        if dead:
            group.abort(ABORT_DIED, dead[0])
        else:
            group.abort(ABORT_MEMBERSHIP, -1)
        return
    group.join(rank)
    if initializer is not None:
        try:
            initializer(*initargs)
        except BaseException as exc:
            group.abort(ABORT_INIT, rank, note=f"the Pool's initializer raised on rank {rank}: "
                                               f"{type(exc).__name__}: {exc}")
            return
    group._seg.set_state(rank, ST_IDLE)


def _run_as_task(fn, args, kwargs):
    """Run one pool task in a worker: the member is busy while it runs (idle members are what
    the stall detector looks for), and a task that raises while other members wait for this one
    in a collective aborts the group, saying why, instead of leaving them waiting.  (In a pool
    that heals, heal.task_scope first moves the worker to the pool's current group.)"""
    with heal.task_scope():
        return _run_in_group(fn, args, kwargs)


def _run_in_group(fn, args, kwargs):
    comm = session._current
    comm = getattr(comm, "local", comm)       # (across nodes: this node's communicator)
    if comm is None or comm._closed or comm.group.closed or comm._gen != session._fork_gen:
        return fn(*args, **kwargs)
    seg, r = comm._seg, comm.rank
    seg.set_state(r, ST_BUSY)
    if not seg.abort_state()[0]:
        seg.set_note(r, b"")                  # this rank's last task has not raised (yet)
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        _task_raised(comm, exc)
        raise
    finally:
        if not comm.group.closed:
            seg.set_state(r, ST_IDLE)


def _task_raised(comm, exc):
    group, seg, r = comm.group, comm._seg, comm.rank
    if group.closed or group.aborted():
        return
    text = f"rank {r}'s task raised {type(exc).__name__}: {exc}"
    seg.set_note(r, text.encode("utf-8", "replace"))    # for a stall report, if one comes
    mine = seg.completed(r)
    waiting = [s for s in range(comm.size) if s != r and seg.call_of(s) > mine]
    if waiting:
        seq = seg.call_of(waiting[0]) - 1
        kind = KIND_NAMES.get(seg.descriptor(waiting[0], seq)[2], "collective")
        group.abort(ABORT_TASK, r, note=f"{text}, while {ranks_text(waiting)} waited for it "
                                        f"in {kind} #{seq + 1}")


class _Task:
    """A user's task function as the pool sends it (see _run_as_task)."""

    def __init__(self, fn):
        if not callable(fn):
            raise TypeError(f"shmtree.Pool: a task must be callable, got {fn!r}")
        _check_picklable("shmtree.Pool", None, task=fn)
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return _run_as_task(self.fn, args, kwargs)


def _spmd_task(fn, args, kwargs):
    """One worker's part of Pool.run: a barrier first (a worker that took its task cannot take
    another before every worker has one), then fn(comm, ...).  Returns (rank, ok, payload); a
    failure's payload ranks how likely it is the root cause: 0 the task's own exception, 1 a
    shmtree error this rank found (a stall, a peer gone), 2 the group aborted elsewhere."""
    with heal.task_scope():                    # (a pool that heals: heal.py)
        return _spmd_part(fn, args, kwargs)


def _spmd_part(fn, args, kwargs):
    comm = session.current()
    r = getattr(comm, "local", comm).rank     # (this node's rank, across nodes)
    try:
        comm.barrier()
        return r, True, _run_as_task(fn, (comm,) + tuple(args), kwargs)
    except BaseException as exc:
        cause = 2 if isinstance(exc, PeerLostError) else 1 if isinstance(exc, ShmtreeError) else 0
        return r, False, (type(exc).__name__, str(exc), traceback.format_exc(), cause)


# =============================================================================================
# multiprocessing.pool internals.  Everything in this section (and nothing else in shmtree)
# relies on private members of multiprocessing.pool; checked against CPython 3.9 to 3.13
# (pyproject.toml: requires-python >= 3.9).  Check this list against a new Python's
# multiprocessing/pool.py before claiming support for it:
#   Pool._state = INIT           Pool.__del__ reads it, even when __init__ failed early
#   Pool._pool                   the worker processes (workers that die while the pool starts)
#   Pool._cache                  outstanding jobs by id: ApplyResult / MapResult (_success,
#                                _value, _event, MapResult._number_left) and IMapIterator
#                                (_cond, _items), completed with an error by _fail_jobs
#   Pool._map_async(func, iterable, mapper, chunksize, callback, error_callback)
#                                where map, map_async, starmap and starmap_async all go
#   Pool._help_stuff_finish(inqueue, task_handler, size)   (static; inqueue._rlock, ._reader)
#                                called by terminate() to drain the task queue
#   Pool._setup_queues           makes _inqueue, _outqueue, _quick_put, _quick_get (a pool
#                                that heals makes its own task queue, heal.TaskQueue)
#   Pool.Process(ctx, ...)       what the worker handler starts a worker with (a shrinking
#                                pool: heal.Vacant places), and multiprocessing.pool.worker's
#                                locals job and i (heal._task_ids: the task a worker runs)
#   Pool._task_handler, Pool._worker_handler (threads with a ._state: RUN / TERMINATE),
#   Pool._change_notifier, Pool._outqueue._wlock
#                                the handlers' last steps, before terminate() kills workers


def _fail_jobs(pool, exc):
    """Complete the pool's outstanding jobs with `exc` (late results of those jobs are dropped
    by the pool's result handler, which ignores jobs no longer in its cache)."""
    from multiprocessing.pool import ApplyResult, IMapIterator, MapResult

    for job_id, job in list(pool._cache.items()):
        if isinstance(job, ApplyResult):              # MapResult too
            job._success, job._value = False, exc
            if isinstance(job, MapResult):
                job._number_left = 0
            pool._cache.pop(job_id, None)
            job._event.set()
        elif isinstance(job, IMapIterator):
            with job._cond:
                job._items.append((False, exc))
                pool._cache.pop(job_id, None)
                job._cond.notify()


class _PoolInternals(multiprocessing.pool.Pool):
    """The overrides of multiprocessing.pool.Pool's private members (see above).  Subclasses
    provide _shm_task(func): the task the pool sends for a user's function."""

    def _mark_starting(self):
        self._state = multiprocessing.pool.INIT       # multiprocessing's __del__ reads it

    def _worker_processes(self):
        return [p for p in self._pool if p.pid is not None]     # (not heal.Vacant places)

    def _setup_queues(self):
        if getattr(self, "_shm_heals", None) is None:
            return super()._setup_queues()
        # a pool that heals: its workers wait for a task without holding the task queue's read
        # lock (heal.TaskQueue), and say when they hold the result queue's write lock
        # (heal.ResultQueue), so that a worker killed while idle or sending a result does not
        # keep either from the others (multiprocessing's _setup_queues, with those queues)
        self._inqueue = heal.TaskQueue(ctx=self._ctx)
        self._outqueue = heal.ResultQueue(ctx=self._ctx)
        self._quick_put = self._inqueue._writer.send
        self._quick_get = self._outqueue._reader.recv

    def _map_async(self, func, iterable, mapper, chunksize=None, callback=None,
                   error_callback=None):
        # map, map_async, starmap and starmap_async all come here: one task at a time
        return super()._map_async(self._shm_task(func), iterable, mapper,
                                  1 if chunksize is None else chunksize, callback,
                                  error_callback)

    @staticmethod
    def _help_stuff_finish(inqueue, task_handler, size):
        """multiprocessing's, except that a worker killed while it held the task queue's read
        lock (idle, waiting for a task) cannot make terminate() hang: give up draining."""
        if not inqueue._rlock.acquire(timeout=POOL_LOCK_S):
            return
        while task_handler.is_alive() and inqueue._reader.poll():
            inqueue._reader.recv()
            time.sleep(0)


    def _finish_task_handler(self):
        """Let the task handler send its last sentinels while the workers still live, before
        terminate() kills them: a worker killed while it held the result queue's write lock
        (sending a result) would leave the task handler's last put blocked for good, and
        terminate(), which joins it, with it.  Told to stop, the worker handler puts the task
        queue's sentinel; the task handler then sends its own and ends.  If it is still
        blocked after POOL_LOCK_S and a worker has died (the group is aborted: killed while
        it sent a result, the lock's holder is gone), the lock is released for it."""
        th = getattr(self, "_task_handler", None)
        wh = getattr(self, "_worker_handler", None)
        if th is None or wh is None or not th.is_alive():
            return
        th._state = wh._state = multiprocessing.pool.TERMINATE
        self._change_notifier.put(None)
        wh.join(POOL_LOCK_S)
        th.join(POOL_LOCK_S)
        group = self._shm_group
        if th.is_alive() and ((group is not None and not group.closed and group.aborted())
                              or any(p.exitcode is not None for p in list(self._pool))):
            try:
                self._outqueue._wlock.release()
            except ValueError:                # (not held after all)
                pass
            th.join(POOL_LOCK_S)


# end of the multiprocessing.pool internals
# =============================================================================================
# Pool


class Pool(_PoolInternals):
    """A multiprocessing Pool whose `processes` workers form one shmtree group.

    Each worker joins the group once, with its own rank, at start.  Tasks (`map`, `starmap`,
    `imap` and the async forms) use the module-level calls (``shmtree.allreduce``,
    ``shmtree.rank()``, ...) and are dealt one at a time (chunksize 1 unless given), so any
    multiple of `processes` tasks that each make the same collectives works.
    ``pool.run(fn, *args)`` calls ``fn(comm, *args)`` once on every worker (SPMD).

    Never a silent hang: a collective that cannot complete because members are idle (no task)
    or finished their task without making it fails on the waiting members after
    `stall_timeout` seconds, with a `ShmtreeError` naming the waiting and the idle ranks and
    the collective's number; a task that raises while others wait for it makes them fail at
    once, with its exception in the message; a worker that dies fails the outstanding jobs with
    `PeerLostError`.  After any of these the pool is broken: later calls raise
    `PeerLostError` - unless it heals (``on_failure="shrink"`` or ``"respawn"``): then only
    the tasks the failure reached fail, and the later ones run in a new group.

    Parameters
    ----------
    processes : int, optional
        The number of workers (ranks); default: the usable cores (the CPU mask within the
        cgroup's quota).
    initializer : callable, optional
        Called as ``initializer(*initargs)`` in each worker, after it joined.  One that raises
        makes ``Pool(...)`` raise `WorkerError` naming the rank, once (no loop of respawned
        workers).
    initargs : tuple, default ()
        Arguments of `initializer`.
    context : {"fork", "spawn", "forkserver"} or multiprocessing context, optional
        How the workers start; fork where the platform has it.
    stall_timeout : float, default 10.0
        Seconds a member waits in a collective while members that have not made it are idle.
    on_failure : {"raise", "shrink", "respawn"}, default "raise"
        What a worker that dies (or a group that is aborted) does to the pool.  "raise": the
        pool is broken, later calls raise `PeerLostError`.  "shrink": the pool goes on with
        the survivors, in a new group of their number (renumbered in their old order).
        "respawn": a new worker takes the dead one's place (and runs the initializer) in a new
        group of the same size.  Either way the task the dead worker ran fails with
        `PeerLostError` naming its rank (and so do the tasks that waited for it in a
        collective), and the later tasks run in the new group.
    **group_options
        Options of `Group` (``tree``, ``chunk_bytes``, ``inter=``, ...).

    Raises
    ------
    TypeError
        An unknown option (``maxtasksperchild`` is refused: a worker is a rank for the pool's
        whole life), an `initializer` that is not callable, `initargs` not a tuple, or
        something that cannot be pickled.  Raised before any process starts.
    WorkerError
        The `initializer` raised in a worker.
    PeerLostError
        A worker failed while the pool started.

    See Also
    --------
    run : SPMD on new processes.

    Notes
    -----
    ``Pool(...)`` returns once every worker has joined and run the initializer.  Tasks are
    pickled whatever the start method, so a task must be a module-level function.

    Examples
    --------
    >>> import numpy as np, shmtree
    >>> def task(i):                 # in a worker: the module-level calls
    ...     return float(shmtree.allreduce(np.ones(3) * shmtree.rank()).sum())
    >>> def step(comm, scale):
    ...     return comm.rank * scale
    >>> with shmtree.Pool(2) as pool:
    ...     print(pool.map(task, range(4)))       # two rounds of one task per worker
    ...     print(pool.run(step, 10))
    [3.0, 3.0, 3.0, 3.0]
    [0, 10]
    """

    def __init__(self, processes=None, *, initializer=None, initargs=(), context=None,
                 stall_timeout=_plan.DEFAULT_STALL_TIMEOUT, on_failure="raise",
                 **group_options):
        self._mark_starting()
        self._shm_group = self._shm_heals = self._shm_healer = None
        try:
            if on_failure not in ("raise", "shrink", "respawn"):
                raise ValueError(f"shmtree.Pool: on_failure must be 'raise', 'shrink' or "
                                 f"'respawn', got {on_failure!r}")
            if on_failure != "raise":
                if group_options.get("inter") is not None:
                    raise ValueError(f"shmtree.Pool: on_failure={on_failure!r} is not supported "
                                     "across nodes (inter=): a new group there needs MPI's "
                                     "ULFM interface")
                self._shm_heals = on_failure
            if "maxtasksperchild" in group_options:
                raise TypeError("shmtree.Pool: maxtasksperchild is not supported: each worker "
                                "is a rank of the group for the pool's whole life (a worker "
                                "that exits takes its rank with it)")
            _check_options("shmtree.Pool", group_options,
                           ("processes", "initializer", "initargs", "context") + GROUP_OPTIONS
                           + ("on_failure",))
            if initializer is not None and not callable(initializer):
                raise TypeError(f"shmtree.Pool: initializer must be callable, got "
                                f"{initializer!r}")
            initargs, _ = _check_args("shmtree.Pool", None, initargs, None, fn_name=None,
                                      args_name="initargs", kwargs_name=None)
            ctx = _context(context)
            _check_picklable("shmtree.Pool", ctx, initializer=initializer, initargs=initargs)
        except Exception as exc:
            _refuse_inter(group_options.get("inter"), exc)
            raise
        self._shm_group = Group(usable_count() if processes is None else processes,
                                stall_timeout=stall_timeout, **group_options)
        try:
            parent = identity()
            initial = (self._shm_group, initializer, tuple(initargs), parent)
            if self._shm_heals is not None:
                self._shm_healer = heal.Healer(self._shm_heals, self._shm_group,
                                               dict(group_options, stall_timeout=stall_timeout))
                initial = (None, initializer, tuple(initargs), parent,
                           (self._shm_healer.control, self._shm_heals))
                self.Process = heal.Starter(weakref.ref(self))    # (shrink: no replacements)
            with no_mpi_init(self._shm_group, ctx):
                super().__init__(self._shm_group.size, _pool_worker_init, initial, context=ctx)
        except BaseException:
            if self._shm_healer is not None:
                self._shm_healer.close()
            self._shm_group.close()
            raise
        self._shm_stop = threading.Event()
        if self._shm_healer is not None:
            weakref.finalize(self, self._shm_healer.close)
            self._shm_watch = threading.Thread(target=heal.watch_pool,
                                               args=(weakref.ref(self), self._shm_healer,
                                                     self._shm_stop, _fail_jobs, POOL_WATCH_S),
                                               name="shmtree-pool-heal", daemon=True)
        else:
            weakref.finalize(self, Group.close, self._shm_group)
            self._shm_watch = threading.Thread(target=_watch_pool,
                                               args=(weakref.ref(self), self._shm_group,
                                                     self._shm_stop),
                                               name="shmtree-pool-watch", daemon=True)
        self._shm_watch.start()
        try:
            self._await_workers()
        except BaseException:
            self.terminate()
            raise
        self._shm_started = True

    def _await_workers(self):
        """Return once every worker has joined and run the initializer; raise if one failed (the
        initializer's exception, once), or if workers die while starting (each replacement
        would die the same way)."""
        group = self._shm_group
        seg, n = group._seg, group.size
        seen, deadline = set(), time.monotonic() + POOL_START_S
        while True:
            reason, who = seg.abort_state()
            if reason == ABORT_INIT:
                note = seg.note(who)
                raise WorkerError(who, note.split(": ", 1)[-1], note)
            if reason:
                raise PeerLostError(f"shmtree.Pool: a worker failed while the pool started: "
                                    f"{_pool_failure(group)}")
            if all(seg.state(r) == ST_IDLE for r in range(n)) or time.monotonic() > deadline:
                return
            procs = self._worker_processes()
            seen.update(p.pid for p in procs)
            if len(seen) > n:
                codes = sorted({p.exitcode for p in procs if p.exitcode is not None} or {"?"})
                raise ShmtreeError(f"shmtree.Pool: workers die while starting ({len(seen)} "
                                   f"processes started for {n} ranks; exit codes "
                                   f"{', '.join(map(str, codes))}): see their output above")
            time.sleep(0.005)

    @property
    def group(self) -> Group:
        """The pool's `Group`."""
        return self._shm_group

    def _check_group(self):
        healer = self._shm_healer
        if healer is not None:                  # (a pool that heals: broken once none is left)
            if healer.broken is not None:
                raise PeerLostError(f"shmtree.Pool: the pool is broken: {healer.broken}")
            return
        if self._shm_group is not None and self._shm_group.aborted():
            raise PeerLostError(f"shmtree.Pool: the pool is broken: "
                                f"{_pool_failure(self._shm_group)}")

    # ---- tasks: dealt one at a time, each marked busy while it runs ----

    # (map, map_async, starmap and starmap_async: see _PoolInternals._map_async)

    def _shm_task(self, func):
        """The pool's task for a user's function (refused once the pool is broken)."""
        self._check_group()
        return _Task(func)

    def apply_async(self, func, args=(), kwds={}, callback=None, error_callback=None):
        return super().apply_async(self._shm_task(func), args, kwds, callback, error_callback)

    def imap(self, func, iterable, chunksize=1):
        return super().imap(self._shm_task(func), iterable, chunksize)

    def imap_unordered(self, func, iterable, chunksize=1):
        return super().imap_unordered(self._shm_task(func), iterable, chunksize)

    def run(self, fn, *args, **kwargs) -> list:
        """Call ``fn(comm, *args, **kwargs)`` once on every worker; the results by rank.

        SPMD, as `shmtree.run` does on new processes, but on the pool's workers and communicator.

        Parameters
        ----------
        fn : callable
            A module-level function (it is pickled), called as ``fn(comm, *args, **kwargs)``.
        *args, **kwargs
            Its further arguments.

        Returns
        -------
        list
            ``fn``'s return value on each worker, by rank.

        Raises
        ------
        TypeError
            `fn` is not callable.
        WorkerError
            `fn` raised on some rank: the error names the root cause, as `shmtree.run`'s does.
        PeerLostError
            The pool is broken (a worker died, a stall, a task that raised while others waited).

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     return comm.allreduce(np.array([comm.rank + 1])).tolist()
        >>> with shmtree.Pool(2) as pool:
        ...     pool.run(step)
        [[3], [3]]
        """
        if not callable(fn):
            raise TypeError(f"shmtree.Pool.run: fn must be callable, got {fn!r}")
        self._check_group()
        n = self._shm_group.size
        jobs = [super(Pool, self).apply_async(_spmd_task, (fn, args, kwargs)) for _ in range(n)]
        results, failures = [None] * n, []
        for job in jobs:
            try:
                r, ok, payload = job.get()
            except PeerLostError:
                continue                     # failed by the watch thread: the abort says why
            if ok:
                results[r] = payload
            else:
                name, text, tb, cause = payload
                failures.append((cause, r, f"{name}: {text}", tb))
        roots = sorted(f for f in failures if f[0] < 2)      # the task's own exceptions first
        at = self._shm_group.global_rank
        if roots:
            cause, r, text, tb = roots[0]
            raise WorkerError(at(r), text, tb)
        self._check_group()                  # every failure was a consequence: say its cause
        if failures:
            cause, r, text, tb = failures[0]
            raise WorkerError(at(r), text, tb)
        return results

    def terminate(self):
        try:
            self._finish_task_handler()
            super().terminate()
        finally:
            self._shm_done()

    def join(self):
        super().join()
        self._shm_done()

    def _shm_done(self):
        """Close the group and end the watch thread (a fork after the pool, as run's, copies no
        thread of it: Python >= 3.12 warns of forking a process with threads)."""
        if self._shm_healer is not None:
            self._shm_healer.close()
        if self._shm_group is not None:
            self._shm_group.close()
        watch = getattr(self, "_shm_watch", None)
        if watch is not None:
            self._shm_stop.set()
            if watch is not threading.current_thread():
                watch.join(POOL_LOCK_S)
