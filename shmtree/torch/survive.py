"""Failures of a process group of backend "shmtree" (issue 38): abort(), the error state
torch's C++ backends give (get_error), and shrink_group's equivalent - torch 2.13's own
shrink_group takes C++ backends only (ProcessGroup._get_backend; a Python process group such as
this one has none), so the survivors make their group with new_group.

_Survive is a mixin of ProcessGroupShmtree (backend.py); failed_ranks and shrink_group are
shmtree.torch's.
"""
from __future__ import annotations

import torch.distributed as dist
import torch._C._distributed_c10d as _c10d

from ..codes import ABORT_TIMEOUT
from .options import BACKEND

__all__ = ["failed_ranks", "shrink_group"]


class _Survive:
    """abort, get_error, supports_shrinking (ProcessGroupShmtree's: self._comm, self._group,
    self._stopped, self._failure, shutdown)."""

    def abort(self):
        """Revoke the group - every pending and later operation of every rank fails at once
        (shmtree's comm.revoke(): a RuntimeError naming the rank that aborted) - and shut this
        rank's side down.  Never blocks on the other ranks."""
        try:
            if not self._comm._closed and not self._group.closed:
                self._comm.revoke()
        finally:
            self.shutdown()

    def get_error(self):
        """The group's error state, as torch's C++ backends give it (ErrorType): SUCCESS while
        it is healthy; TIMEOUT when this rank's operation timed out; REMOTE_ERROR when another
        rank died, failed, timed out or revoked the group; COMM_ERROR when this rank's own
        operation failed it, or the group is shut down."""
        E = _c10d.ErrorType
        if self._stopped or self._group.closed:
            return E.COMM_ERROR
        reason, who = self._group._seg.abort_state()
        if not reason:
            return E.SUCCESS if self._failure is None else E.COMM_ERROR
        mine = who == self._comm.rank
        if reason == ABORT_TIMEOUT:
            return E.TIMEOUT if mine else E.REMOTE_ERROR
        return E.COMM_ERROR if mine else E.REMOTE_ERROR

    @property
    def supports_shrinking(self):
        """False: torch's shrink_group works on C++ backends only (ProcessGroup._get_backend);
        use shmtree.torch.shrink_group, which makes the survivors' group with new_group."""
        return False


def failed_ranks(group=None, timeout=None):
    """The global ranks of `group` (default: the world) that are gone, as its surviving ranks
    agree on them (shmtree's comm.agree over the group's shmtree communicator: it works after
    a failure, and completes with the same answer on every survivor).  Every surviving rank
    of the group calls it.

    Parameters
    ----------
    group : ProcessGroup, optional
        A process group of backend "shmtree" (default: the default group).
    timeout : float, optional
        Seconds after which a rank that has not called it, and has not died, counts as gone.

    Returns
    -------
    list of int
        Global ranks, in order.
    """
    pg = _shmtree_pg(group)
    pg._comm.agree(True, timeout=timeout)
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    return [ranks[r] for r in pg._comm.failed_ranks()]


def shrink_group(group=None, timeout=None):
    """A new process group of the ranks of `group` that are alive: torch's shrink_group for
    the shmtree backend, without a restart (torch 2.13's own shrink_group needs a C++
    backend).  Every surviving rank calls it; the survivors agree on who they are
    (failed_ranks), then make their group with ``new_group(ranks, backend="shmtree",
    use_local_synchronization=True)`` (only its members take part).  The old group stays
    aborted: use the new one (``group=`` in every call) and destroy the old one.

    Parameters
    ----------
    group : ProcessGroup, optional
        A process group of backend "shmtree" (default: the default group).
    timeout : float, optional
        As failed_ranks'.

    Returns
    -------
    ProcessGroup
        The survivors' group (ranks renumbered in their old order).
    """
    gone = set(failed_ranks(group, timeout))
    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    return dist.new_group([r for r in ranks if r not in gone], backend=BACKEND,
                          use_local_synchronization=True)


def _shmtree_pg(group):
    """The ProcessGroupShmtree of `group` (the default group: None)."""
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, _Survive):
        raise TypeError(f"shmtree.torch: {group!r} is not a process group of backend "
                        f"{BACKEND!r}")
    return pg
