"""One description of every collective call (docs/design.md, "One call"): CallSpec, and the
one parser per collective that checks a call's arguments and builds it.

Every way into a collective - the blocking and nonblocking methods of a communicator on one
machine or across nodes, the module-level functions, the torch backend - builds the same
CallSpec with the same functions here, so a rule about the arguments (which dtypes, which out=,
which roots and axes, the timeout) is written once.  A local error (an argument this rank can
see is wrong) is raised by the parser, before any communication, and leaves the group usable.
The engine has a C twin of the common case (Engine.call parses a plain ndarray call itself, the
hot path); a call it cannot take as it is comes here first.

Also here, the helpers every executor uses to lay out a call's buffers: the one np.array_split
block formula (split_bounds), out= made into the array the engine writes (destination,
out_for), the dtype digest the descriptors carry.
"""
from __future__ import annotations

import functools
import hashlib
import operator
import pickle
import sys
import time
from typing import Any, NamedTuple

import numpy as np
from numpy.ma import MaskedArray      # (np.ma is imported lazily: look it up once)

from .. import _moving
from ..accumulator import Accumulator, accumulable
from ..codes import (DET_ACCUMULATE, DET_ALLREDUCE, DET_EXSCAN, DET_REDUCE, DET_REDUCE_SCATTER,
                    DET_SCAN, KIND_ALLGATHER, KIND_ALLREDUCE, KIND_ALLTOALL, KIND_BARRIER,
                    KIND_BROADCAST, KIND_DETERMINISTIC, KIND_EXSCAN, KIND_GATHER, KIND_REDUCE,
                    KIND_REDUCE_SCATTER, KIND_ROOT_STEP, KIND_SCAN, KIND_SCATTER, det_kind)
from ..ops import OPS, reduction_codes

__all__ = ["CallSpec", "allreduce", "reduce", "reduce_scatter", "broadcast", "allgather",
           "barrier", "alltoall", "gather", "scatter", "scan", "exscan", "split_bounds", "destination", "out_for", "finish", "deadline_of"]

# the collectives by number: the engine's own (Engine.call takes these numbers: _engine.ALLREDUCE
# ... _engine.BARRIER), then those whose executors are made of engine calls
ALLREDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, ALLGATHER, ALLTOALL, BARRIER = range(7)
GATHER, SCATTER, SCAN, EXSCAN = range(7, 11)
COLLECTIVE_NAMES = ("allreduce", "broadcast", "reduce", "reduce_scatter", "allgather",
                    "alltoall", "barrier", "gather", "scatter", "scan", "exscan")


class CallSpec(NamedTuple):
    """A checked collective call, the same for every kind of communicator (immutable: a
    named tuple, cheap to make on every call).

    name: the collective ("allreduce", ...); coll: its number (ALLREDUCE ...); kind: the
    descriptor kind every rank compares (KIND_* + KIND_ROOT_STEP * root for rooted calls);
    array: the input as a numpy array (not made contiguous: the executor does what its
    transport needs), None for barrier and for a broadcast rank that passed None; out: out= as
    given (checked against the input); op, opc, dtc: the reduction's op as given and its codes
    (-1 when the call does not reduce); root: the root rank (broadcast, reduce; else None);
    axis: allgather's (None or 0); timeout: as given (checked), deadline: the monotonic time it
    ends (None: never), counted from when the call was made; posted: a nonblocking call;
    error: a local error of a rooted call that only this rank can see (its dtype holds Python
    objects, or has no kernel): the executor says it in the call's round so that every other
    rank raises too, then raises it (DESIGN section 6)."""
    name: str
    coll: int
    kind: int
    array: Any = None
    out: Any = None
    op: Any = None
    opc: int = -1
    dtc: int = -1
    root: Any = None
    axis: Any = None
    timeout: Any = None
    deadline: Any = None
    posted: bool = False
    error: Any = None
    counts: Any = None

    @property
    def request_name(self) -> str:
        """The name of its Request ("iallreduce"), or of the blocking call."""
        return ("i" if self.posted else "") + self.name

    @property
    def reproducible(self) -> bool:
        """A reproducible call (repro.py): deterministic=True, or an Accumulator allreduce
        (allreduce of an Accumulator, reproducible=True).  Its kind says which (codes.DET_*),
        so that ranks that disagree on it disagree on the call."""
        return self.kind % KIND_ROOT_STEP == KIND_DETERMINISTIC



# ---- the parsers: one per collective ----


