"""The exceptions of shmtree (docs/design.md, "Errors")."""


class ShmtreeError(RuntimeError):
    """Base class of shmtree's errors."""


class CollectiveMismatchError(ShmtreeError, ValueError):
    """Ranks passed different shapes, dtypes or ops (or different collectives) to the same call."""


class PeerLostError(ShmtreeError):
    """A member of the group died, or the group was aborted (by an error or timeout elsewhere)."""


class CollectiveTimeoutError(ShmtreeError, TimeoutError):
    """This rank's `timeout=` ran out before the collective completed; the group is aborted."""


class WorkerError(ShmtreeError):
    """Raised by shmtree.run when a worker raised or died.

    Attributes: rank (the failing rank) and remote_traceback (the worker's formatted traceback,
    or a description of how it died)."""

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
