"""The executors of one machine's calls (docs/design.md, "One call"): a parsed call (calls.py)
normalised into what the engine takes as it is, run as Engine.call, and what follows it.

Every call enters the engine through Engine.call.  A plain ndarray call comes there straight
from the front end (Communicator._quick: the engine's parser, the C twin of calls.py); every
other call is parsed (calls.py) and normalised here - the input made C-contiguous and aligned,
out= replaced by a temporary it is copied into afterwards, an input that overlaps out= without
being it copied first (the overlap rule, _engine.clash) - and then enters the very same
Engine.call, which then takes it as it is.  Which algorithm runs is the engine's selection (the
Plan's table): nothing here compares sizes.

What remains in Python is what follows an engine call, never a second way of making it:
broadcast's rare paths (a root's dtype too complex for the first round, a mismatch said in
words, data that takes a round of its own), allgather(axis=0)'s lengths, and the rounds of words
with which every rank says what it passed when the calls disagree.  Each is an engine call of
its own, with the collective's descriptor kind, so that a rank making a different call raises
CollectiveMismatchError on every rank and the group stays usable.
"""
from __future__ import annotations

import functools
import pickle

import numpy as np

from . import _engine, _moving, calls
from .calls import ALLGATHER, ALLREDUCE, BROADCAST, REDUCE, REDUCE_SCATTER
from .codes import (KIND_ALLGATHER, KIND_ALLGATHER_LENGTHS, KIND_BARRIER,
                    WORDS_BYTES, grouped, ranks_text)
from .errors import CollectiveMismatchError
from .ops import dtype_words as _dtype_words

__all__ = ["Executors"]

_out_for = calls.out_for     # (a module name: the output a broadcast's rank gets made when the
                             # data follows, _bcast_output; a test makes it fail there)


@functools.lru_cache(maxsize=256)
def _unmeta(raw: bytes):
    return pickle.loads(raw)


def _plain(a):
    """a, or a C-contiguous aligned copy of it."""
    flags = a.flags
    return a if (flags.c_contiguous and flags.aligned) else np.array(a, order="C")