def allreduce(comm, array, op="sum", out=None, timeout=None, posted=False,
              deterministic=False, reproducible=False):
    """allreduce; deterministic=True: the op in rank order (repro.py); reproducible=True, or
    an Accumulator for `array`: the exact sum (an Accumulator allreduce)."""
    if (reproducible is not False and _flag(reproducible, "reproducible")) or \
            type(array) is Accumulator:
        return _accumulating(comm, array, op, out, timeout, posted, deterministic)
    kind = KIND_ALLREDUCE
    if deterministic is not False and _flag(deterministic, "deterministic"):
        kind = det_kind(DET_ALLREDUCE)
    return _reducing(comm, "allreduce", ALLREDUCE, kind, array, op, out, timeout, None, posted)


def reduce(comm, array, op="sum", root=0, out=None, timeout=None, posted=False,
           deterministic=False):
    root = check_root(root, comm.size)
    if comm.rank != root:
        out = None                    # (ignored away from the root, which alone gets a result)
    kind = KIND_REDUCE + KIND_ROOT_STEP * root
    if deterministic is not False and _flag(deterministic, "deterministic"):
        kind = det_kind(DET_REDUCE, root)
    return _reducing(comm, "reduce", REDUCE, kind, array, op, out, timeout, root, posted)


def reduce_scatter(comm, array, op="sum", out=None, timeout=None, posted=False,
                   deterministic=False):
    a = _not_masked(array)
    if a.ndim == 0:
        raise ValueError("shmtree: reduce_scatter needs an array of at least 1 dimension")
    scatter_shape(a, out, comm.size, comm.rank)          # (checks out)
    opc, dtc = reduction_codes(op, a.dtype)
    kind = KIND_REDUCE_SCATTER
    if deterministic is not False and _flag(deterministic, "deterministic"):
        kind = det_kind(DET_REDUCE_SCATTER)
    return CallSpec("reduce_scatter", REDUCE_SCATTER, kind, a, out, op, opc, dtc,
                    timeout=timeout, deadline=deadline_of(timeout), posted=posted)


def _flag(value, name):
    """A bool argument (True, False or numpy's bools), else ValueError."""
    if value is True or value is False or isinstance(value, np.bool_):
        return bool(value)
    raise ValueError(f"shmtree: {name} must be True or False, got {value!r}")


def _accumulating(comm, array, op, out, timeout, posted, deterministic):
    """An Accumulator allreduce: of an Accumulator (the Accumulator of every rank's terms is
    the result; out= has no place), or reproducible=True (each rank's array one term; the
    exact sum rounded once, into out= when given)."""
    if deterministic is not False and _flag(deterministic, "deterministic"):
        raise ValueError("shmtree: allreduce: deterministic=True and reproducible=True (or an "
                         "Accumulator) are two ways to make a sum reproducible: pass one")
    try:
        opc = OPS[op]
    except (KeyError, TypeError):
        opc = -1
    if opc != OPS["sum"]:
        raise ValueError(f"shmtree: allreduce: an Accumulator (reproducible=True) sums: op must "
                         f"be 'sum' (np.add), got {op!r}")
    kind = det_kind(DET_ACCUMULATE)
    if type(array) is Accumulator:
        if out is not None:
            raise ValueError("shmtree: allreduce of an Accumulator returns a new Accumulator: "
                             "out= has no place (acc.result(), then copy)")
        return CallSpec("allreduce", ALLREDUCE, kind, array, None, op, opc, -1,
                        timeout=timeout, deadline=deadline_of(timeout), posted=posted)
    a = _not_masked(array)
    accumulable(a.dtype)              # (a TypeError for a dtype it does not sum)
    if out is not None:
        check_destination(a, out)
    return CallSpec("allreduce", ALLREDUCE, kind, a, out, op, opc, -1, timeout=timeout,
                    deadline=deadline_of(timeout), posted=posted)


def _reducing(comm, name, coll, kind, array, op, out, timeout, root, posted):
    a = _not_masked(array)
    error = None
    try:
        opc, dtc = reduction_codes(op, a.dtype)
    except TypeError as exc:          # (its dtype is not reducible: a reduce says so in the
        if root is None:              # call's round, DESIGN section 6)
            raise
        error, opc, dtc = exc, -1, -1
    if out is not None and error is None:
        check_destination(a, out)
    return CallSpec(name, coll, kind, a, out, op, opc, dtc, root, None, timeout,
                    _checked_deadline(timeout, error), posted, error)


