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
import math

import numpy as np

from .. import _engine, _moving
from . import calls, repro
from .calls import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, EXSCAN, GATHER, REDUCE,
                    REDUCE_SCATTER, SCAN, SCATTER, CallSpec)
from ..codes import (KIND_ALLGATHER, KIND_ALLGATHER_LENGTHS, KIND_ALLTOALL, KIND_BARRIER,
                    KIND_COUNTS, KIND_ROOT_STEP, KIND_SCAN_BACK, WORDS_BYTES, grouped, kind_name,
                    ranks_text)
from ..errors import CollectiveMismatchError
from ..ops import OP_NAMES, dtype_words as _dtype_words

from .rounds import _Rounds, _plain, error_words  # noqa: F401  (the mixin)
__all__ = ["Executors"]

_out_for = calls.out_for     # (a module name: the output a broadcast's rank gets made when the
                             # data follows, _bcast_output; a test makes it fail there)


WORK_BYTES = 64 << 20       # Executors._work: scratch kept up to this size
KIND_A2AV = KIND_COUNTS + KIND_ROOT_STEP * KIND_ALLTOALL    # alltoall(counts=)'s call: its
                            # first round carries the counts (engine/alg_exchange.pxi)


class Executors(_Rounds):
    """The executors of Communicator (which provides rank, size, _call: one engine call made
    and driven to its end, and _drive / _interrupted / _call_name)."""

    def _prepared(self, spec):
        """The function that runs a parsed call's rounds, in order with the rank's other calls,
        and returns its result."""
        if spec.error is not None:
            raise spec.error
        coll = spec.coll
        if spec.reproducible and coll != SCAN and coll != EXSCAN:
            return repro.prepared(self, spec)     # (deterministic=True, Accumulator: repro.py)
        if coll == ALLREDUCE or coll == REDUCE:
            return functools.partial(self._reducing, spec)
        if coll == BROADCAST:
            return functools.partial(self._broadcast, spec)
        if coll == ALLGATHER:
            return functools.partial(self._allgather, spec)
        if coll == REDUCE_SCATTER:
            return functools.partial(self._reduce_scatter, spec)
        if coll == ALLTOALL:
            return functools.partial(self._alltoall, spec)
        if coll == GATHER:
            return functools.partial(self._gather, spec)
        if coll == SCATTER:
            return functools.partial(self._scatter, spec)
        if coll == SCAN or coll == EXSCAN:
            return functools.partial(self._scan, spec)
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

    def _even_positions(self, nbytes):
        """_by_position of blocks of nbytes each (rank r's at r * nbytes)."""
        got = self._positions.get(nbytes)
        if got is None:
            got = self._by_position(tuple(r * nbytes for r in range(self.size + 1)))
            self._positions[nbytes] = got
        return got

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

    # ---- alltoall, gather, scatter, scan, exscan: made of exchanges (_exchange) ----
    #
    # An exchange moves B[p*P + q] bytes from rank p to rank q (B: P*P uint64, the same on every
    # rank), from each rank's outgoing bytes back to back in destination order into its incoming
    # bytes back to back in source order.  Each executor below is: agree on what is not known
    # locally (a counts round, or the root's shape and dtype), lay out B, exchange, and (scan)
    # fold and exchange back.  A local error found only after an agreement round (an out= of
    # the wrong length) is said in place of the next round (_said), so every rank's call ends.

    def _alltoall(self, spec):
        """alltoall: equal blocks, the engine's own form; counts=, one engine call whose first
        round carries every rank's counts (engine/msg.pxi, msg_alltoallv: out= given is checked
        there on every rank, by its own length) - or, in a group too large for the counts to
        fit that round, a counts round first and then the exchange."""
        a, out, deadline, kind = spec.array, spec.out, spec.deadline, spec.kind
        me = self.rank
        digest = calls.dtype_digest(a.dtype)
        if spec.counts is None:               # (equal blocks: the engine's own form)
            result, copy_back = calls.out_for(out, a.shape, a.dtype, "alltoall")
            src = _apart(_plain(a), result)
            self._call(ALLTOALL, src, result, None, 0, kind, deadline, digest)
            return calls.finish(result, copy_back)
        if self._counts_travel():
            dst, copy_back = out, None
            if out is not None and not (out.flags.c_contiguous and out.flags.aligned):
                dst, copy_back = np.empty(out.shape, out.dtype), out   # (its length: its claim)
            src = _plain(a) if dst is None else _apart(_plain(a), dst)
            got = self._call(ALLTOALL, src, dst, None, 0, KIND_A2AV, deadline, 0, None,
                             spec.counts)
            if type(got) is tuple:
                self._counts_disagree(got[1], a, out, deadline)
            return calls.finish(got, copy_back)
        rest = a.shape[1:]
        table, said = self._counts_round(spec.counts, a, None, kind, deadline)
        n = sum(row[me] for row in said)
        if out is not None and out.shape[0] != n:
            self._said(ValueError(f"shmtree: alltoall: out has {out.shape[0]} rows; this rank "
                                  f"receives {n}"), kind, deadline)
        result, copy_back = calls.out_for(out, (n,) + rest, a.dtype, "alltoall")
        src = _apart(_plain(a), result)
        B = (table * np.uint64(_row_bytes(a))).reshape(-1)
        self._exchange(src, result, B, kind, rest + (a.dtype.itemsize, digest), deadline)
        return calls.finish(result, copy_back)

    def _gather(self, spec):
        a, out, deadline, kind, root = spec.array, spec.out, spec.deadline, spec.kind, spec.root
        P, me = self.size, self.rank
        mine = me == root
        digest = calls.dtype_digest(a.dtype)
        src = _plain(a)
        if spec.axis is None:
            shape = (P,) + a.shape
            if gather_gathers(a.nbytes, P, self._plan.small_bytes):   # one engine allgather
                result, copy_back = (calls.out_for(out, shape, a.dtype, "gather") if mine
                                     else (np.empty(shape, a.dtype), None))
                if not _is_row(src, result, me) and _engine.clash(src, result):
                    src = src.copy()
                self._call(ALLGATHER, src, result, None, 0, kind, deadline, digest)
                return calls.finish(result, copy_back) if mine else None
            B = np.zeros(P * P, np.uint64)
            B[root::P] = a.nbytes
            dims = a.shape + (a.dtype.itemsize, digest)
        else:
            rest = a.shape[1:]
            table, said = self._counts_round((a.shape[0],), a, root, kind, deadline)
            n = sum(row[0] for row in said)
            if mine and out is not None and out.shape[0] != n:
                self._said(ValueError(f"shmtree: gather: out has {out.shape[0]} rows; the "
                                      f"ranks send {n}"), kind, deadline)
            shape = (n,) + rest
            B = np.zeros(P * P, np.uint64)
            B[root::P] = table[:, 0] * np.uint64(_row_bytes(a))
            dims = rest + (a.dtype.itemsize, digest)
        if mine:
            result, copy_back = calls.out_for(out, shape, a.dtype, "gather")
            src = _apart(src, result)
        else:
            result, copy_back = _NOTHING, None
        self._exchange(src, result, B, kind, dims, deadline)
        return calls.finish(result, copy_back) if mine else None

    def _scatter(self, spec):
        """scatter: one engine call (engine/scatter.pxi) - a first round in which every rank
        that passed out= claims its block, then the data, inline or by the exchange of the
        root's blocks in the same call - normalised here: the root's array C-contiguous and
        aligned (and clear of its out=), an out= the engine cannot write replaced by a
        temporary of its shape and dtype, copied back.  What the round leaves to Python (a long
        description, a mismatch, no ring channel): _scatter_rest."""
        a, out, root = spec.array, spec.out, spec.root
        mode = _engine.SCATTER_ROWS if spec.axis is None else _engine.SCATTER_SPLIT
        src = _plain(a) if self.rank == root else None
        dst, copy_back = out, None
        if out is not None and not (out.flags.c_contiguous and out.flags.aligned
                                    and not out.dtype.hasobject):
            dst, copy_back = np.empty(out.shape, out.dtype), out
        if src is not None and dst is not None and src.size and np.may_share_memory(src, dst):
            src = src.copy()
        got = self._call(SCATTER, src, dst, None, root, spec.kind, spec.deadline, mode)
        if type(got) is tuple:
            got = self._scatter_rest(got, src, dst, root, mode, spec.kind, spec.deadline)
        return calls.finish(got, copy_back)

    def _scatter_rest(self, got, a, out, root, mode, kind, deadline):
        """scatter after its first round, when the data did not come (scatter_ended's tuple:
        (what the round said, the round, its room)): a long description (pickled in a round of
        its own), then the claims checked; a mismatch said in words on every rank; or the
        exchange of the root's blocks as a call of its own.  a: the root's array (None
        elsewhere), out: this rank's output or None."""
        P, me = self.size, self.rank
        said, first, room = got
        if said[0] == "long":                 # the root's dtype and shape follow, pickled
            dtype, shape = self._long_description(said[1], a, root, kind, deadline)
            nbytes = dtype.itemsize * math.prod(shape)
            wrong = _engine.scatter_claims_wrong(first, P, mode, dtype, shape, nbytes)
            said = ("mismatch", dtype, shape, wrong) if wrong else ("data", dtype, shape)
        tag, dtype, shape = said[:3]
        nbytes = dtype.itemsize * math.prod(shape)
        if tag == "mismatch":                 # (every rank read the same claims: all are here)
            words = self._words_round("nothing" if out is None or me == root else
                                      f"out= of shape {tuple(out.shape)} and dtype "
                                      f"{_dtype_words(out.dtype)}", deadline)
            wrong = [r for r in said[3] if r != root]
            blocks = "; ".join(
                f"rank {r}'s block has shape {_engine.scatter_block(mode, shape, nbytes, P, r)[0]}"
                for r in wrong)
            raise CollectiveMismatchError(
                f"shmtree: ranks disagree on the collective call: scatter(root={root}): the "
                f"root passed shape {tuple(shape)} and dtype {_dtype_words(dtype)} ({blocks}); "
                + "; ".join(f"{ranks_text(rs)} passed {text}" for rs, text in
                            grouped(words, wrong))
                + "; every rank must pass out=None, or an out= of its block's shape and the "
                  "root's dtype")
        block, _, n = _engine.scatter_block(mode, shape, nbytes, P, me)
        result = out if out is not None else np.empty(block, dtype)
        B = np.zeros(P * P, np.uint64)
        B[root * P:root * P + P] = [_engine.scatter_block(mode, shape, nbytes, P, q)[2]
                                    for q in range(P)]
        src = calls.bytes_of(a) if me == root else _NOTHING
        self._exchange(src, calls.bytes_of(result) if n else _NOTHING, B, kind,
                       tuple(shape) + (dtype.itemsize, calls.dtype_digest(dtype)), deadline)
        return result

    def _scan(self, spec):
        """scan / exscan.  Where the engine takes it (scan_takes): the engine's own call
        (Engine.call's SCAN, EXSCAN: small ones one allgather of the inputs, each rank folding
        the rows it needs in C; large ones, when the ring order is the rank order, the
        reduce's chain with every rank keeping its prefix), the very call the quick path and
        a persistent call make.  Else the transpose scheme:
        exchange 1 sends block b (np.array_split of the items into P) of every rank to rank b,
        which folds its P rows in rank order; exchange 2 sends prefix row r back to rank r.
        Bytes sent per rank: 2(P-1)/P x."""
        a, deadline, kind = spec.array, spec.deadline, spec.kind
        P, me = self.size, self.rank
        dt = a.dtype
        exclusive = spec.coll == EXSCAN
        result, dst, copy_back = calls.destination(a, spec.out)
        src = _plain(a)
        digest = calls.dtype_digest(dt)
        if self._engine.scan_takes(a.nbytes, exclusive):   # (gathered, or the chain)
            self._call(spec.coll, src, dst.reshape(src.shape), (spec.opc, spec.dtc), 0, kind,
                       deadline, digest)
            if copy_back is not None:
                copy_back[...] = dst.reshape(copy_back.shape)
            return result
        shape = a.shape if a.ndim <= 32 else (a.size,)
        dims = shape + (spec.opc, dt.itemsize, digest)
        n = a.size
        b = calls.split_bounds(n, P)
        sizes = np.array([b[q + 1] - b[q] for q in range(P)], np.uint64) * dt.itemsize
        m = b[me + 1] - b[me]
        rows = self._work(0, (P, m), dt)
        self._exchange(_apart(src, dst).reshape(-1), rows, np.tile(sizes, P), kind, dims,
                       deadline)
        if exclusive:
            prefix = _engine.fold(rows, spec.opc, self._work(1, (P, m), dt), True)
        else:
            prefix = _engine.fold(rows, spec.opc, rows)   # (in place)
        self._exchange(prefix, dst.reshape(-1), np.repeat(sizes, P), KIND_SCAN_BACK, dims,
                       deadline)
        if copy_back is not None:
            copy_back[...] = dst.reshape(copy_back.shape)
        return result

    def _work(self, which, shape, dtype):
        """Scratch of (shape, dtype) for a call's own use (scan's rows and prefixes), kept for
        the next call up to WORK_BYTES: a fresh array of megabytes costs a page fault per 4 KiB
        page on every call (2 MiB: 1 ms on a VM, ten times the exchange that fills it).  Calls of
        one communicator run one at a time, so one set serves them all."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > WORK_BYTES:
            return np.empty(shape, dtype)
        works = self.__dict__.setdefault("_works", [None, None])
        buf = works[which]
        if buf is None or buf.nbytes < nbytes:
            buf = works[which] = np.empty(max(nbytes, 4096), np.uint8)
        return buf[:nbytes].view(dtype).reshape(shape)

    def _exchange(self, src, dst, B, kind, dims, deadline):
        """One exchange (above), the engine's alltoall: B[p*P + q] bytes from rank p to rank q
        (P*P uint64, C-contiguous, the same on every rank); src this rank's outgoing bytes
        (C-contiguous), dst (C-contiguous, writable, sharing no memory with src) its incoming;
        dims the descriptor's shape, the same on every rank."""
        self._call(ALLTOALL, src, dst, None, 0, kind, deadline, 0, list(dims), B)

    _counts_inline = None       # (_counts_travel's answer, once asked)

    def _counts_travel(self):
        """Does alltoall(counts=) send its counts in the call's first round here (one engine
        call: _engine.counts_in_round, a matter of the group's size)?"""
        got = self._counts_inline
        if got is None:
            got = self._counts_inline = bool(_engine.counts_in_round(self._engine))
        return got

    def _counts_disagree(self, first, a, out, deadline):
        """alltoall(counts=) whose first round (first: its bytes, engine/alg_exchange.pxi) says
        the ranks disagree - every rank read the same round, so every rank comes here: the
        dtypes or dimensions after the first differ (a round of words then names what each rank
        passed), or a rank's out= has another length than the rows it receives.  Raises
        CollectiveMismatchError."""
        P, me = self.size, self.rank
        rows = np.frombuffer(first, np.uint64, P * (P + 2)).reshape(P, P + 2)
        if (rows[:, 0] != rows[0, 0]).any():
            said = self._words_round(f"shape {a.shape} and dtype {_dtype_words(a.dtype)}",
                                     deadline)
            raise CollectiveMismatchError(
                "shmtree: ranks disagree on the collective call: alltoall: the dtype or the "
                "dimensions after the first differ: "
                + "; ".join(f"{ranks_text(rs)}: {text}" for rs, text in grouped(said)))
        got = rows[:, 2:].sum(axis=0).tolist()          # the rows each rank receives
        said = [f"alltoall: out has {int(rows[r, 1]) - 1} rows; this rank receives {got[r]}"
                for r in range(P)]
        bad = [r for r in range(P) if rows[r, 1] and int(rows[r, 1]) - 1 != got[r]]
        if me in bad:                 # (as the others say it: the words of a ValueError)
            raise CollectiveMismatchError(f"shmtree: {said[me]}")
        raise CollectiveMismatchError(
            "shmtree: " + "; ".join(f"rank {r} raised ValueError: {said[r]} in "
                                    f"{kind_name(KIND_A2AV)}" for r in bad)
            + " (a local error of its arguments), so the call cannot complete on any rank")

    def _counts_round(self, counts, a, root, kind, deadline):
        """A round of counts before a call whose blocks differ in size (gather(axis=0); and
        alltoall(counts=) where its counts do not travel in its own first round): every rank's
        counts, as a (P, len(counts)) uint64 table and as lists by
        rank, after checking that every rank passed the same root, dtype and dimensions after
        the first (else CollectiveMismatchError on every rank, naming what each passed)."""
        P, me = self.size, self.rank
        w = len(counts)
        table = np.zeros((P, w + 2), np.uint64)
        table[me, :w] = counts
        table[me, w] = 0 if root is None else root + 1
        table[me, w + 1] = _engine.claim(a.dtype, a.shape[1:])
        raw = table.view(np.uint8).reshape(-1)
        base = kind % KIND_ROOT_STEP
        self._call(ALLREDUCE, raw, raw, "bor", 0, KIND_COUNTS + KIND_ROOT_STEP * base, deadline,
                   0, (P, w + 2))
        said = table.tolist()
        if any(row[w:] != said[0][w:] for row in said):
            said = self._words_round(("" if root is None else f"root={root}, ")
                                     + f"shape {a.shape} and dtype {_dtype_words(a.dtype)}",
                                     deadline)
            what = "the root, " if root is not None else ""
            raise CollectiveMismatchError(
                f"shmtree: ranks disagree on the collective call: {kind_name(base)}: "
                f"{what}the dtype or the dimensions after the first differ: "
                + "; ".join(f"{ranks_text(rs)}: {text}" for rs, text in grouped(said)))
        return table[:, :w], said

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


