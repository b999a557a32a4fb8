"""broadcast, reduce, allgather and reduce_scatter (docs/design.md, "Collectives").

Each collective is parsed here (root, dtypes, shapes, out=, the byte layout of the message) and
then runs as engine calls whose descriptor carries the collective's kind and root (kind +
KIND_ROOT_STEP * root), so a rank that made a different collective, with another root, shape or
dtype, makes every rank raise CollectiveMismatchError naming what differed, and the group stays
usable.

How each one moves its bytes (docs/algorithms.md, "Collectives beyond allreduce"): when the
message does not travel inline, on the engine's own algorithms around the ring order
(Engine.begin_coll: a pipelined chain from or to the root, the ring schedule's reduce-scatter or
allgather half); inline, on the allreduce - broadcast and allgather as a
bitwise-or of bytes in which each rank contributes only its part (exact for every dtype),
reduce and reduce_scatter as the allreduce, keeping the root's result or the rank's block.
Broadcast's first round carries every rank's claim (a digest of what it passed), the root's
dtype and shape, and the data itself when it fits (layout in _moving.pyx, which builds and reads
it in one C pass); a larger message follows in the same engine call (Engine.quick_bcast).
allgather(axis=0) first exchanges the lengths.  The common calls of every collective run whole
in C (Engine.quick, quick_broadcast, quick_allgather, quick_reduce_scatter, quick_reduce), with
the same rounds; the `_prep_<name>` paths take every other call.
"""
from __future__ import annotations

import functools
import hashlib
import pickle
import time

import numpy as np
from numpy.ma import MaskedArray      # (np.ma is imported lazily: look it up once)

from . import _engine, _kernels, _moving, arrays as _arrays
from .arrays import either_foreign as _foreign, numpy_args as _numpy_args
from .codes import (ABORT_FAILED, KIND_ALLGATHER, KIND_ALLGATHER_LENGTHS, KIND_BROADCAST,
                    KIND_REDUCE, KIND_REDUCE_SCATTER, KIND_ROOT_STEP, WORDS_BYTES, grouped,
                    ranks_text)
from .errors import CollectiveMismatchError
from .ops import dtype_words as _dtype_words, reduction_codes

_U1 = _kernels.DTYPE_CODES["u1"]
_BOR = _kernels.OP_CODES["bor"]


def _root(root, size):
    if isinstance(root, bool) or not hasattr(root, "__index__") \
            or not 0 <= root.__index__() < size:
        raise ValueError(f"shmtree: root must be an int in [0, {size}), got {root!r}")
    return root.__index__()


def _movable(a, what):
    if not isinstance(a, np.ndarray):
        a = np.asarray(a)
    if isinstance(a, MaskedArray):
        raise TypeError(f"shmtree: {what}: masked arrays are not supported (the mask would be "
                        "dropped)")
    if a.dtype.hasobject:
        raise TypeError(f"shmtree: {what}: dtype {a.dtype} holds Python objects, which cannot "
                        "be sent as bytes; use a numeric, string or structured dtype")
    return a


_NAMED = 1 << 62                # a digest that is the dtype's str itself (see _dtype_digest)


@functools.lru_cache(maxsize=256)
def _dtype_digest(dtype) -> int:
    """A dtype as a number, byte order and fields included: its str (at most 7 bytes, such as
    '<f8' or '|S5') with bit 62 set, when the str names it (mismatch messages then say the
    dtype in words: _dtype_text), else a 32-bit digest of its pickle."""
    dt = np.dtype(dtype)
    key = dt.str.encode()
    if (len(key) <= 7 and dt.fields is None and dt.subdtype is None
            and np.dtype(dt.str) == dt):
        return int.from_bytes(key, "little") | _NAMED
    return int.from_bytes(hashlib.sha256(pickle.dumps(dt)).digest()[:4], "little")


def _dtype_text(digest) -> str:
    """The dtype a _dtype_digest stands for, in words: its name ('float64', '>i4', 'S5'); a
    dtype without such a name (structured, ml_dtypes' bfloat16) is known by its digest."""
    if digest & _NAMED:
        try:
            dt = np.dtype(int(digest & (_NAMED - 1)).to_bytes(7, "little").rstrip(b"\0")
                          .decode())
            return str(dt)
        except (TypeError, ValueError, UnicodeDecodeError):
            pass
    return f"#{digest:08x} (structured, or of an extension such as ml_dtypes)"