def broadcast(comm, array, root=0, out=None, timeout=None, posted=False):
    root = check_root(root, comm.size)
    kind = KIND_BROADCAST + KIND_ROOT_STEP * root
    dl = _checked_deadline(timeout, None)
    a = None
    try:
        if array is None:
            if comm.rank == root:
                raise ValueError("shmtree: broadcast: the root must pass the array")
            if out is not None:               # its dtype and shape are this rank's claim
                if not isinstance(out, np.ndarray):
                    raise ValueError(f"shmtree: broadcast: out must be a numpy array, got "
                                     f"{type(out).__name__}")
                if not out.flags.writeable:
                    raise ValueError("shmtree: broadcast: out is read-only")
                a = movable(out, "broadcast")
        else:
            a = array if type(array) is np.ndarray and not array.dtype.hasobject \
                else movable(array, "broadcast")
            if out is not None:
                check_out(out, a.shape, a.dtype, "broadcast")
    except TypeError as exc:          # (a dtype holding Python objects: said to the other
        return CallSpec("broadcast", BROADCAST, kind, None, out, root=root,  # ranks in the
                        timeout=timeout, deadline=dl, posted=posted, error=exc)   # round)
    return CallSpec("broadcast", BROADCAST, kind, a, out, root=root, timeout=timeout,
                    deadline=dl, posted=posted)


def allgather(comm, array, axis=None, out=None, timeout=None, posted=False):
    if axis is not None and axis != 0:
        raise ValueError(f"shmtree: allgather: axis must be None or 0, got {axis!r}")
    dl = deadline_of(timeout)
    a = movable(array, "allgather")
    if axis is None and out is not None:
        check_out(out, (comm.size,) + a.shape, a.dtype, "allgather")
    elif axis == 0 and a.ndim == 0:
        raise ValueError("shmtree: allgather(axis=0) needs arrays of at least 1 dimension")
    return CallSpec("allgather", ALLGATHER, KIND_ALLGATHER, a, out, axis=axis, timeout=timeout,
                    deadline=dl, posted=posted)


def barrier(comm, timeout=None, posted=False):
    return CallSpec("barrier", BARRIER, KIND_BARRIER, timeout=timeout,
                    deadline=deadline_of(timeout), posted=posted)


def alltoall(comm, array, counts=None, out=None, timeout=None, posted=False):
    """alltoall: counts None, equal blocks (array.shape[0] == size: row s goes to rank s); or
    counts, `size` non-negative ints summing to array.shape[0] (counts[s] rows go to rank s).
    Every rank's out= is checked here as far as this rank can see it (with counts=, its length
    is known only once every rank's counts are: the executor checks it then)."""
    dl = deadline_of(timeout)
    a = movable(array, "alltoall")
    P = comm.size
    if a.ndim == 0:
        raise ValueError("shmtree: alltoall needs an array of at least 1 dimension")
    if counts is None:
        if a.shape[0] != P:
            raise ValueError(f"shmtree: alltoall: array.shape[0] must be the group's size {P} "
                             f"(one block per rank), got shape {a.shape}; pass counts= for "
                             f"blocks of other sizes")
        if out is not None:
            check_out(out, a.shape, a.dtype, "alltoall")
    else:
        counts = check_counts(counts, P, a.shape[0])
        if out is not None:
            check_rows_out(out, a.shape[1:], a.dtype, "alltoall")
    return CallSpec("alltoall", ALLTOALL, KIND_ALLTOALL, a, out, timeout=timeout, deadline=dl,
                    posted=posted, counts=counts)


def gather(comm, array, root=0, axis=None, out=None, timeout=None, posted=False):
    """gather: the root gets what allgather would give; out= matters on the root only.  An
    array whose dtype holds Python objects, or the root's out= that does not fit, is a local
    error said in the call's round (the other ranks cannot see it: DESIGN section 6)."""
    root = check_root(root, comm.size)
    if axis is not None and axis != 0:
        raise ValueError(f"shmtree: gather: axis must be None or 0, got {axis!r}")
    kind = KIND_GATHER + KIND_ROOT_STEP * root
    mine = comm.rank == root
    if not mine:
        out = None                    # (ignored away from the root)
    try:                              # (an object dtype, the root's out=: said in the round)
        a = movable(array, "gather")
        if axis == 0 and a.ndim == 0:
            raise ValueError("shmtree: gather(axis=0) needs arrays of at least 1 dimension")
        if out is not None and axis is None:
            check_out(out, (comm.size,) + a.shape, a.dtype, "gather")
        elif out is not None:
            check_rows_out(out, a.shape[1:], a.dtype, "gather")
    except (TypeError, ValueError) as exc:
        return CallSpec("gather", GATHER, kind, None, None, root=root, axis=axis,
                        timeout=timeout, deadline=_checked_deadline(timeout, exc),
                        posted=posted, error=exc)
    return CallSpec("gather", GATHER, kind, a, out, root=root, axis=axis, timeout=timeout,
                    deadline=deadline_of(timeout), posted=posted)


