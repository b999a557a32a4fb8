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
Before any data, broadcast exchanges every rank's claim (a digest of what it passed) with the
root's dtype and shape, and allgather(axis=0) the lengths.
"""
from __future__ import annotations

import functools
import hashlib
import pickle
import struct

import numpy as np
from numpy.ma import MaskedArray      # (np.ma is imported lazily: look it up once)

from . import _engine, _kernels
from .codes import (KIND_ALLGATHER, KIND_ALLGATHER_LENGTHS, KIND_BROADCAST, KIND_REDUCE,
                    KIND_REDUCE_SCATTER, KIND_ROOT_STEP)
from .errors import CollectiveMismatchError
from .ops import reduction_codes

_U1 = _kernels.DTYPE_CODES["u1"]
_BOR = _kernels.OP_CODES["bor"]
META_BYTES = 2048            # the root's dtype and shape in a broadcast's first round
CLAIM_BYTES = 8              # each rank's digest of what it passed to broadcast / allgather


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


@functools.lru_cache(maxsize=256)
def _dtype_digest(dtype) -> int:
    """A 32-bit digest of a dtype, byte order and fields included."""
    return int.from_bytes(hashlib.sha256(pickle.dumps(np.dtype(dtype))).digest()[:4], "little")


@functools.lru_cache(maxsize=256)
def _meta(dtype, shape) -> bytes:
    """The root's description of a broadcast: its dtype and shape, pickled."""
    return pickle.dumps((dtype, shape), protocol=4)


