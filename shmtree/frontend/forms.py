"""The persistent forms of every collective (allreduce_init & co.): a mixin of Front
(front.py).  Each parses its call once, binds its output (_output) and returns a Persistent
(persistent.py).
"""
from __future__ import annotations

import numpy as np

from .. import arrays as _arrays
from . import calls
from ..arrays import numpy_args as _numpy_args
from .calls import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, EXSCAN, GATHER, REDUCE,
                    REDUCE_SCATTER, SCAN, SCATTER)
from .persistent import Persistent


class _Forms:
    """Front's *_init forms: a call checked and bound once, run by p()."""

    # ---- persistent calls: checked and bound once (persistent.py) ----

    def allreduce_init(self, array, op="sum", *, out=None, timeout=None, deterministic=False,
                       reproducible=False):
        """allreduce, bound once: a Persistent (p() runs it, p.start() posts it).

        A plain ndarray call of p() is one engine call with its arguments bound: no parse, no
        allocation.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     x = np.ones(2)
        ...     p = comm.allreduce_init(x, out=x)      # checked and bound once
        ...     for _ in range(3):
        ...         p()                                # 2, 4, then 8 in place
        ...     return x.tolist()
        >>> shmtree.run(step, 2)
        [[8.0, 8.0], [8.0, 8.0]]
        """
        return self._init("allreduce", array, out, lambda a, o: calls.allreduce(
            self, a, op, o, timeout, deterministic=deterministic, reproducible=reproducible))

    def broadcast_init(self, array, root=0, *, out=None, timeout=None):
        """broadcast, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     x = np.zeros(2)
        ...     p = comm.broadcast_init(x, root=0, out=x)
        ...     if comm.rank == 0:
        ...         x[:] = 7
        ...     p()
        ...     return x.tolist()
        >>> shmtree.run(step, 2)
        [[7.0, 7.0], [7.0, 7.0]]
        """
        return self._init("broadcast", array, out, lambda a, o: calls.broadcast(
            self, a, root, o, timeout))

    def reduce_init(self, array, op="sum", root=0, *, out=None, timeout=None,
                    deterministic=False):
        """reduce, bound once: a Persistent (None away from the root).

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     p = comm.reduce_init(np.ones(2), root=0)
        ...     s = p()
        ...     return None if s is None else s.tolist()
        >>> shmtree.run(step, 2)
        [[2.0, 2.0], None]
        """
        return self._init("reduce", array, out, lambda a, o: calls.reduce(
            self, a, op, root, o, timeout, deterministic=deterministic))

    def allgather_init(self, array, *, axis=None, out=None, timeout=None):
        """allgather, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     x = np.array([comm.rank])
        ...     p = comm.allgather_init(x)
        ...     return p().tolist()
        >>> shmtree.run(step, 2)
        [[[0], [1]], [[0], [1]]]
        """
        return self._init("allgather", array, out, lambda a, o: calls.allgather(
            self, a, axis, o, timeout))

    def reduce_scatter_init(self, array, op="sum", *, out=None, timeout=None,
                            deterministic=False):
        """reduce_scatter, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     p = comm.reduce_scatter_init(np.arange(4))
        ...     return p().tolist()
        >>> shmtree.run(step, 2)
        [[0, 2], [4, 6]]
        """
        return self._init("reduce_scatter", array, out, lambda a, o: calls.reduce_scatter(
            self, a, op, o, timeout, deterministic=deterministic))

    def alltoall_init(self, array, *, counts=None, out=None, timeout=None):
        """alltoall, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     p = comm.alltoall_init(np.array([comm.rank, comm.rank]))
        ...     return p().tolist()
        >>> shmtree.run(step, 2)
        [[0, 1], [0, 1]]
        """
        return self._init("alltoall", array, out, lambda a, o: calls.alltoall(
            self, a, counts, o, timeout))

    def gather_init(self, array, root=0, *, axis=None, out=None, timeout=None):
        """gather, bound once: a Persistent (None away from the root).

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     g = comm.gather_init(np.array([comm.rank]), root=0)()
        ...     return None if g is None else g.tolist()
        >>> shmtree.run(step, 2)
        [[[0], [1]], None]
        """
        return self._init("gather", array, out, lambda a, o: calls.gather(
            self, a, root, axis, o, timeout))

    def scatter_init(self, array, root=0, *, axis=None, out=None, timeout=None):
        """scatter, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     table = np.array([[5], [6]]) if comm.rank == 0 else None
        ...     return comm.scatter_init(table, root=0)().tolist()
        >>> shmtree.run(step, 2)
        [[5], [6]]
        """
        return self._init("scatter", array, out, lambda a, o: calls.scatter(
            self, a, root, axis, o, timeout))

    def scan_init(self, array, op="sum", *, out=None, timeout=None, deterministic=False):
        """scan, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     p = comm.scan_init(np.array([comm.rank + 1]))
        ...     return p().tolist(), p() is p()             # the same output array each time
        >>> shmtree.run(step, 2)
        [([1], True), ([3], True)]
        """
        return self._init("scan", array, out, lambda a, o: calls.scan(
            self, a, op, o, timeout, deterministic=deterministic))

    def exscan_init(self, array, op="sum", *, out=None, timeout=None, deterministic=False):
        """exscan, bound once: a Persistent.

        Examples
        --------
        >>> import numpy as np, shmtree
        >>> def step(comm):
        ...     return comm.exscan_init(np.array([comm.rank + 1]))().tolist()
        >>> shmtree.run(step, 2)
        [[0], [1]]
        """
        return self._init("exscan", array, out, lambda a, o: calls.exscan(
            self, a, op, o, timeout, deterministic=deterministic))

    def barrier_init(self, timeout=None):
        """barrier, bound once: a Persistent (p() returns None).

        Examples
        --------
        >>> import shmtree
        >>> def step(comm):
        ...     p = comm.barrier_init()
        ...     return p(), p.start().wait()
        >>> shmtree.run(step, 2)
        [(None, None), (None, None)]
        """
        return self._init("barrier", None, None, lambda a, o: calls.barrier(self, timeout))

    def _init(self, name, array, out, parse):
        """A Persistent of the call parse(array, out) makes (arrays of other libraries viewed
        as numpy's once; the result returned as the plain call would: out= as given, a torch
        tensor for torch input)."""
        a, o = _numpy_args(array, out, name + "_init")
        spec = parse(a, o)
        if spec.error is None:
            spec = spec._replace(out=_output(self, spec))
        given = out if out is not None and o is not out else None
        torch = out is None and _arrays._is_torch(array)
        return Persistent(self, spec, given, torch)


