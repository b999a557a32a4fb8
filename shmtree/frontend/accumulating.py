"""The Accumulator allreduce (issue 37; docs/design.md, "Reproducible sums"): comm.allreduce of
an Accumulator, and reproducible=True - its rounds, on one machine (Local: engine calls under
the call's kind) and across nodes (Across: the Spanning's pipelined allreduce, after the call's
agreement round, repro.spanning).

Every rank's state is summed as integers, which any order gives exactly (shmtree/_accum.pyx):
the group's lowest bit of every element (a max of int16), then every rank's limbs aligned to it
in 2 words summed by the engine's int64 allreduce (a trailer row counts the elements that did
not fit, and the flags a result depends on: the wider words and a bitwise-or round of the flags
only when needed); a small one is one allgather of every rank's state, merged locally.
reproducible=True of float64 past the small path takes the same two rounds without a state
(_ulp_sum: every term at its unit in the last place; docs/design.md).
"""
from __future__ import annotations

import math

import numpy as np

from .. import _accum, _rounding
from . import calls
from ..accumulator import Accumulator
from .calls import ALLGATHER, ALLREDUCE, bytes_of

__all__ = ["accumulating", "accumulated", "allreduce_accumulator", "Local", "Across"]

SMALL_WORDS = 3             # an Accumulator allreduce of at most SMALL_STATE bytes in all ...
SMALL_STATE = 64 << 10      # ... is one allgather of states of 1 + SMALL_WORDS int64 each
SMALL_TERMS = 8 << 10       # reproducible=True of at most this per rank (and SMALL_STATE in
                            # all): one allgather of the terms (past it, the exact sum of P
                            # terms per element costs more here than the large form's rounds)


def accumulating(comm, spec):
    """An Accumulator allreduce on one machine."""
    return accumulated(Local(comm, spec), spec)


def accumulated(rounds, spec):
    """The merged Accumulator of every rank's (spec.array an Accumulator), or, for
    reproducible=True, its result() into out= (or a new array)."""
    given = spec.array
    if type(given) is Accumulator:
        return allreduce_accumulator(rounds, given)
    comm = rounds.comm
    result, dst, copy_back = calls.destination(given, spec.out)
    if rounds.small and given.nbytes <= SMALL_TERMS and given.nbytes * rounds.size <= SMALL_STATE:
        _terms_sum(rounds, given, dst)
    elif given.dtype == np.float64:           # (every state a scratch array of the call's)
        n = given.size
        x = np.ascontiguousarray(given).reshape(-1)
        if rounds.size == 1 or not _ulp_sum(rounds, x, dst, comm):
            state = _accum.from_values(x, _scratch(comm, "q", (n,), np.int16),
                                       _scratch(comm, "limbs", (n, 2), np.int64),
                                       _scratch(comm, "flags", (n,), np.uint8))
            acc = Accumulator._made(given.shape, given.dtype, *state, True)
            total = allreduce_accumulator(rounds, acc, comm)
            total._result_into(dst.reshape(-1), dst)
    else:
        total = allreduce_accumulator(rounds, Accumulator._of_one(given), comm)
        total._result_into(None, dst)
    if copy_back is not None:
        copy_back[...] = dst.reshape(copy_back.shape)
    return result


def _dims(shape, dtype):
    """The shape words of an Accumulator allreduce's rounds (a disagreement between ranks is
    the engine's to name)."""
    return (list(shape) if len(shape) <= 28 else [math.prod(shape)]) + \
        [calls.dtype_digest(dtype)]


def _terms_sum(rounds, given, dst):
    """reproducible=True, small (every rank's array at most SMALL_TERMS bytes, P times at most
    SMALL_STATE): one allgather of the terms as they are, summed exactly here (every rank the
    same terms, so the same sum) and rounded once into dst."""
    rows = np.empty((rounds.size,) + given.shape, given.dtype)
    rounds.allgather(np.ascontiguousarray(given), rows, _dims(given.shape, given.dtype) + [-2])
    if given.dtype != np.float64:
        Accumulator.of(rows, axis=0)._result_into(None, dst)
        return
    terms, flat = rows.reshape(rounds.size, -1), dst.reshape(-1)
    if _rounding.sum_rows(terms, flat):      # (a special term, a wide span, an overflow)
        Accumulator._made(given.shape, given.dtype, *_accum.from_terms(terms),
                          True)._result_into(flat, dst)


def _small(rounds, n):
    """Is an Accumulator allreduce of n elements the small one (one allgather of every rank's
    state)?"""
    return rounds.small and (n + 1) * (1 + SMALL_WORDS) * 8 * rounds.size <= SMALL_STATE


def _ulp_sum(rounds, x, dst, scratch):
    """reproducible=True of float64 terms x (one per rank and element), past the small path,
    without an Accumulator's state: every x at its unit in the last place (_accum.ulp_quanta:
    the group's least of every element, a max of int16), then every x at that quantum in two
    words summed by the engine's int64 allreduce, rounded once into dst (C-contiguous float64:
    the exact sums rounded to nearest even, the bits of the general path's result).  Returns
    False, dst not written, where the group has a NaN, an infinity or a -0.0 term (the first
    round's last entry), or an element whose terms lie too far apart for two words (the
    second's): the caller goes the general way."""
    n, P = x.shape[0], rounds.size
    dims = _dims(dst.shape, dst.dtype)
    neg = _scratch(scratch, "neg", (n + 1,), np.int16)
    neg[n] = int(_accum.ulp_quanta(x, neg[:n]) > 0)
    rounds.allreduce(neg, "max", dims)
    if neg[n]:
        return False
    out = _scratch(scratch, "out", (n + 1, 2), np.int64)
    out[n, 0] = int(_accum.ulp_limbs(x, neg[:n], max(1, (P - 1).bit_length()), out[:n]) > 0)
    out[n, 1] = 0
    rounds.allreduce(out, "sum", dims)
    if out[n, 0]:
        return False
    flat = dst.reshape(-1)
    if _accum.round_sums(out[:n], neg[:n], flat):
        # (a subnormal or out-of-range result somewhere: the sums as an Accumulator's state,
        # rounded the general way, which also raises as math.fsum does on an overflow)
        q = np.negative(neg[:n])
        limbs = out[:n]
        _accum.normalize_sum(limbs, q)
        flags = np.full(n, _accum.FLAG_OTHER, np.uint8)
        Accumulator._made(dst.shape, dst.dtype, q, limbs, flags, True)._result_into(flat, dst)
    return True