@functools.lru_cache(maxsize=256)
def _claim(dtype, shape) -> bytes:
    """8 nonzero bytes naming (dtype, shape): what a rank passed."""
    h = hashlib.sha256(pickle.dumps((np.dtype(dtype), tuple(shape)))).digest()[:CLAIM_BYTES]
    return bytes(b | 1 for b in h[:1]) + h[1:]


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
    rank, size, allreduce's local checks and _collective)."""

    # ---- broadcast ----

    def broadcast(self, array, root=0, *, out=None, timeout=None):
        """Every rank gets the root's array.  Elsewhere `array` is None (the shape and dtype come
        from the root) or an array of the root's shape and dtype whose values are ignored.
        Returns a new array on every rank, or `out`."""
        root = _root(root, self.size)
        me = self.rank
        if array is None and me == root:
            raise ValueError("shmtree: broadcast: the root must pass the array")
        a = None if array is None else _movable(array, "broadcast")
        P = self.size
        body = P * CLAIM_BYTES                  # claims | meta (META_BYTES) | inline data
        inline = max(0, self._small_bytes - body - META_BYTES)
        buf = bytearray(body + META_BYTES + inline)       # (bytes ops: cheaper than numpy's)
        if a is not None:
            buf[me * CLAIM_BYTES:(me + 1) * CLAIM_BYTES] = _claim(a.dtype, a.shape)
        if me == root:
            meta = _meta(a.dtype, a.shape)
            if len(meta) + 8 > META_BYTES:
                raise TypeError(f"shmtree: broadcast: the description of dtype {a.dtype} is too "
                                f"long ({len(meta)} bytes; at most {META_BYTES - 8})")
            struct.pack_into("<II", buf, body, len(meta), 1)
            buf[body + 8:body + 8 + len(meta)] = meta
            if a.nbytes <= inline:
                buf[body + META_BYTES:body + META_BYTES + a.nbytes] = _bytes_of(a).data
        first = np.frombuffer(buf, np.uint8)
        kind = KIND_BROADCAST + KIND_ROOT_STEP * root
        self._collective(kind, _BOR, _U1, first, first, first.shape, timeout)
        n = struct.unpack_from("<I", buf, body)[0]
        dtype, shape = _unmeta(bytes(buf[body + 8:body + 8 + n]))
        want = _claim(dtype, shape)
        wrong = [r for r in range(P) if buf[r * CLAIM_BYTES]
                 and buf[r * CLAIM_BYTES:(r + 1) * CLAIM_BYTES] != want]
        if wrong:
            raise CollectiveMismatchError(
                f"shmtree: ranks disagree on the collective call: broadcast(root={root}): the "
                f"root passed shape {tuple(shape)} and dtype {dtype}; "
                f"{'rank' if len(wrong) == 1 else 'ranks'} {','.join(map(str, wrong))} passed "
                f"another shape or dtype")
        result, copy_back = _out_for(out, shape, dtype, "broadcast")
        nbytes = result.nbytes
        view = _bytes_of(result) if nbytes else None
        if nbytes <= inline:
            if nbytes:
                view[...] = first[body + META_BYTES:body + META_BYTES + nbytes]
        elif self._own_algorithm("broadcast", nbytes):
            if me == root and not np.shares_memory(result, a):
                view[...] = _bytes_of(a)       # the chain starts from the root's output
            self._collective(kind, _BOR, _U1, None, view, (nbytes,), timeout,
                             coll=(_engine.BROADCAST, nbytes, self._pos[root], None))
        else:
            if me == root:
                src = _bytes_of(a)
            else:
                view[...] = 0
                src = view
            self._collective(kind, _BOR, _U1, src, view, (nbytes,), timeout)
        return _finish(result, copy_back)

    # ---- reduce ----

    def reduce(self, array, op="sum", root=0, *, out=None, timeout=None):
        """The root gets what allreduce would give (a new array, or `out`); the other ranks get
        None."""
        root = _root(root, self.size)
        kind = KIND_REDUCE + KIND_ROOT_STEP * root
        mine = out if self.rank == root else None
        if type(array) is np.ndarray and array.nbytes <= self._small_bytes:
            result = self._quick(array, op, mine, timeout, kind)     # inline: the allreduce
            if result is not None:
                return result if self.rank == root else None
        result = self._reducing(array, op, mine, timeout, kind, root=root)
        return result if self.rank == root else None

    # ---- allgather ----

    def allgather(self, array, *, axis=None, out=None, timeout=None):
        """axis=None: the arrays stacked, shape (size, *array.shape), result[r] rank r's array;
        axis=0: concatenated along axis 0 (the other dimensions agree, lengths may differ)."""
        if axis is not None and axis != 0:
            raise ValueError(f"shmtree: allgather: axis must be None or 0, got {axis!r}")
        a = _movable(array, "allgather")
        P, me = self.size, self.rank
        if axis is None:
            shape = (P,) + a.shape
            offsets = [r * a.nbytes for r in range(P + 1)]
            mine = a.shape                     # the descriptor: what this rank passed
        else:
            if a.ndim == 0:
                raise ValueError("shmtree: allgather(axis=0) needs arrays of at least 1 dimension")
            lengths = self._lengths(a)
            shape = (sum(lengths),) + a.shape[1:]
            row = a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
            offsets = np.concatenate([[0], np.cumsum([n * row for n in lengths])]).tolist()
            mine = shape                       # (the lengths are agreed on already)
        desc = mine + (a.dtype.itemsize, _dtype_digest(a.dtype))
        kind = KIND_ALLGATHER
        result, copy_back = _out_for(out, shape, a.dtype, "allgather")
        view = _bytes_of(result)
        if self._own_algorithm("allgather", view.size):
            view[offsets[me]:offsets[me + 1]] = _bytes_of(a)
            self._collective(kind, _BOR, _U1, None, view, desc, timeout,
                             coll=(_engine.ALLGATHER, view.size, 0, self._by_position(offsets)))
        else:
            if view.size:
                view[...] = 0
                view[offsets[me]:offsets[me + 1]] = _bytes_of(a)
            self._collective(kind, _BOR, _U1, view, view, desc, timeout)
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

    def _lengths(self, a):
        """allgather(axis=0): every rank's length along axis 0, after checking that the other
        dimensions and the dtype agree (a mismatch raises on every rank)."""
        P, me = self.size, self.rank
        table = np.zeros((P, 2), np.uint64)
        table[me] = (a.shape[0] + 1,
                     int.from_bytes(_claim(a.dtype, a.shape[1:]), "little") | 1)
        self._collective(KIND_ALLGATHER_LENGTHS, _BOR, _U1, table.view(np.uint8).reshape(-1),
                         table.view(np.uint8).reshape(-1), (P, 2), None)
        groups = {}
        for r in range(P):
            groups.setdefault(int(table[r, 1]), []).append(r)
        if len(groups) > 1:
            parts = "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {','.join(map(str, rs))}"
                              for rs in groups.values())
            raise CollectiveMismatchError(
                "shmtree: ranks disagree on the collective call: allgather(axis=0): the dtype or "
                f"the dimensions after the first differ between {parts}")
        return [int(n) - 1 for n in table[:, 0]]

    # ---- reduce_scatter ----

    def reduce_scatter(self, array, op="sum", *, out=None, timeout=None):
        """Rank r gets np.array_split(the full reduction, size, axis=0)[r]."""
        a = array if isinstance(array, np.ndarray) else np.asarray(array)
        if a.ndim == 0:
            raise ValueError("shmtree: reduce_scatter needs an array of at least 1 dimension")
        n, P, me = a.shape[0], self.size, self.rank
        lo = me * (n // P) + min(me, n % P)                 # np.array_split's blocks
        hi = lo + n // P + (1 if me < n % P else 0)
        shape = (hi - lo,) + a.shape[1:]
        if out is not None and (not isinstance(out, np.ndarray) or out.shape != shape
                                or out.dtype != a.dtype or not out.flags.writeable):
            raise ValueError(f"shmtree: reduce_scatter: out must be a writable array of shape "
                             f"{shape} and dtype {a.dtype}")
        nbytes = a.nbytes
        if self._own_algorithm("reduce_scatter", nbytes) and not isinstance(a, MaskedArray):
            return self._reduce_scatter_ring(a, op, out, timeout, n, shape)
        full = self._quick(a, op, None, timeout, KIND_REDUCE_SCATTER) \
            if type(a) is np.ndarray else None                     # inline: the allreduce
        if full is None:
            full = self._reducing(a, op, None, timeout, KIND_REDUCE_SCATTER)
        if out is None:
            return np.ascontiguousarray(full[lo:hi])
        out[...] = full[lo:hi]
        return out

    def _reduce_scatter_ring(self, a, op, out, timeout, n, shape):
        """The ring schedule's first half: each rank ends with its own block reduced."""
        opc, dtc = reduction_codes(op, a.dtype)
        src = a if (a.flags.c_contiguous and a.flags.aligned) else np.ascontiguousarray(a)
        row = src.nbytes // n                      # bytes per row (n > 0: the message is large)
        P = self.size
        offsets = tuple((r * (n // P) + min(r, n % P)) * row for r in range(P + 1))
        result, copy_back = _out_for(out, shape, a.dtype, "reduce_scatter")
        if np.may_share_memory(result, src):
            src = src.copy()
        self._collective(KIND_REDUCE_SCATTER, opc, dtc, src, result, a.shape, timeout,
                         coll=(_engine.REDUCE_SCATTER, src.nbytes, 0,
                               self._by_position(offsets)))
        return _finish(result, copy_back)