def _output(comm, spec):
    """A persistent call's output, made at init: out= as given, else a new array when this
    rank gets a result whose shape it knows locally (None: none, or the peers' to say - the
    first call's result is then bound)."""
    a, out, coll = spec.array, spec.out, spec.coll
    if out is not None:
        return out
    if a is not None and not isinstance(a, np.ndarray):
        return None                   # (an Accumulator allreduce: its result is the first call's)
    if coll in (ALLREDUCE, SCAN, EXSCAN) or (coll == ALLTOALL and spec.counts is None):
        return np.empty(a.shape, a.dtype)
    if coll == REDUCE:
        return np.empty(a.shape, a.dtype) if comm.rank == spec.root else None
    if coll == REDUCE_SCATTER:
        return np.empty(calls.scatter_shape(a, None, comm.size, comm.rank)[2], a.dtype)
    if coll == ALLGATHER and spec.axis is None:
        return np.empty((comm.size,) + a.shape, a.dtype)
    if coll == BROADCAST and a is not None:
        return np.empty(a.shape, a.dtype)
    if coll == GATHER and spec.axis is None and comm.rank == spec.root:
        return np.empty((comm.size,) + a.shape, a.dtype)
    if coll == SCATTER and a is not None:
        if spec.axis is None:
            return np.empty(a.shape[1:], a.dtype)
        b = calls.split_bounds(a.shape[0], comm.size)
        return np.empty((b[comm.rank + 1] - b[comm.rank],) + a.shape[1:], a.dtype)
    return None