@functools.lru_cache(maxsize=256)
def _unmeta(raw: bytes):
    return pickle.loads(raw)


def _bytes_of(a):
    """A C-contiguous, aligned uint8 view of a's bytes (a copy when a is not laid out so)."""
    if not (a.flags.c_contiguous and a.flags.aligned):
        a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8) if a.size else np.empty(0, np.uint8)


def _out_for(out, shape, dtype, what):
    """A writable C-contiguous array of (shape, dtype): `out` itself when it is one, else a new
    array (None) - and the array to copy the result into afterwards, if any."""
    if out is None:
        return np.empty(shape, dtype), None
    if not isinstance(out, np.ndarray):
        raise ValueError(f"shmtree: {what}: out must be a numpy array, got {type(out).__name__}")
    if out.dtype != dtype or out.shape != tuple(shape):
        raise ValueError(f"shmtree: {what}: out has shape {out.shape} and dtype {out.dtype}; the "
                         f"result has shape {tuple(shape)} and dtype {np.dtype(dtype)}")
    if not out.flags.writeable:
        raise ValueError(f"shmtree: {what}: out is read-only")
    if out.flags.c_contiguous and out.flags.aligned:
        return out, None
    return np.empty(shape, dtype), out


def _finish(result, copy_back):
    if copy_back is None:
        return result
    copy_back[...] = result
    return copy_back