class Executors:
    """The executors of Communicator (which provides rank, size, _call: one engine call made
    and driven to its end, and _drive / _interrupted / _call_name)."""

    def _prepared(self, spec):
        """The function that runs a parsed call's rounds, in order with the rank's other calls,
        and returns its result."""
        if spec.error is not None:
            raise spec.error
        coll = spec.coll
        if coll == ALLREDUCE or coll == REDUCE:
            return functools.partial(self._reducing, spec)
        if coll == BROADCAST:
            return functools.partial(self._broadcast, spec)
        if coll == ALLGATHER:
            return functools.partial(self._allgather, spec)
        if coll == REDUCE_SCATTER:
            return functools.partial(self._reduce_scatter, spec)
        return functools.partial(self._call, calls.BARRIER, None, None, None, 0, KIND_BARRIER,
                                 spec.deadline)

    # ---- allreduce, reduce, reduce_scatter ----

    def _reducing(self, spec):
        a, root = spec.array, spec.root
        mine = root is None or root == self.rank
        result, dst, copy_back = calls.destination(a, spec.out if mine else None)
        src = _plain(a)
        if _engine.clash(src, dst):
            src = src.copy()                  # (out overlaps the input without being it)
        self._call(spec.coll, src, dst.reshape(src.shape) if mine else None,
                   (spec.opc, spec.dtc), root or 0, spec.kind, spec.deadline)
        if copy_back is not None and mine:
            copy_back[...] = dst.reshape(copy_back.shape)
        return result if mine else None

    def _reduce_scatter(self, spec):
        a, out = spec.array, spec.out
        _, _, shape = calls.scatter_shape(a, out, self.size, self.rank)
        result, copy_back = calls.out_for(out, shape, a.dtype, "reduce_scatter")
        src = _plain(a)
        if _engine.clash(src, result):
            src = src.copy()
        self._call(REDUCE_SCATTER, src, result, (spec.opc, spec.dtc), 0, spec.kind,
                   spec.deadline)
        return calls.finish(result, copy_back)

    # ---- allgather ----

    def _allgather(self, spec):
        a, out, deadline = spec.array, spec.out, spec.deadline
        P, me = self.size, self.rank
        if spec.axis is None:
            result, copy_back = calls.out_for(out, (P,) + a.shape, a.dtype, "allgather")
            src = _plain(a)
            if not _is_row(src, result, me) and _engine.clash(src, result):
                src = src.copy()              # (out overlaps the input: the overlap rule)
            self._call(ALLGATHER, src, result, None, 0, KIND_ALLGATHER, deadline,
                       calls.dtype_digest(a.dtype))
            return calls.finish(result, copy_back)
        lengths = self._lengths(a, deadline)
        shape = (sum(lengths),) + a.shape[1:]
        row = a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
        offsets = np.concatenate([[0], np.cumsum([n * row for n in lengths])]).tolist()
        desc = shape + (a.dtype.itemsize, calls.dtype_digest(a.dtype))
        result, copy_back = calls.out_for(out, shape, a.dtype, "allgather")
        view = calls.bytes_of(result)
        own = view[offsets[me]:offsets[me + 1]]
        src = calls.bytes_of(a)
        if not (src.size and _moving.address(src) == _moving.address(own)) \
                and _engine.clash(src, view):
            src = src.copy()
        self._call(ALLGATHER, src, view, None, 0, KIND_ALLGATHER, deadline, 0, desc,
                   self._by_position(offsets))
        return calls.finish(result, copy_back)

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
        table[me] = (a.shape[0] + 1, _engine.claim(a.dtype, a.shape[1:]))
        raw = table.view(np.uint8).reshape(-1)
        self._call(ALLREDUCE, raw, raw, "bor", 0, KIND_ALLGATHER_LENGTHS, deadline, 0, (P, 2))
        if (table[:, 1] != table[0, 1]).any():      # (every rank has the same table)
            said = self._words_round(f"shape {a.shape} and dtype {_dtype_words(a.dtype)}",
                                     deadline)
            raise CollectiveMismatchError(
                "shmtree: ranks disagree on the collective call: allgather(axis=0): the dtype or "
                "the dimensions after the first differ: "
                + "; ".join(f"{ranks_text(rs)}: {text}" for rs, text in grouped(said)))
        return [int(n) - 1 for n in table[:, 0]]

    # ---- broadcast ----

    def _broadcast(self, spec):
        """broadcast, normalised: the root's array C-contiguous and aligned, out= a temporary
        when the engine cannot write it as it is."""
        a, root, out = spec.array, spec.root, spec.out
        me = self.rank
        if me == root:
            a = _plain(a)
        copy_back = None
        if out is not None and not _engine.fits(out, out if a is None else a):
            copy_back, out = out, np.empty(out.shape if a is None else a.shape,
                                           out.dtype if a is None else a.dtype)
        claim = out if a is None else a
        got = self._call(BROADCAST, a, out, None, root, spec.kind, spec.deadline)
        if type(got) is tuple:
            got = self._broadcast_rest(got, claim, root, out, spec.kind, spec.deadline)
        return calls.finish(got, copy_back)

    def _broadcast_rest(self, got, a, root, out, kind, deadline):
        """broadcast after its first round, when the data did not come (engine/bcast.pxi,
        bcast_ended: (what bcast_read said, the round, its room)); a is what this rank passed
        (or its out=)."""
        P, me = self.size, self.rank
        said, first, room = got
        if said[0] == "long":                 # the root's dtype and shape follow, pickled
            meta = np.zeros(said[1], np.uint8)
            if me == root:
                meta[:] = np.frombuffer(_engine.long_meta(a), np.uint8)
            self._bytes_round(meta, kind, deadline)
            dtype, shape = _unmeta(meta.tobytes())
            wrong = _engine.wrong_claims(first, P, _engine.claim(dtype, shape))
            said = ("mismatch", dtype, shape, wrong) if wrong else ("data", dtype, shape)
        tag, dtype, shape = said[:3]
        if tag == "mismatch":               # (every rank read the same claims: all are here)
            words = self._words_round("nothing" if a is None else
                                      f"shape {tuple(a.shape)} and dtype "
                                      f"{_dtype_words(a.dtype)}", deadline)
            wrong = [r for r in said[3] if r != root]
            raise CollectiveMismatchError(
                f"shmtree: ranks disagree on the collective call: broadcast(root={root}): the "
                f"root passed shape {tuple(shape)} and dtype {_dtype_words(dtype)}; "
                + "; ".join(f"{ranks_text(rs)} passed {text}" for rs, text in
                            grouped(words, wrong))
                + "; every rank must pass None, or an array (or out=) of the root's shape and "
                  "dtype")
        result, copy_back = calls.out_for(out, shape, dtype, "broadcast")
        nbytes = result.nbytes
        if not nbytes:
            return calls.finish(result, copy_back)
        view = calls.bytes_of(result)
        if tag == "inline":
            at = _engine.CLAIM_BYTES * P + _engine.META_BYTES
            view[...] = first[at:at + nbytes]
            return calls.finish(result, copy_back)
        if me == root and _moving.address(result) != _moving.address(a):
            view[...] = calls.bytes_of(a)     # (the data leaves from the root's output; numpy's
        self._call(BROADCAST, None, view, None, root, kind, deadline,   # copy minds overlap)
                   _engine.DATA_ONLY)
        return calls.finish(result, copy_back)

    def _bcast_output(self, said):
        """The output of a rank that passed neither an array nor out=, when the data follows
        the round in the same call: ("data", dtype, shape) is what the round said."""
        return _out_for(None, said[2], said[1], "broadcast")[0]

    # ---- rounds of bytes and words ----

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

    def _bytes_round(self, buf, kind, deadline):
        """One round of a uint8 array in which every rank contributes its own bytes (a bitwise
        or), in place."""
        self._call(ALLREDUCE, buf, buf, "bor", 0, kind, deadline)


def _is_row(a, result, me):
    """Is `a` exactly row `me` of result (allgather in place: out[rank] passed)?"""
    return (a.nbytes and a.flags.c_contiguous
            and _moving.address(a) == _moving.address(result) + me * a.nbytes)