def _scratch(comm, name, shape, dtype):
    """A scratch array of a reproducible=True call (its states, which it does not return):
    kept on the communicator, grown as needed (calls of one communicator run one at a
    time), so that a large call does not pay a page fault per 4 KiB every time."""
    store = comm.__dict__.setdefault("_repro_scratch", {})
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes > _SCRATCH_BYTES:
        return np.empty(shape, dtype)
    buf = store.get(name)
    if buf is None or buf.nbytes < nbytes:
        buf = store[name] = np.empty(max(nbytes, 64), np.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)


_SCRATCH_BYTES = 64 << 20


def allreduce_accumulator(rounds, acc, scratch=None):
    """The Accumulator of every rank's terms: every rank's state summed exactly (the module's
    docstring; rounds: the communicator's rounds, Local or Across; scratch: the communicator
    whose scratch arrays hold the merged state, when the caller does not keep it)."""
    q, limbs, flags, nonempty = acc._state()
    n, P = q.shape[0], rounds.size
    dims = _dims(acc.shape, acc.dtype)
    if P == 1:
        return acc.copy()
    if _small(rounds, n):
        rows = np.empty((P, n + 1, 1 + SMALL_WORDS), np.int64)
        rounds.allgather(_accum.small_rows(q, limbs, flags, nonempty, SMALL_WORDS), rows,
                         dims + [-1])
        got = _accum.merge_rows(rows)
        if got is not None:
            return acc._like(*got)
    # the group's lowest bit of every element: a max of -q (QNONE is the least), and (the
    # last entry) whether any rank has terms
    neg = np.empty(n + 1, np.int16) if scratch is None else \
        _scratch(scratch, "neg", (n + 1,), np.int16)
    np.negative(q, out=neg[:n])
    neg[n] = int(bool(nonempty))
    rounds.allreduce(neg, "max", dims)
    any_terms = bool(neg[n])
    qg = np.negative(neg[:n]) if scratch is None else \
        np.negative(neg[:n], out=_scratch(scratch, "qg", (n,), np.int16))
    # the limbs at the group's q, in 2 words when every element fits (the last row: how many
    # elements did not, how many flags a result depends on: summed with the limbs)
    extra = max(1, (P - 1).bit_length())
    words = 2                                 # (the same on every rank: the round's shape)
    out = np.empty((n + 1, words), np.int64) if scratch is None else \
        _scratch(scratch, "out", (n + 1, words), np.int64)
    need = _accum.aligned(q, limbs, qg, extra, out[:n])
    mine = int(bool((flags & _accum.SPECIAL).any()))
    out[n, 0] = int(need > words)
    out[n, 1] = mine
    rounds.allreduce(out, "sum", dims)
    if out[n, 0]:                             # (some rank's did not fit: as many as any needs)
        head = np.array([need], np.int64)
        rounds.allreduce(head, "max", dims)
        out = np.empty((n + 1, int(head[0])), np.int64)
        _accum.realign(q, limbs, qg, out[:n])
        out[n] = 0
        out[n, 1] = mine
        rounds.allreduce(out, "sum", dims)
    special = bool(out[n, 1])
    if special:                               # (some rank has a NaN, an infinity, a -0.0)
        got_flags = flags.copy()
        rounds.allreduce(got_flags, "bor", dims)
    else:                                     # (every term of every element is "other")
        got_flags = np.full(n, _accum.FLAG_OTHER if any_terms else 0, np.uint8)
    limbs_out = out[:n]
    _accum.normalize_sum(limbs_out, qg)
    return acc._like(qg, limbs_out, got_flags, any_terms)


class Local:
    """The rounds of an Accumulator allreduce on one machine: engine calls under the call's
    kind."""

    small = True

    def __init__(self, comm, spec):
        self.comm, self.kind, self.deadline = comm, spec.kind, spec.deadline
        self.size = comm.size

    def allreduce(self, buf, op, dims):
        self.comm._call(ALLREDUCE, buf, buf, op, 0, self.kind, self.deadline, 0, dims)

    def allgather(self, row, rows, dims):
        self.comm._call(ALLGATHER, bytes_of(row), bytes_of(rows), None, 0, self.kind,
                        self.deadline, 0, dims, self.comm._even_positions(row.nbytes))


class Across:
    """The rounds of an Accumulator allreduce across nodes: the Spanning's pipelined
    allreduce (after the call's agreement round)."""

    small = False

    def __init__(self, comm, deadline):
        self.comm, self.deadline, self.size = comm, deadline, comm.size

    def allreduce(self, buf, op, dims):
        flat = buf.reshape(-1)
        self.comm._reduce_pipeline(flat, flat, op, True, self.deadline)
