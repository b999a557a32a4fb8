"""The public collectives, written once (docs/design.md, "One call"): Front, and the
module-level functions made from it.

Every communicator - one machine's (Communicator) and the one across nodes (Spanning) - is a
Front: its public methods parse their arguments into a CallSpec (calls.py) and hand it to the
communicator's two hooks,

    _run(spec)     run the call now, in this thread (a blocking call), and return its result;
    _post(spec)    hand it to the rank's progress thread: a Request (a nonblocking call);

and, optionally,

    _quick(coll, array, op, out, root, timeout)
                   the engine's C twin of the parse (Engine.call), for a plain ndarray call of a
                   blocking collective: the result, or DECLINED when the call must be parsed
                   first (it then runs exactly as _run(spec) would have run it);
    _local_error(spec)
                   a rooted call's local error only this rank can see (spec.error): say it to
                   the other ranks, and return the exception to raise;
    _shared_array(shape, dtype, order, how)
                   empty / zeros: shared arrays.

Arrays of other libraries (torch, cupy on the host, anything with __array_interface__ or the
buffer protocol) are viewed as numpy's here, once, and the result given back as the caller
expects it (arrays.py).
"""
from __future__ import annotations

import functools
import inspect

from . import arrays as _arrays, calls
from .arrays import either_foreign as _foreign, numpy_args as _numpy_args
from .calls import ALLGATHER, ALLREDUCE, BARRIER, BROADCAST, REDUCE, REDUCE_SCATTER

__all__ = ["Front", "DECLINED", "PUBLIC", "module_functions"]


class _Declined:
    __slots__ = ()

    def __repr__(self):
        return "<declined: parse the call first>"


DECLINED = _Declined()