_NOTHING = np.empty(0, np.uint8)


def _apart(src, dst):
    """src, or a copy of it when it shares memory with dst (an exchange reads every input
    while it writes every output)."""
    return src.copy() if src.size and np.may_share_memory(src, dst) else src


def _row_bytes(a):
    return a.dtype.itemsize * math.prod(a.shape[1:])


def _fold(rows, opc, out=None):
    """The inclusive prefixes of rows (axis 0, any layout) in rank order, into out (rows
    itself: in place; None: a new array): the engine's fold (_engine.fold, in C: numpy's
    accumulate bit for bit - float16 and bfloat16 rounded after every step, min and max by
    numpy's rule - except complex products, which follow allreduce's kernel, the textbook
    formula, DESIGN section 11, and the NaN two NaNs give, the kernels' left one)."""
    src = _plain(rows)
    if out is None:
        return _engine.fold(src, opc, np.empty(src.shape, src.dtype))
    dst = out if out is src else _plain(out) if out.flags.writeable else None
    if dst is None or (dst is not src and np.may_share_memory(src, dst)):
        dst = np.empty(src.shape, src.dtype)
    _engine.fold(src, opc, dst)
    if dst is not out:
        out[...] = dst
    return out


SCAN_GATHER_BYTES = _engine.SCAN_GATHER_BYTES   # scan_gathers: up to this many bytes in all
scan_gathers = _engine.scan_gathers             # (the one rule, the engine's: it declines a
                                                # larger scan, and the parsed call asks it)