class Collectives:
    """The collectives beyond allreduce and barrier, as methods of Communicator (which provides
    rank, size, the fast path _quick, _collective, and _now / _post: run a prepared call at once
    or post it to the progress thread).

    Each collective is a `_prep_<name>` that checks the arguments (a local error is raised here,
    by the call itself) and returns the prepared call: a function that runs its rounds, in
    order with the rank's other calls, and returns the result.  The blocking method runs it
    (`_now`), the `i`-method posts it (`_post`); small messages of a blocking call first try a
    fast path, when no nonblocking call is outstanding."""

    # ---- broadcast ----

    def broadcast(self, array, root=0, *, out=None, timeout=None):
        """Every rank gets the root's array.  Elsewhere `array` is None (the shape and dtype come
        from the root) or an array of the root's shape and dtype whose values are ignored.
        Returns a new array on every rank, or `out`."""
        if _foreign(array, out):
            return _arrays.call(self.broadcast, array, out, "broadcast", root, timeout=timeout)
        if type(root) is int and 0 <= root < self.size and self._idle():
            got = self._quick_broadcast(array, root, out, timeout)
            if got is not None:
                return got[0]
        return self._now(self._prep_broadcast(array, root, out, timeout))

    def ibroadcast(self, array, root=0, *, out=None, timeout=None):
        """broadcast, nonblocking: a Request."""
        array, out = _numpy_args(array, out, "ibroadcast")
        return self._post(self._prep_broadcast(array, root, out, timeout, posted=True),
                          "ibroadcast")

    def _prep_broadcast(self, array, root, out, timeout, posted=False):
        P = self.size
        if type(root) is not int or not 0 <= root < P:
            root = _root(root, P)
        deadline = _deadline(timeout)
        try:
            return self._prep_broadcast_args(array, root, out, deadline)
        except TypeError as exc:          # (a dtype holding Python objects: said to the
            raise self._local_error(exc, KIND_BROADCAST + KIND_ROOT_STEP * root, timeout,
                                    posted) from None         # other ranks in the round)

    def _prep_broadcast_args(self, array, root, out, deadline):
        me = self.rank
        if array is None:
            if me == root:
                raise ValueError("shmtree: broadcast: the root must pass the array")
            a = None
            if out is not None:               # its dtype and shape are this rank's claim
                if not isinstance(out, np.ndarray):
                    raise ValueError(f"shmtree: broadcast: out must be a numpy array, got "
                                     f"{type(out).__name__}")
                if not out.flags.writeable:
                    raise ValueError("shmtree: broadcast: out is read-only")
                a = _movable(out, "broadcast")
        else:
            a = array if type(array) is np.ndarray and not array.dtype.hasobject \
                else _movable(array, "broadcast")
            if out is not None:
                _out_for(out, a.shape, a.dtype, "broadcast")          # (checks out)
        return lambda: self._broadcast(a, root, out, deadline)

    def _broadcast(self, a, root, out, deadline):
        """broadcast (the general path): a is what this rank passed (on a rank that passed None
        with out=, out: its claim), None when it passed neither."""
        P, me = self.size, self.rank
        if me == root and not (a.flags.c_contiguous and a.flags.aligned):
            a = np.array(a, order="C")          # (aligned too)
        room = self._bcast_room
        first = _moving.bcast_fill(a, me == root, me, P, room)       # claims | meta | data
        return self._broadcast_on(a, root, out, deadline, first, room)

    def _broadcast_on(self, a, root, out, deadline, first, room):
        """broadcast from its first round on (`first`: this rank's part of it, with data room
        `room`).  One engine call carries the round and, when the data is neither inline nor
        described at length, the data too (Engine.quick_bcast); a rank that passed None gets
        its output allocated between the two."""
        me = self.rank
        kind = KIND_BROADCAST + KIND_ROOT_STEP * root
        pre = None                            # this rank's output, known before the round
        if a is not None and a.nbytes > self._small_bytes:
            pre = self._bcast_output(a, out, me == root)
        rc = self._bcast_call(first, None if pre is None else pre[0], root, kind, deadline)
        return self._broadcast_after(rc, a, root, out, deadline, first, room, pre)

    def _broadcast_after(self, rc, a, root, out, deadline, first, room, pre):
        """broadcast after its engine call began (rc: what it returned; pre: this rank's
        output if it gave it, as _bcast_output)."""
        P, me = self.size, self.rank
        kind = KIND_BROADCAST + KIND_ROOT_STEP * root
        eng = self._engine
        try:
            if rc != _engine.DONE and rc != _engine.NEED_OUT:
                rc = self._drive(eng.seq, deadline, rc)
            self._bcast_room = _moving.next_room(first, P, self._small_bytes)
            if rc == _engine.NEED_OUT:        # (the data follows: the root's dtype and shape
                got = _moving.bcast_read(first, None, P, room)         # are in the round)
                result, copy_back = _out_for(out, got[2], got[1], "broadcast")
                eng.resume_bcast(result)
                self._drive(eng.seq, deadline)
                return _finish(result, copy_back)
        except BaseException as exc:          # (the call is half-done: the group cannot go on)
            if isinstance(exc, Exception) and eng.owns_call():
                eng.cancel()
                self.group.abort(ABORT_FAILED, me, note=f"{type(exc).__name__} inside "
                                 f"{self._call_name(eng.seq)}: {exc}")
            else:
                self._interrupted(eng)
            raise
        if pre is not None and (eng.bc_ran or P == 1):      # (the data came; one rank: the
            return _finish(*pre)                            # root's output holds it)
        got = _moving.bcast_read(first, out, P, room)
        if type(got) is not tuple:
            return got                        # the data came inline
        if got[0] == "long":                  # the root's dtype and shape follow, pickled
            meta = np.zeros(got[1], np.uint8)
            if me == root:
                meta[:] = np.frombuffer(_moving.long_meta(a), np.uint8)
            self._bytes_round(meta, kind, deadline)
            dtype, shape = _unmeta(meta.tobytes())
            got = ("data", dtype, shape, _moving.wrong_claims(first, P,
                                                              _moving.claim(dtype, shape)))
            if got[3]:
                got = ("mismatch",) + got[1:]
        tag, dtype, shape = got[:3]
        if tag == "mismatch":               # (every rank read the same claims: all are here)
            said = self._words_round("nothing" if a is None else
                                     f"shape {tuple(a.shape)} and dtype {_dtype_words(a.dtype)}",
                                     deadline)
            wrong = [r for r in got[3] if r != root]
            raise CollectiveMismatchError(
                f"shmtree: ranks disagree on the collective call: broadcast(root={root}): the "
                f"root passed shape {tuple(shape)} and dtype {_dtype_words(dtype)}; "
                + "; ".join(f"{ranks_text(rs)} passed {text}" for rs, text in grouped(said, wrong))
                + "; every rank must pass None, or an array (or out=) of the root's shape and "
                  "dtype")
        result, copy_back = _out_for(out, shape, dtype, "broadcast")
        nbytes = result.nbytes
        view = _bytes_of(result) if nbytes else None
        if not nbytes:
            pass
        elif tag == "inline":
            at = _moving.CLAIM_BYTES * P + _moving.META_BYTES
            view[...] = first[at:at + nbytes]
        elif self._own_algorithm("broadcast", nbytes):     # (shared outs: the single copy)
            if me == root and not (pre is not None and pre[0] is result) \
                    and _moving.address(result) != _moving.address(a):
                view[...] = _bytes_of(a)       # the chain starts from the root's output (in
                                               # place: it is a; numpy's copy minds overlap)
            self._collective(kind, _BOR, _U1, None, view, (nbytes,), deadline,
                             coll=(_engine.BROADCAST, nbytes, self._pos[root], None))
        elif P == 1:
            view[...] = _bytes_of(a)
        else:                                 # (a bitwise-or in which only the root has bits)
            if me == root:
                src = _bytes_of(a)
            else:
                view[...] = 0
                src = view
            self._collective(kind, _BOR, _U1, src, view, (nbytes,), deadline)
        return _finish(result, copy_back)

    def _bcast_output(self, a, out, is_root):
        """A broadcast's output as this rank knows it before the first round, from what it
        passed: (result, copy_back) as _out_for gives them (the root's holding its data); a
        ValueError, before any round, when `out` does not fit `a`."""
        if out is not None and _moving.fits(out, a):
            result, copy_back = out, None
        else:
            result, copy_back = _out_for(out, a.shape, a.dtype, "broadcast")
        if is_root and result is not a and _moving.address(result) != _moving.address(a):
            _bytes_of(result)[...] = _bytes_of(a)       # (the data leaves from the output)
        return result, copy_back

    def _words_round(self, text, deadline=None):
        """What every rank says, by rank: one round of WORDS_BYTES of UTF-8 text each (a
        mismatch that every rank has seen, said in words; never pickled).  Inside a call (by the
        thread that runs it: the progress thread for a posted one), as _bytes_round."""
        raw = text.encode("utf-8")
        if len(raw) > WORDS_BYTES:
            raw = raw[:WORDS_BYTES - 3] + b"..."
        rows = np.zeros((self.size, WORDS_BYTES), np.uint8)
        rows[self.rank, :len(raw)] = np.frombuffer(raw, np.uint8)
        self._bytes_round(rows.reshape(-1), KIND_ALLGATHER, deadline)
        return [row.tobytes().rstrip(b"\0").decode("utf-8", "replace") for row in rows]

    def _bytes_round(self, buf, kind, deadline, limit=None):
        """One round of a uint8 array in which every rank contributes its own bytes (a bitwise
        or), in place: on allreduce's fast path when the engine takes it."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self._quick(buf, "bor", buf, left, kind, limit=limit) is None:
            self._collective(kind, _BOR, _U1, buf, buf, buf.shape, deadline, limit=limit)

    # ---- reduce ----

    def reduce(self, array, op="sum", root=0, *, out=None, timeout=None):
        """The root gets what allreduce would give (a new array, or `out`); the other ranks get
        None."""
        if _foreign(array, out):
            return _arrays.call(self.reduce, array, out, "reduce", op, root, timeout=timeout)
        root = _root(root, self.size)
        kind = KIND_REDUCE + KIND_ROOT_STEP * root
        mine = out if self.rank == root else None
        if type(array) is np.ndarray and self._idle():
            if array.nbytes <= self._small_bytes:
                result = self._quick(array, op, mine, timeout, kind)     # the allreduce
            else:
                result = self._quick_reduce(array, op, mine, root, kind, timeout)     # (in C)
            if result is not None:
                return result if self.rank == root else None
        return self._now(self._prep_reducing(array, op, mine, timeout, kind, root=root))

    def ireduce(self, array, op="sum", root=0, *, out=None, timeout=None):
        """reduce, nonblocking: a Request (its result None on ranks other than the root)."""
        array, out = _numpy_args(array, out, "ireduce")
        root = _root(root, self.size)
        kind = KIND_REDUCE + KIND_ROOT_STEP * root
        return self._post(self._prep_reducing(array, op, out if self.rank == root else None,
                                              timeout, kind, root=root, posted=True), "ireduce")

    # ---- allgather ----

    def allgather(self, array, *, axis=None, out=None, timeout=None):
        """axis=None: the arrays stacked, shape (size, *array.shape), result[r] rank r's array;
        axis=0: concatenated along axis 0 (the other dimensions agree, lengths may differ)."""
        if _foreign(array, out):
            return _arrays.call(self.allgather, array, out, "allgather", axis=axis,
                                timeout=timeout)
        if axis is None and type(array) is np.ndarray and self._idle():
            got = self._quick(array, None, out, timeout, KIND_ALLGATHER,
                              digest=_dtype_digest(array.dtype))     # (in C:
            if got is not None:                  # inline, the blocks or the single copy)
                return got
        return self._now(self._prep_allgather(array, axis, out, timeout))

    def iallgather(self, array, *, axis=None, out=None, timeout=None):
        """allgather, nonblocking: a Request."""
        array, out = _numpy_args(array, out, "iallgather")
        return self._post(self._prep_allgather(array, axis, out, timeout), "iallgather")

    def _prep_allgather(self, array, axis, out, timeout):
        if axis is not None and axis != 0:
            raise ValueError(f"shmtree: allgather: axis must be None or 0, got {axis!r}")
        deadline = _deadline(timeout)
        a = _movable(array, "allgather")
        if axis is None:
            _out_for(out, (self.size,) + a.shape, a.dtype, "allgather")    # (checks out)
        elif a.ndim == 0:
            raise ValueError("shmtree: allgather(axis=0) needs arrays of at least 1 dimension")
        return lambda: self._allgather(a, axis, out, deadline)

    def _allgather(self, a, axis, out, deadline):
        P, me = self.size, self.rank
        if axis is None:
            shape = (P,) + a.shape
            offsets = [r * a.nbytes for r in range(P + 1)]
            mine = a.shape                     # the descriptor: what this rank passed
        else:
            lengths = self._lengths(a, deadline)
            shape = (sum(lengths),) + a.shape[1:]
            row = a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
            offsets = np.concatenate([[0], np.cumsum([n * row for n in lengths])]).tolist()
            mine = shape                       # (the lengths are agreed on already)
        desc = mine + (a.dtype.itemsize, _dtype_digest(a.dtype))
        kind = KIND_ALLGATHER
        result, copy_back = _out_for(out, shape, a.dtype, "allgather")
        view = _bytes_of(result)
        own = view[offsets[me]:offsets[me + 1]]
        blocks = self._own_algorithm("allgather", view.size)    # (shared outs: single copy)
        in_place = (blocks and a.flags.c_contiguous and a.nbytes == own.size and a.nbytes
                    and _moving.address(a) == _moving.address(own))     # out[rank] passed
        if not in_place and _engine.clash(a, result):
            a = a.copy()                      # (out overlaps the input: the overlap rule)
        if blocks:
            if not in_place:
                own[...] = _bytes_of(a)
            self._collective(kind, _BOR, _U1, None, view, desc, deadline,
                             coll=(_engine.ALLGATHER, view.size, 0, self._by_position(offsets)))
        else:
            if view.size:
                view[...] = 0
                view[offsets[me]:offsets[me + 1]] = _bytes_of(a)
            self._collective(kind, _BOR, _U1, view, view, desc, deadline)
        return _finish(result, copy_back)

    def _by_position(self, offsets):
        """[lo, hi) of each ring position's block, from the ranks' byte offsets (rank r's block
        is offsets[r] .. offsets[r+1]); the same call shapes come back, so they are kept."""
        offsets = tuple(offsets)
        got = self._positions.get(offsets)
        if got is None:
            if len(self._positions) > 64:
                self._positions.clear()
            order = self.group.plan.large_tree.ring
            got = self._positions[offsets] = np.array(
                [x for r in order for x in (offsets[r], offsets[r + 1])], np.uint64)
        return got

    def _lengths(self, a, deadline):
        """allgather(axis=0): every rank's length along axis 0, after checking that the other
        dimensions and the dtype agree (a mismatch raises on every rank)."""
        P, me = self.size, self.rank
        table = np.zeros((P, 2), np.uint64)
        table[me] = (a.shape[0] + 1, _moving.claim(a.dtype, a.shape[1:]))
        self._collective(KIND_ALLGATHER_LENGTHS, _BOR, _U1, table.view(np.uint8).reshape(-1),
                         table.view(np.uint8).reshape(-1), (P, 2), deadline)
        if (table[:, 1] != table[0, 1]).any():      # (every rank has the same table)
            said = self._words_round(f"shape {a.shape} and dtype {_dtype_words(a.dtype)}",
                                     deadline)
            raise CollectiveMismatchError(
                "shmtree: ranks disagree on the collective call: allgather(axis=0): the dtype or "
                "the dimensions after the first differ: "
                + "; ".join(f"{ranks_text(rs)}: {text}" for rs, text in grouped(said)))
        return [int(n) - 1 for n in table[:, 0]]

    # ---- reduce_scatter ----

    def reduce_scatter(self, array, op="sum", *, out=None, timeout=None):
        """Rank r gets np.array_split(the full reduction, size, axis=0)[r]."""
        if _foreign(array, out):
            return _arrays.call(self.reduce_scatter, array, out, "reduce_scatter", op,
                                timeout=timeout)
        if type(array) is np.ndarray and self._idle():
            got = self._quick_reduce_scatter(array, op, out, timeout)     # (in C)
            if got is not None:
                return got
        return self._now(self._prep_reduce_scatter(array, op, out, timeout))

    def ireduce_scatter(self, array, op="sum", *, out=None, timeout=None):
        """reduce_scatter, nonblocking: a Request."""
        array, out = _numpy_args(array, out, "ireduce_scatter")
        return self._post(self._prep_reduce_scatter(array, op, out, timeout), "ireduce_scatter")

    def _prep_reduce_scatter(self, array, op, out, timeout):
        if isinstance(array, MaskedArray) or isinstance(out, MaskedArray):
            raise TypeError("shmtree: masked arrays are not supported (the mask would be "
                            "dropped); reduce array.filled(...) or the mask separately")
        a = array if isinstance(array, np.ndarray) else np.asarray(array)
        if a.ndim == 0:
            raise ValueError("shmtree: reduce_scatter needs an array of at least 1 dimension")
        n, P = a.shape[0], self.size
        lo, hi, shape = _scatter_block(a, out, P, self.rank)
        opc, dtc = reduction_codes(op, a.dtype)
        deadline = _deadline(timeout)
        if self._own_algorithm("reduce_scatter", a.nbytes):
            return lambda: self._reduce_scatter_ring(a, opc, dtc, out, deadline, n, shape)
        run = self._prep_reducing(a, op, None, timeout, KIND_REDUCE_SCATTER)   # inline: the
        return lambda: _keep(run()[lo:hi], out)                               # allreduce

    def _reduce_scatter_ring(self, a, opc, dtc, out, deadline, n, shape):
        """The ring schedule's first half: each rank ends with its own block reduced."""
        src = a if (a.flags.c_contiguous and a.flags.aligned) else np.ascontiguousarray(a)
        row = src.nbytes // n                      # bytes per row (n > 0: the message is large)
        P = self.size
        offsets = tuple((r * (n // P) + min(r, n % P)) * row for r in range(P + 1))
        result, copy_back = _out_for(out, shape, a.dtype, "reduce_scatter")
        # (out overlapping the input: the engine's begin_coll copies it, the overlap rule)
        self._collective(KIND_REDUCE_SCATTER, opc, dtc, src, result, a.shape, deadline,
                         coll=(_engine.REDUCE_SCATTER, src.nbytes, 0,
                               self._by_position(offsets)))
        return _finish(result, copy_back)


def _scatter_block(a, out, P, me):
    """reduce_scatter: rank me's rows [lo, hi) of `a` (np.array_split's blocks) and its result
    shape, after checking `out` against it."""
    n = a.shape[0]
    lo = me * (n // P) + min(me, n % P)
    hi = lo + n // P + (1 if me < n % P else 0)
    shape = (hi - lo,) + a.shape[1:]
    if out is not None and (not isinstance(out, np.ndarray) or out.shape != shape
                            or out.dtype != a.dtype or not out.flags.writeable):
        raise ValueError(f"shmtree: reduce_scatter: out must be a writable array of shape "
                         f"{shape} and dtype {a.dtype}")
    return lo, hi, shape


def _keep(block, out):
    """reduce_scatter of an inline message: this rank's block of the allreduce's result."""
    if out is None:
        return np.ascontiguousarray(block)
    out[...] = block
    return out


def _deadline(timeout):
    """The monotonic time at which a call posted now times out (None: never)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"shmtree: timeout must be None or a number >= 0, got {timeout!r}")
    return time.monotonic() + timeout