def scatter(comm, array, root=0, axis=None, out=None, timeout=None, posted=False):
    """scatter: the root's array, (size, *rest) with axis=None, split along axis 0
    (np.array_split) with axis=0; elsewhere None (out= may claim the block: an ndarray, checked
    against the root's once its shape is known).  The root's errors (no array, a dtype holding
    Python objects, a shape or out= that does not fit) are local errors said in the call's
    round: the other ranks cannot see them."""
    root = check_root(root, comm.size)
    if axis is not None and axis != 0:
        raise ValueError(f"shmtree: scatter: axis must be None or 0, got {axis!r}")
    kind = KIND_SCATTER + KIND_ROOT_STEP * root
    P = comm.size
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise ValueError(f"shmtree: scatter: out must be a numpy array, got "
                             f"{type(out).__name__}")
        if not out.flags.writeable:
            raise ValueError("shmtree: scatter: out is read-only")
    a = None
    if comm.rank == root:
        try:                          # (errors only the root can see: said in the round)
            a = _scattered(array, out, axis, P, root)
        except (TypeError, ValueError) as exc:
            return CallSpec("scatter", SCATTER, kind, None, out, root=root, axis=axis,
                            timeout=timeout, deadline=_checked_deadline(timeout, exc),
                            posted=posted, error=exc)
    return CallSpec("scatter", SCATTER, kind, a, out, root=root, axis=axis, timeout=timeout,
                    deadline=deadline_of(timeout), posted=posted)


def _scattered(array, out, axis, P, root):
    """scatter's checks of the root's array (and out=): the array to send."""
    if array is None:
        raise ValueError("shmtree: scatter: the root must pass the array")
    a = movable(array, "scatter")
    if a.ndim == 0:
        raise ValueError("shmtree: scatter: the root's array needs at least 1 dimension")
    if axis is None and a.shape[0] != P:
        raise ValueError(f"shmtree: scatter: the root's array must have shape[0] == size "
                         f"{P} (one block per rank), got shape {a.shape}; axis=0 splits "
                         f"any length")
    if out is not None:
        b = split_bounds(a.shape[0], P) if axis == 0 else None
        shape = a.shape[1:] if axis is None else (b[root + 1] - b[root],) + a.shape[1:]
        check_out(out, shape, a.dtype, "scatter")
    return a


def scan(comm, array, op="sum", out=None, timeout=None, posted=False, deterministic=False):
    """scan: rank r gets the reduction of ranks 0..r in rank order (the dtypes and ops of
    allreduce).  deterministic=True: the same call (a scan folds in rank order always), said
    in its kind, so that every rank must pass it."""
    kind = KIND_SCAN
    if deterministic is not False and _flag(deterministic, "deterministic"):
        kind = det_kind(DET_SCAN)
    return _scanning(comm, "scan", SCAN, kind, array, op, out, timeout, posted)


def exscan(comm, array, op="sum", out=None, timeout=None, posted=False, deterministic=False):
    """exscan: rank r gets the reduction of ranks 0..r-1; rank 0 the op's identity."""
    kind = KIND_EXSCAN
    if deterministic is not False and _flag(deterministic, "deterministic"):
        kind = det_kind(DET_EXSCAN)
    return _scanning(comm, "exscan", EXSCAN, kind, array, op, out, timeout, posted)


def _scanning(comm, name, coll, kind, array, op, out, timeout, posted):
    a = _not_masked(array)
    opc, dtc = reduction_codes(op, a.dtype)
    if out is not None:
        check_destination(a, out)
    return CallSpec(name, coll, kind, a, out, op, opc, dtc, timeout=timeout,
                    deadline=deadline_of(timeout), posted=posted)


# ---- the rules the parsers apply ----


