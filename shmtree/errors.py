"""The exceptions of shmtree (docs/design.md, "Errors").

Every error shmtree raises for a collective's failure is a `ShmtreeError` (a `RuntimeError`).
A local error - a bad dtype (`TypeError`), an unknown op, a mismatched `out` (`ValueError`) -
is raised before any communication and leaves the group usable.  After a timeout or a lost
peer the group is aborted, and every later call raises `PeerLostError` at once.
"""


class ShmtreeError(RuntimeError):
    """Base class of shmtree's errors (a `RuntimeError`).

    Raised as itself for a misuse the call cannot survive: a closed communicator, a
    communicator used in a forked child, a Pool's collective that stalls on idle members, a
    message whose peer left the group for good.

    Examples
    --------
    >>> import numpy as np, shmtree
    >>> def step(comm):
    ...     comm.close()
    ...     try:
    ...         comm.allreduce(np.ones(1))
    ...     except shmtree.ShmtreeError as exc:
    ...         return str(exc)
    >>> shmtree.run(step, 2)
    ['shmtree: this communicator is closed', 'shmtree: this communicator is closed']
    """


class CollectiveMismatchError(ShmtreeError, ValueError):
    """Ranks passed different shapes, dtypes or ops (or different collectives) to the same call.

    Also a `ValueError`.  Raised on every rank, naming what each rank passed; the group stays
    usable.

    Examples
    --------
    >>> import numpy as np, shmtree
    >>> def step(comm):
    ...     try:
    ...         comm.allreduce(np.ones(comm.rank + 1))     # shapes (1,) and (2,)
    ...     except shmtree.CollectiveMismatchError as exc:
    ...         said = str(exc).split(": rank 0")[0]
    ...     return said, comm.allreduce(np.ones(2)).tolist()   # still usable
    >>> shmtree.run(step, 2)
    [('shmtree: ranks disagree on the collective call', [2.0, 2.0]),
     ('shmtree: ranks disagree on the collective call', [2.0, 2.0])]
    """


class PeerLostError(ShmtreeError):
    """A member of the group died, or the group was aborted (by an error or timeout elsewhere).

    Every rank waiting in a collective raises it: within milliseconds of a death (a thread of
    each member process sleeps on its peers' pidfds and aborts the group when one it waits for
    exits), else at the end of an engine time slice (a tree neighbour checks every 20 ms), at
    most about a second later (every member is checked once a second).  A zombie counts as
    dead.  Once the group is aborted every later call raises it at once; ``agree`` and
    ``shrink`` still work (a communicator of the survivors).

    Examples
    --------
    >>> import os, shmtree
    >>> def step(comm):
    ...     if comm.rank == 1:
    ...         os._exit(3)                       # dies without a word
    ...     try:
    ...         comm.barrier()
    ...     except shmtree.PeerLostError:
    ...         return "lost"
    >>> shmtree.run(step, 2)
    Traceback (most recent call last):
        ...
    shmtree.errors.WorkerError: rank 1 failed: exited with code 3 without reporting a result
    """


class RevokedError(PeerLostError):
    """The communicator was revoked: by ``comm.revoke()`` on some rank, so every pending and
    later call on it fails on every rank.

    A `PeerLostError`: code that handles a lost peer handles a revocation the same way.  The
    message names the rank that revoked.  What still works on a revoked communicator:
    ``agree``, ``failed_ranks``, ``shrink`` and ``close`` (docs/design.md, "Survive").

    Examples
    --------
    >>> import shmtree
    >>> def step(comm):
    ...     comm.barrier()                        # (every rank has joined)
    ...     if comm.rank == 0:
    ...         comm.revoke()
    ...     try:
    ...         while True:
    ...             comm.barrier()
    ...     except shmtree.RevokedError as exc:
    ...         return type(exc).__name__, "rank 0 revoked" in str(exc)
    >>> shmtree.run(step, 2)
    [('RevokedError', True), ('RevokedError', True)]
    """


class CollectiveTimeoutError(ShmtreeError, TimeoutError):
    """This rank's `timeout=` ran out before the collective completed; the group is aborted.

    Also a `TimeoutError`.  Its message names the ranks that had not arrived; the other ranks
    then raise `PeerLostError`.

    Examples
    --------
    >>> import time, shmtree
    >>> def step(comm):
    ...     try:
    ...         if comm.rank == 1:
    ...             time.sleep(1.0)               # late
    ...         comm.barrier(timeout=0.2)
    ...     except shmtree.CollectiveTimeoutError:
    ...         return "timed out"
    ...     except shmtree.PeerLostError:
    ...         return "aborted"
    >>> shmtree.run(step, 2)
    ['timed out', 'aborted']
    """


class WorkerError(ShmtreeError):
    """Raised by shmtree.run when a worker raised or died.

    Also raised by `Pool.run`, and by ``Pool(...)`` when its initializer raised.  The message,
    ``"rank N failed: ..."``, names the root cause, not the other ranks' consequent errors.

    Parameters
    ----------
    rank : int
        The failing rank (across nodes: its global rank).
    message : str
        What happened (the exception's type and text, or how the process died).
    remote_traceback : str, optional
        The worker's formatted traceback, or a description of how it died.

    Attributes
    ----------
    rank : int
        The failing rank.
    remote_traceback : str
        The worker's formatted traceback, or a description of how it died.

    Examples
    --------
    >>> import shmtree
    >>> def step(comm):
    ...     if comm.rank == 1:
    ...         raise ValueError("bad input")
    ...     comm.barrier()
    >>> try:
    ...     shmtree.run(step, 2)
    ... except shmtree.WorkerError as exc:
    ...     print(exc.rank, exc)
    ...     print(exc.remote_traceback.splitlines()[-1])
    1 rank 1 failed: ValueError: bad input
    ValueError: bad input
    """

    def __init__(self, rank, message, remote_traceback=""):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return _rebuild_worker_error, (self.rank, str(self), self.remote_traceback)


def _rebuild_worker_error(rank, text, tb):
    err = WorkerError(rank, "", tb)
    err.args = (text,)
    return err