GATHER_ALL_BYTES = 64 << 10     # gather_gathers: up to this many bytes in all, at P <= 4


def gather_gathers(nbytes, P, small_bytes):
    """Does a gather(axis=None) of nbytes per rank run as one engine allgather (every rank
    gets every block; the root keeps them)?  Small ones (one inline round), and at P <= 4 up
    to GATHER_ALL_BYTES in all: one engine round moving (P-1) blocks to every rank costs less
    there than the exchange to the root (P = 2, 32 KiB: an allgather 6 us, the exchange 15).
    The rule of the parsed call, the quick one and a persistent one alike."""
    whole = nbytes * P
    return whole <= small_bytes or (P <= 4 and whole <= GATHER_ALL_BYTES)


def _identity(opc, dt, shape):
    """exscan's rank 0: the op's identity (sum 0, prod 1, min the largest value or +inf, max
    the smallest or -inf, band all ones / True, bor and bxor 0)."""
    name = OP_NAMES[opc]
    if name in ("sum", "bor", "bxor"):
        return np.zeros(shape, dt)
    if name == "prod":
        return np.ones(shape, dt)
    if name == "band":
        return np.invert(np.zeros(shape, dt))
    low = name == "max"
    if dt.kind == "b":
        return np.full(shape, not low, dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return np.full(shape, info.min if low else info.max, dt)
    return np.full(shape, -np.inf if low else np.inf, dt)


def _is_row(a, result, me):
    """Is `a` exactly row `me` of result (allgather in place: out[rank] passed)?"""
    return (a.nbytes and a.flags.c_contiguous
            and _moving.address(a) == _moving.address(result) + me * a.nbytes)
