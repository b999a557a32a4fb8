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
import pickle
import time

import numpy as np

from . import _engine, _kernels, _moving, calls
from .codes import (ABORT_FAILED, KIND_ALLGATHER, KIND_ALLGATHER_LENGTHS, KIND_BROADCAST,
                    KIND_REDUCE, KIND_REDUCE_SCATTER, KIND_ROOT_STEP, WORDS_BYTES, grouped,
                    ranks_text)
from .errors import CollectiveMismatchError
from .ops import dtype_words as _dtype_words

_U1 = _kernels.DTYPE_CODES["u1"]
_BOR = _kernels.OP_CODES["bor"]


# (the parse's rules, calls.py; by these names for the multi-node steps, nodes.py)
_root = calls.check_root
_movable = calls.movable
_dtype_digest = calls.dtype_digest
_dtype_text = calls.dtype_text
_out_for = calls.out_for
_finish = calls.finish
_bytes_of = calls.bytes_of
_deadline = calls.deadline_of
_scatter_block = calls.scatter_shape


@functools.lru_cache(maxsize=256)
def _unmeta(raw: bytes):
    return pickle.loads(raw)


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
        if self._fast_allreduce(buf, "bor", buf, left, kind, limit=limit) is None:
            self._collective(kind, _BOR, _U1, buf, buf, buf.shape, deadline, limit=limit)

    # ---- allgather ----

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

    def _prep_reduce_scatter_spec(self, spec):
        a, opc, dtc, out, deadline = spec.array, spec.opc, spec.dtc, spec.out, spec.deadline
        n = a.shape[0]
        lo, hi, shape = calls.scatter_shape(a, out, self.size, self.rank)
        if self._own_algorithm("reduce_scatter", a.nbytes):
            return lambda: self._reduce_scatter_ring(a, opc, dtc, out, deadline, n, shape)
        run = self._prep_reducing_spec(calls.CallSpec(         # inline: the allreduce
            "reduce_scatter", calls.ALLREDUCE, KIND_REDUCE_SCATTER, a, None, spec.op, opc, dtc,
            deadline=deadline))
        return lambda: _keep(run()[lo:hi], out)

    def _reduce_scatter_ring(self, a, opc, dtc, out, deadline, n, shape):
        """The ring schedule's first half: each rank ends with its own block reduced."""
        src = a if (a.flags.c_contiguous and a.flags.aligned) else np.ascontiguousarray(a)
        row = src.nbytes // n                      # bytes per row (n > 0: the message is large)
        P = self.size
        offsets = tuple(b * row for b in calls.split_bounds(n, P))
        result, copy_back = _out_for(out, shape, a.dtype, "reduce_scatter")
        # (out overlapping the input: the engine's begin_coll copies it, the overlap rule)
        self._collective(KIND_REDUCE_SCATTER, opc, dtc, src, result, a.shape, deadline,
                         coll=(_engine.REDUCE_SCATTER, src.nbytes, 0,
                               self._by_position(offsets)))
        return _finish(result, copy_back)


def _keep(block, out):
    """reduce_scatter of an inline message: this rank's block of the allreduce's result."""
    if out is None:
        return np.ascontiguousarray(block)
    out[...] = block
    return out
