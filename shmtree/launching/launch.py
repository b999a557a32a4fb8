"""run: call a function on every rank of a new group, in new processes (SPMD).

run(fn, nprocs) creates the Group, starts one process per rank (fork, spawn or forkserver), each
joins and calls fn(comm, ...), and gathers their results by rank.  A worker that raises or dies
aborts the group; the others are stopped and WorkerError names the root cause.  Workers die with
the process that called run (shmtree.machine.liveness).

The start-method and pickling checks here (`_context`, `_check_picklable`) serve Pool as well.
"""
from __future__ import annotations

import difflib
import multiprocessing
import os
import signal
import time
import traceback
from multiprocessing import reduction

from ..codes import ABORT_DIED, ABORT_FAILED
from ..errors import PeerLostError, WorkerError
from ..groups import session
from ..groups.group import Group
from ..machine.liveness import die_with_parent, identity, start_parent_watch
from ..internode.multinode import refuse_proxy
from ..machine.plan import OPTIONS as _PLAN_OPTIONS

__all__ = ["run"]

RUN_GRACE_S = 5.0           # after a failure, how long the other workers get to report
GROUP_OPTIONS = _PLAN_OPTIONS + ("inter", "segment_bytes")     # what Group takes beyond size


def _check_options(who, given, valid):
    """Refuse keyword options that `who` does not take, before any process starts: name each,
    suggest the closest valid one (a misspelling), and list the valid options."""
    bad = [name for name in given if name not in valid]
    if not bad:
        return
    parts = []
    for name in bad:
        close = difflib.get_close_matches(name, valid, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(f"{who}: unknown option{'s' if len(bad) > 1 else ''} {', '.join(parts)}; "
                    f"valid options: {', '.join(valid)}")


def _check_args(who, fn, args, kwargs, fn_name="fn", args_name="args", kwargs_name="kwargs"):
    """The function and its arguments as run and Pool hand them on, checked in the caller:
    a wrong type would otherwise fail only inside every worker.  Returns (args, kwargs)."""
    if fn_name is not None and not callable(fn):
        raise TypeError(f"{who}: {fn_name} must be callable, got {fn!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"{who}: {args_name} must be a tuple of positional arguments, got "
                        f"{type(args).__name__} {args!r}; for a single argument write "
                        f"{args_name}=({args!r},)")
    if kwargs_name is None:
        return tuple(args), None
    if kwargs is None:
        kwargs = {}
    if not hasattr(kwargs, "keys") or not hasattr(kwargs, "__getitem__"):
        raise TypeError(f"{who}: {kwargs_name} must be a dict of keyword arguments, got "
                        f"{type(kwargs).__name__} {kwargs!r}")
    kwargs = dict(kwargs)
    wrong = [k for k in kwargs if not isinstance(k, str)]
    if wrong:
        raise TypeError(f"{who}: the keys of {kwargs_name} must be strings (argument names), "
                        f"got {wrong[0]!r}")
    return tuple(args), kwargs


def _context(context=None):
    """A multiprocessing context from None (fork where the platform has it), a start-method name
    ("fork", "spawn", "forkserver") or a context object."""
    if context is None:
        methods = multiprocessing.get_all_start_methods()
        context = "fork" if "fork" in methods else methods[0]
    if isinstance(context, str):
        context = multiprocessing.get_context(context)    # ValueError names the valid methods
    if not hasattr(context, "get_start_method"):
        raise TypeError(f"shmtree: context must be a start method name or a multiprocessing "
                        f"context, got {context!r}")
    if context.get_start_method() == "forkserver":
        _preload_in_forkserver(context)
    return context


def _preload_in_forkserver(ctx):
    """Have the fork server import shmtree (with numpy) once, before it forks its first worker,
    so that a forkserver worker starts in milliseconds instead of importing both afresh
    (forkserver is multiprocessing's default from Python 3.14 on).  A server already running
    keeps what it preloaded; the modules asked for so far (multiprocessing's default:
    __main__) are kept."""
    import multiprocessing.forkserver as forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is not None:
        return
    modules = list(getattr(server, "_preload_modules", ["__main__"]))
    if "shmtree" not in modules:
        ctx.set_forkserver_preload(modules + ["shmtree"])


def _refuse_inter(inter, exc):
    """A launcher of several (inter=) whose call fails its own checks before its group exists:
    the other launchers wait to agree with it on starting; they raise too, naming this node."""
    if inter is not None:
        refuse_proxy(inter, exc)


def _check_picklable(who, ctx, **things):
    """Under spawn and forkserver everything a worker gets is pickled (ctx None: pickled whatever
    the start method, as pool tasks are): say so clearly, with the remedy, before any process
    starts (pickle's own error surfaces late and says neither)."""
    method = None if ctx is None else ctx.get_start_method()
    if method == "fork":
        return
    for name, value in things.items():
        try:
            reduction.ForkingPickler.dumps(value)
        except Exception as exc:
            how = ("pool tasks are pickled whatever the start method" if method is None else
                   f"under {method!r} everything a worker gets is pickled")
            raise TypeError(f"{who}: cannot send {name} to the workers ({exc}); {how}: functions "
                            f"must be defined at module level (not a lambda or a local function) "
                            f"and arguments picklable"
                            + ("" if method is None else "; or use the 'fork' start method")
                            ) from exc


class no_mpi_init:
    """Starting the workers of a node of several (inter=) with spawn or forkserver: a new
    interpreter imports the program's main module again, and with it mpi4py, which would
    initialise MPI there (and fail: the worker is no MPI process).  mpi4py reads its rc options
    from the environment (MPI4PY_RC_INITIALIZE): set it while the worker starts."""

    def __init__(self, group, ctx):
        self.on = group._span is not None and ctx.get_start_method() != "fork"

    def __enter__(self):
        if self.on:
            self.old = os.environ.get("MPI4PY_RC_INITIALIZE")
            os.environ["MPI4PY_RC_INITIALIZE"] = "0"

    def __exit__(self, *exc):
        if self.on:
            if self.old is None:
                os.environ.pop("MPI4PY_RC_INITIALIZE", None)
            else:
                os.environ["MPI4PY_RC_INITIALIZE"] = self.old


def _run_worker(group, rank, fn, args, kwargs, conn, parent=None, shrink=False):
    die_with_parent()
    if parent is not None:
        start_parent_watch(parent)
    comm = None
    try:
        if shrink:                          # (a rank that died before this one joined revoked
            group._join_lost = True         # the group: join it all the same, and shrink)
        comm = group.join(rank)
        result = fn(comm, *args, **kwargs)
        if session._current is not comm and session._usable(session._current):
            session._current.close()            # (the one comm.shrink() made)
        conn.send((True, result))
    except BaseException as exc:
        report = (type(exc).__name__, str(exc), traceback.format_exc(),
                  isinstance(exc, PeerLostError))
        if not group.closed and not group.aborted():
            group.abort(ABORT_FAILED, rank, note=f"fn raised {type(exc).__name__}: {exc}")
        try:
            conn.send((False, report))
        except Exception:
            pass
    finally:
        if comm is not None:
            comm.close()
        conn.close()


def run(fn, nprocs, *, args=(), kwargs=None, start_method=None, on_failure="raise",
        **group_options):
    """Call ``fn(comm, *args, **kwargs)`` in `nprocs` new processes; their return values by rank.

    SPMD: one new process per rank (fork by default), each joins a new `Group` and calls `fn`
    with its `Communicator`; `run` returns when every worker has returned.  The arguments are
    checked before any process starts.  Workers die with the process that called `run`.

    Parameters
    ----------
    fn : callable
        ``fn(comm, *args, **kwargs)``, run on every rank.  Under spawn and forkserver it must be
        a module-level function (a lambda gets a `TypeError` before any process starts).
    nprocs : int
        The number of ranks (processes).  With `inter` (a launcher per node): this node's
        workers.
    args : tuple, default ()
        Positional arguments after `comm` (``args=5`` is refused: write ``args=(5,)``).
    kwargs : dict, optional
        Keyword arguments of `fn`.
    start_method : {"fork", "spawn", "forkserver"} or multiprocessing context, optional
        How the workers start; fork where the platform has it.
    on_failure : {"raise", "shrink"}, default "raise"
        What a worker that dies does to the others.  "raise": the group is aborted, the other
        workers are stopped and `run` raises `WorkerError`.  "shrink": the others go on (the
        communicator is revoked: their calls on it raise `PeerLostError`, and ``comm.shrink()``
        gives them a communicator of the survivors); `run` returns their results, with a
        `WorkerError` in the place of each rank that died.  A worker whose `fn` raises fails
        the run either way.
    **group_options
        Options of `Group` (``tree``, ``chunk_bytes``, ``pin``, ``topology``, ...;
        ``inter=mpi_comm`` makes this process its node's launcher of a communicator across
        nodes).

    Returns
    -------
    list
        ``fn``'s return value on each rank, by rank.

    Raises
    ------
    TypeError
        An unknown option (named, with the closest valid one), `args` not a tuple, `kwargs` not
        a dict, `fn` not callable, or something that cannot be pickled for spawn / forkserver.
        Raised before any process starts.
    WorkerError
        A worker raised or died: the group is aborted, the other workers are stopped, and the
        error names the rank that failed first (the root cause, not the other ranks'
        consequent errors), with its traceback (``remote_traceback``).

    See Also
    --------
    Pool : a persistent pool of workers that form one group.
    Group : bring your own processes.

    Examples
    --------
    >>> import numpy as np, shmtree
    >>> def step(comm, scale):
    ...     return float(comm.allreduce(np.ones(4) * scale).sum())
    >>> shmtree.run(step, 2, args=(1.5,))
    [12.0, 12.0]
    >>> shmtree.run(step, 2, args=1.5)
    Traceback (most recent call last):
        ...
    TypeError: shmtree.run: args must be a tuple ...; for a single argument write args=(1.5,)
    """
    try:
        _check_options("shmtree.run", group_options,
                       ("args", "kwargs", "start_method") + GROUP_OPTIONS + ("on_failure",))
        if on_failure not in ("raise", "shrink"):
            raise ValueError(f"shmtree.run: on_failure must be 'raise' or 'shrink', got "
                             f"{on_failure!r}")
        if on_failure == "shrink" and group_options.get("inter") is not None:
            raise ValueError("shmtree.run: on_failure='shrink' is not supported across nodes "
                             "(inter=): shrink there needs MPI's ULFM interface")
        args, kwargs = _check_args("shmtree.run", fn, args, kwargs)
        ctx = _context(start_method)
        _check_picklable("shmtree.run", ctx, fn=fn, args=args, kwargs=kwargs)
    except Exception as exc:
        _refuse_inter(group_options.get("inter"), exc)
        raise
    me = identity()
    with Group(nprocs, **group_options) as group:
        procs, conns = [], []
        try:
            for r in range(group.size):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_run_worker,
                                args=(group, r, fn, args, kwargs, send, me,
                                      on_failure == "shrink"),
                                name=f"shmtree-rank-{r}")
                with no_mpi_init(group, ctx):
                    p.start()
                send.close()
                procs.append(p)
                conns.append(recv)
            return _collect(group, procs, conns, on_failure == "shrink")
        finally:
            _stop(procs)
            for c in conns:
                c.close()