def check_counts(counts, size, rows):
    """alltoall's counts=: `size` ints >= 0 summing to `rows` (the input's length), as a tuple."""
    try:
        got = tuple(operator.index(c) for c in counts)
    except TypeError:
        raise ValueError(f"shmtree: alltoall: counts must be a sequence of {size} ints, got "
                         f"{counts!r}") from None
    if len(got) != size or any(c < 0 for c in got):
        raise ValueError(f"shmtree: alltoall: counts must be {size} ints >= 0 (one per rank), "
                         f"got {list(got)}")
    if sum(got) != rows:
        raise ValueError(f"shmtree: alltoall: counts sum to {sum(got)}, the array has {rows} "
                         f"rows along axis 0")
    return got


def check_rows_out(out, rest, dtype, what):
    """The checks of an out= whose length along axis 0 is known only once every rank has said
    its part: a writable ndarray of `dtype` whose other dimensions are `rest`."""
    if not isinstance(out, np.ndarray):
        raise ValueError(f"shmtree: {what}: out must be a numpy array, got {type(out).__name__}")
    if out.dtype != dtype or out.ndim != len(rest) + 1 or out.shape[1:] != tuple(rest):
        raise ValueError(f"shmtree: {what}: out has shape {out.shape} and dtype {out.dtype}; the "
                         f"result has shape (n, {', '.join(map(str, rest))}) and dtype "
                         f"{np.dtype(dtype)}".replace(", )", ")"))
    if not out.flags.writeable:
        raise ValueError(f"shmtree: {what}: out is read-only")


def check_root(root, size):
    if type(root) is int and 0 <= root < size:
        return root
    if isinstance(root, bool) or not hasattr(root, "__index__") \
            or not 0 <= root.__index__() < size:
        raise ValueError(f"shmtree: root must be an int in [0, {size}), got {root!r}")
    return root.__index__()


def _not_masked(array):
    if isinstance(array, MaskedArray):
        raise TypeError("shmtree: masked arrays are not supported (the mask would be "
                        "dropped); reduce array.filled(...) or the mask separately")
    return array if type(array) is np.ndarray else np.asarray(array)


def movable(a, what):
    """`a` as an array whose bytes can be moved: not masked, no Python objects (a TypeError)."""
    if not isinstance(a, np.ndarray):
        a = np.asarray(a)
    if isinstance(a, MaskedArray):
        raise TypeError(f"shmtree: {what}: masked arrays are not supported (the mask would be "
                        "dropped)")
    if a.dtype.hasobject:
        raise TypeError(f"shmtree: {what}: dtype {a.dtype} holds Python objects, which cannot "
                        "be sent as bytes; use a numeric, string or structured dtype")
    return a


