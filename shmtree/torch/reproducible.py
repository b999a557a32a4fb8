"""The backend's reproducible reductions (issue 37; docs/guide/torch.md, "Reproducible
reductions"): a process group's mode, and the calls an operation makes in it.

    "default"        the plain calls;
    "deterministic"  every reduction with deterministic=True (the op in rank order);
    "reproducible"   all_reduce SUM / AVG of floats as an exact sum (the Accumulator of every
                     rank's tensor), every other reduction deterministic.

The mode is the environment variable SHMTREE_TORCH_REDUCTION's when a group is made (every rank
must have the same: a rank in another mode makes every rank's operation fail, the ranks
disagreeing on the call), or set_reduction()'s afterwards.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..frontend import calls
from ..accumulator import Accumulator

__all__ = ["REDUCTION_ENV", "REDUCTIONS", "set_reduction", "reduction", "communicator"]

REDUCTION_ENV = "SHMTREE_TORCH_REDUCTION"
REDUCTIONS = ("default", "deterministic", "reproducible")


def _reduction_mode(mode, what):
    if mode not in REDUCTIONS:
        raise ValueError(f"shmtree: {what}: the reduction mode must be one of "
                         f"{', '.join(map(repr, REDUCTIONS))}, got {mode!r}")
    return mode


class _Reproducible:
    """ProcessGroupShmtree's reductions in its mode (a mixin: _reduction, _comm, _work)."""

    def _reproducibly(self, op):
        """The keywords of a reduction's call in this group's mode: deterministic=True in
        "deterministic" and "reproducible" (for what an Accumulator does not sum), else none."""
        return {} if self._reduction == "default" else {"deterministic": True}

    def _exact(self, op, a):
        """Does this all_reduce sum exactly (mode "reproducible": SUM and AVG of floats)?"""
        return (self._reduction == "reproducible" and op in ("sum", "avg")
                and (a.dtype.kind in "fc" or a.dtype.name == "bfloat16"))

    def _summed(self, a, secs, finish):
        """all_reduce of a (a numpy view of the tensor) as the exact sum of every rank's a
        (comm.allreduce of Accumulator._of_one(a)), written back into a, then finish(): its
        NaNs and infinities as IEEE arithmetic gives them (result(strict=False)), not raised
        (a gradient that overflowed stays inf, as it would with the plain sum)."""
        comm, got = self._comm, []

        def call(now):
            spec = calls.allreduce(comm, Accumulator._of_one(a), "sum", None, secs,
                                   posted=not now)

            def step():
                got.append(comm._start(spec))
                return got[-1]
            return step

        def done():
            merged = got[0] if isinstance(got[0], Accumulator) else got[0].result()
            a[...] = merged.result(strict=False).reshape(a.shape)
            return finish()
        return self._work([call], a.nbytes, done)


def _backend(group):
    """The ProcessGroupShmtree of a torch process group (None: the default group)."""
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if isinstance(pg, _Reproducible):
        return pg
    backend = pg._get_backend(torch.device("cpu"))
    if not isinstance(backend, _Reproducible):
        raise ValueError(f"shmtree: the process group's backend is "
                         f"{type(backend).__name__}, not shmtree's")
    return backend


def set_reduction(mode, group=None):
    """Set the reduction mode of a process group of backend "shmtree" (None: the default
    group), on every rank alike, between operations.

    Parameters
    ----------
    mode : {"default", "deterministic", "reproducible"}
        "default": the plain calls.  "deterministic": all_reduce, reduce, reduce_scatter
        (and DDP's gradient all_reduce) with ``deterministic=True``: the op in rank order, the
        same bits for the same world size on any machine.  "reproducible": all_reduce of
        floats with ``ReduceOp.SUM`` or ``AVG`` (DDP's) as an exact sum
        (`shmtree.Accumulator`: the same bits whatever the order of the ranks; its NaNs and
        infinities as IEEE arithmetic gives them), every other reduction deterministic.  The
        initial mode is the environment variable ``SHMTREE_TORCH_REDUCTION``'s (default
        "default"), read when the group is made.
    group : ProcessGroup, optional

    Raises
    ------
    ValueError
        An unknown mode, or a group of another backend.
    """
    _backend(group)._reduction = _reduction_mode(mode, "set_reduction")


def reduction(group=None) -> str:
    """The reduction mode of a process group of backend "shmtree" (`set_reduction`)."""
    return _backend(group)._reduction


def communicator(group=None):
    """The shmtree Communicator under a process group of backend "shmtree" (None: the default
    group): its ranks are the group's, and its calls (an Accumulator's allreduce, say) may be
    mixed with the group's operations, in the same order on every rank."""
    return _backend(group)._comm