def _collect(group, procs, conns, shrink=False):
    """Wait for every worker's report; raise WorkerError for the first root-cause failure (an
    exception other than PeerLostError, or a death), else for the first failure seen.  With
    `shrink`, a worker that dies revokes the group (ABORT_DIED) and the others go on: its
    place in the results holds a WorkerError."""
    from multiprocessing.connection import wait

    n = len(procs)
    results, failures = [None] * n, []
    listening = set(range(n))           # ranks whose pipe may still bring a report
    reported = [False] * n
    running = set(range(n))
    failed_at = None
    died = []                           # (shrink: the workers that died, in order)
    while running:
        waitables = [conns[r] for r in listening] + [procs[r].sentinel for r in running]
        ready = wait(waitables, timeout=0.2 if not died or group.aborted() else 0.002)
        for r in list(listening):
            if conns[r] in ready:
                listening.discard(r)
                try:
                    ok, payload = conns[r].recv()
                except (EOFError, OSError):
                    continue                     # closed without a report: see its exit
                reported[r] = True
                if ok:
                    results[r] = payload
                else:
                    name, text, tb, lost = payload
                    failures.append((lost, r, f"{name}: {text}", tb))
        for r in list(running):
            if procs[r].sentinel in ready and r not in listening:
                procs[r].join()
                running.discard(r)
                if not reported[r]:
                    if shrink:
                        results[r] = WorkerError(group.global_rank(r),
                                                 _death(procs[r].exitcode))
                        died.append(r)
                        continue
                    failures.append((False, r, _death(procs[r].exitcode), ""))
        if died and not group.aborted() and all(
                group.member(r)[0] or r in died or r not in running for r in range(n)):
            group.abort(ABORT_DIED, died[0])    # (revoked at once, waiters woken; once every
                                                # worker has joined: a revoked group refuses
                                                # to be joined)
        if failures and failed_at is None:
            failed_at = time.monotonic()
            group.abort(ABORT_FAILED, failures[0][1])
        if failed_at is not None and time.monotonic() > failed_at + RUN_GRACE_S:
            break                                # the rest are stopped by run's finally
    if failures:
        lost, r, text, tb = sorted(failures, key=lambda f: f[0])[0]   # root causes first
        raise WorkerError(group.global_rank(r), text, tb or text)
    if shrink and all(isinstance(x, WorkerError) for x in results):
        raise results[0]                         # (every worker died)
    return results


def _death(exitcode):
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"died from {name} (exit code {exitcode})"
    return f"exited with code {exitcode} without reporting a result"


def _stop(procs):
    """Terminate workers that are still alive, then kill the ones that ignore it."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()