def deadline_of(timeout):
    """The monotonic time at which a call made now times out (None: never)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"shmtree: timeout must be None or a number >= 0, got {timeout!r}")
    return time.monotonic() + timeout


def _checked_deadline(timeout, error):
    """deadline_of; with a local error to say in the round, a bad timeout is no second error
    (the round then has no deadline)."""
    if error is None:
        return deadline_of(timeout)
    try:
        return deadline_of(timeout)
    except ValueError:
        return None


def split_bounds(n, parts):
    """np.array_split's bounds of n items in `parts` pieces: [0, ..., n] (piece j is
    [b[j], b[j+1])): the first n % parts pieces hold one item more.  The one block formula (the
    engine's C twin: block_lo in engine/msg.pxi)."""
    q, r = divmod(n, parts)
    return [j * q + min(j, r) for j in range(parts + 1)]


def scatter_shape(a, out, P, me):
    """reduce_scatter: rank me's rows [lo, hi) of `a` (split_bounds) and its result shape,
    after checking `out` against it."""
    b = split_bounds(a.shape[0], P)
    lo, hi = b[me], b[me + 1]
    shape = (hi - lo,) + a.shape[1:]
    if out is not None and (not isinstance(out, np.ndarray) or out.shape != shape
                            or out.dtype != a.dtype or not out.flags.writeable):
        raise ValueError(f"shmtree: reduce_scatter: out must be a writable array of shape "
                         f"{shape} and dtype {a.dtype}")
    return lo, hi, shape


def destination(a, out):
    """A reduction's output for input `a`: (result to return, aligned C-contiguous array the
    engine writes, array to copy it back into or None).  out may be an ndarray of a's shape
    and dtype, or a writable buffer of a's size."""
    if out is None:
        result = np.empty(a.shape, dtype=a.dtype)
        return result, result, None
    o = check_destination(a, out)
    if o.flags.c_contiguous and o.flags.aligned:
        return out, o, None
    tmp = np.empty(a.shape, dtype=a.dtype)
    return out, tmp, o


def check_destination(a, out):
    """destination's checks of an out= (not None), making nothing: out as an ndarray (a
    buffer's flat view), or the ValueError that says what is wrong."""
    o = out if isinstance(out, np.ndarray) else _as_flat_buffer(out)
    if o.dtype != a.dtype:
        raise ValueError(f"shmtree: out has dtype {o.dtype}, the input has {a.dtype}")
    if isinstance(out, np.ndarray):
        if o.shape != a.shape:
            raise ValueError(f"shmtree: out has shape {o.shape}, the input has {a.shape}")
    elif o.size != a.size:
        raise ValueError(f"shmtree: out holds {o.size} items, the input has {a.size}")
    if not o.flags.writeable:
        raise ValueError("shmtree: out is read-only")
    return o


def _as_flat_buffer(out):
    try:
        view = memoryview(out)
    except TypeError:
        raise ValueError(f"shmtree: out must be a numpy array or a writable buffer, got "
                         f"{type(out).__name__}") from None
    if view.readonly:
        raise ValueError("shmtree: out is read-only")
    return np.asarray(view).reshape(-1)


def out_for(out, shape, dtype, what):
    """A writable C-contiguous array of (shape, dtype): `out` itself when it is one, else a new
    array (None) - and the array to copy the result into afterwards, if any."""
    if out is None:
        return np.empty(shape, dtype), None
    check_out(out, shape, dtype, what)
    if out.flags.c_contiguous and out.flags.aligned:
        return out, None
    return np.empty(shape, dtype), out


def check_out(out, shape, dtype, what):
    """out_for's checks of an out= (not None), making nothing: a writable ndarray of (shape,
    dtype), or the ValueError that says what is wrong."""
    if not isinstance(out, np.ndarray):
        raise ValueError(f"shmtree: {what}: out must be a numpy array, got {type(out).__name__}")
    if out.dtype != dtype or out.shape != tuple(shape):
        raise ValueError(f"shmtree: {what}: out has shape {out.shape} and dtype {out.dtype}; the "
                         f"result has shape {tuple(shape)} and dtype {np.dtype(dtype)}")
    if not out.flags.writeable:
        raise ValueError(f"shmtree: {what}: out is read-only")


def finish(result, copy_back):
    if copy_back is None:
        return result
    copy_back[...] = result
    return copy_back


bytes_of = _moving.bytes_of     # a C-contiguous, aligned uint8 view of an array's bytes (a copy
                                # when it is not laid out so)


# ---- dtypes as the descriptors carry them ----

_NAMED = 1 << 62                # a digest that is the dtype's str itself (see dtype_digest)


@functools.lru_cache(maxsize=256)
def dtype_digest(dtype) -> int:
    """A dtype as a number, byte order and fields included: its str (at most 7 bytes, such as
    '<f8' or '|S5') with bit 62 set, when the str names it (mismatch messages then say the
    dtype in words: dtype_text), else a 32-bit digest of its pickle."""
    dt = np.dtype(dtype)
    key = dt.str.encode()
    if len(key) <= 7 and dt.fields is None and dt.subdtype is None and _named_by_str(dt):
        return int.from_bytes(key, "little") | _NAMED
    return int.from_bytes(hashlib.sha256(pickle.dumps(dt)).digest()[:4], "little")


def _named_by_str(dt) -> bool:
    """Does dt.str name dt itself?  (Not for ml_dtypes' types: bfloat16's is '<V2', float8's
    '<f1', which numpy does not even parse.)"""
    try:
        return np.dtype(dt.str) == dt
    except TypeError:
        return False


def dtype_text(digest) -> str:
    """The dtype a dtype_digest stands for, in words: its name ('float64', '>i4', 'S5'; the
    name of an ml_dtypes type such as bfloat16 when ml_dtypes is loaded); a dtype without such
    a name (structured) is known by its digest."""
    digest = int(digest)
    if digest & _NAMED:
        try:
            dt = np.dtype(int(digest & (_NAMED - 1)).to_bytes(7, "little").rstrip(b"\0")
                          .decode())
            return str(dt)
        except (TypeError, ValueError, UnicodeDecodeError):
            pass
    ml = sys.modules.get("ml_dtypes")
    for name in _EXTENSION_TYPES if ml is not None else ():
        kind = getattr(ml, name, None)
        if kind is not None and dtype_digest(np.dtype(kind)) == digest:
            return name
    return f"#{digest:08x} (structured, or of an extension such as ml_dtypes)"


_EXTENSION_TYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz",
                    "float8_e4m3fnuz", "float8_e5m2fnuz", "int4", "uint4")