class Front:
    """The collectives of a communicator (rank, size, and the hooks above)."""

    # ---- allreduce ----

    def allreduce(self, array, op="sum", *, out=None, timeout=None):
        """Reduce `array` over all ranks with `op`; a new array, or `out` when given."""
        got = self._quick(ALLREDUCE, array, op, out, 0, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.allreduce, array, out, "allreduce", op, timeout=timeout)
        return self._start(calls.allreduce(self, array, op, out, timeout))

    def iallreduce(self, array, op="sum", *, out=None, timeout=None):
        """allreduce, nonblocking: a Request (docs/design.md, "Nonblocking calls")."""
        array, out = _numpy_args(array, out, "iallreduce")
        return self._start(calls.allreduce(self, array, op, out, timeout, posted=True))

    # ---- broadcast ----

    def broadcast(self, array, root=0, *, out=None, timeout=None):
        """Every rank gets the root's array.  Elsewhere `array` is None (the shape and dtype come
        from the root) or an array of the root's shape and dtype whose values are ignored.
        Returns a new array on every rank, or `out`."""
        got = self._quick(BROADCAST, array, None, out, root, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.broadcast, array, out, "broadcast", root, timeout=timeout)
        return self._start(calls.broadcast(self, array, root, out, timeout))

    def ibroadcast(self, array, root=0, *, out=None, timeout=None):
        """broadcast, nonblocking: a Request."""
        array, out = _numpy_args(array, out, "ibroadcast")
        return self._start(calls.broadcast(self, array, root, out, timeout, posted=True))

    # ---- reduce ----

    def reduce(self, array, op="sum", root=0, *, out=None, timeout=None):
        """The root gets what allreduce would give (a new array, or `out`); the other ranks get
        None."""
        got = self._quick(REDUCE, array, op, out, root, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.reduce, array, out, "reduce", op, root, timeout=timeout)
        return self._start(calls.reduce(self, array, op, root, out, timeout))

    def ireduce(self, array, op="sum", root=0, *, out=None, timeout=None):
        """reduce, nonblocking: a Request (its result None on ranks other than the root)."""
        array, out = _numpy_args(array, out, "ireduce")
        return self._start(calls.reduce(self, array, op, root, out, timeout, posted=True))

    # ---- allgather ----

    def allgather(self, array, *, axis=None, out=None, timeout=None):
        """axis=None: the arrays stacked, shape (size, *array.shape), result[r] rank r's array;
        axis=0: concatenated along axis 0 (the other dimensions agree, lengths may differ)."""
        if axis is None:
            got = self._quick(ALLGATHER, array, None, out, 0, timeout)
            if got is not DECLINED:
                return got
        if _foreign(array, out):
            return _arrays.call(self.allgather, array, out, "allgather", axis=axis,
                                timeout=timeout)
        return self._start(calls.allgather(self, array, axis, out, timeout))

    def iallgather(self, array, *, axis=None, out=None, timeout=None):
        """allgather, nonblocking: a Request."""
        array, out = _numpy_args(array, out, "iallgather")
        return self._start(calls.allgather(self, array, axis, out, timeout, posted=True))

    # ---- reduce_scatter ----

    def reduce_scatter(self, array, op="sum", *, out=None, timeout=None):
        """Rank r gets np.array_split(the full reduction, size, axis=0)[r]."""
        got = self._quick(REDUCE_SCATTER, array, op, out, 0, timeout)
        if got is not DECLINED:
            return got
        if _foreign(array, out):
            return _arrays.call(self.reduce_scatter, array, out, "reduce_scatter", op,
                                timeout=timeout)
        return self._start(calls.reduce_scatter(self, array, op, out, timeout))

    def ireduce_scatter(self, array, op="sum", *, out=None, timeout=None):
        """reduce_scatter, nonblocking: a Request."""
        array, out = _numpy_args(array, out, "ireduce_scatter")
        return self._start(calls.reduce_scatter(self, array, op, out, timeout, posted=True))

    # ---- barrier ----

    def barrier(self, timeout=None):
        """Return once every rank has entered the barrier."""
        got = self._quick(BARRIER, None, None, None, 0, timeout)
        if got is not DECLINED:
            return got
        return self._start(calls.barrier(self, timeout))

    def ibarrier(self, timeout=None):
        """barrier, nonblocking: a Request whose result is None."""
        return self._start(calls.barrier(self, timeout, posted=True))

    # ---- shared arrays ----

    def empty(self, shape, dtype=float, order="C"):
        """A collective: a writable array every member can read, on every rank (each rank its
        own), with the same shape and dtype everywhere.  Collectives of such arrays (input and
        out=) run single-copy, reading and writing them in place.  The memory lives while this
        rank holds a reference, and is unshared when the communicator closes."""
        return self._shared_array(shape, dtype, order, "empty")

    def zeros(self, shape, dtype=float, order="C"):
        """empty, filled with zeros (fresh shared memory is zero)."""
        return self._shared_array(shape, dtype, order, "zeros")

    # ---- sub-communicators (issue 24: shmtree/subcomm.py, registered into _SPLIT) ----

    def split(self, color, key=None):
        """A collective over this communicator: the ranks passing the same `color` (an int >= 0)
        form a new communicator, ranked by (key, rank here) (key defaults to the rank here);
        color=None takes no part and gets None.  The new communicator is a full one (every
        collective, shared arrays, split again), with its own group and plan over its members'
        cores; closing it is local, and closing this one does not close it."""
        return _split_maker()[0](self, color, key)

    def dup(self):
        """A new communicator of the same ranks in the same order: split(0)."""
        return self.split(0)

    def split_by(self, level):
        """A collective: split by the part of the machine the ranks share, like
        MPI_Comm_split_type: level "socket", "numa", "l3" (the group of cores sharing a last-
        level cache) or "node" (the ranks of one machine: everything in a one-machine
        communicator).  Ranks keep their order."""
        return _split_maker()[1](self, level)

    # ---- the hooks' defaults, and the one dispatch ----

    def _start(self, spec):
        """A parsed call: its local error raised (said to the others first), else run now or
        posted."""
        if spec.error is not None:
            raise self._local_error(spec) from None
        return self._post(spec) if spec.posted else self._run(spec)

    def _quick(self, coll, array, op, out, root, timeout):
        return DECLINED

    def _local_error(self, spec):
        return spec.error


# sub-communicators: (split, split_by) of shmtree.subcomm, which registers them when imported
# (shmtree's __init__ imports it, through api): this module imports nothing above it
_SPLIT = None


def _made_by(split, split_by):
    """Register the makers of Front.split and Front.split_by."""
    global _SPLIT
    _SPLIT = (split, split_by)


def _split_maker():
    if _SPLIT is None:
        from .errors import ShmtreeError
        raise ShmtreeError("shmtree: split needs shmtree.subcomm (import shmtree)")
    return _SPLIT


PUBLIC = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "barrier",
          "iallreduce", "ibroadcast", "ireduce", "iallgather", "ireduce_scatter", "ibarrier",
          "empty", "zeros")


def module_functions(current):
    """The module-level calls: each PUBLIC method of Front, made on current() (the process's
    communicator), with the method's signature less self and its docstring."""
    made = {}
    for name in PUBLIC:
        method = getattr(Front, name)

        def forward(*args, _name=name, **kwargs):
            return getattr(current(), _name)(*args, **kwargs)
        functools.update_wrapper(forward, method)
        del forward.__wrapped__
        sig = inspect.signature(method)
        forward.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
        forward.__qualname__ = name
        made[name] = forward
    return made
