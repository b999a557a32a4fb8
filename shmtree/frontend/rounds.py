"""The rounds that follow an engine call when the ranks must say more: a mixin of
Executors (collectives.py) - a disagreement said in place of the call's next round (_said),
broadcast's rare paths (a long description, a mismatch in words, data in a round of its
own), and the rounds of words and bytes.
"""
from __future__ import annotations

import functools
import pickle
import numpy as np

from .. import _engine, _moving
from . import calls
from .calls import BROADCAST
from ..codes import grouped, ranks_text
from ..errors import CollectiveMismatchError
from ..ops import dtype_words as _dtype_words


@functools.lru_cache(maxsize=256)
def _unmeta(raw: bytes):
    return pickle.loads(raw)
def _plain(a):
    """a, or a C-contiguous aligned copy of it."""
    flags = a.flags
    return a if (flags.c_contiguous and flags.aligned) else np.array(a, order="C")
def error_words(exc) -> bytes:
    """A local error as an error round carries it (at most _engine.ERROR_TEXT bytes)."""
    text = f"{type(exc).__name__}: {str(exc).removeprefix('shmtree: ')}".encode(
        "utf-8", "replace")
    if len(text) > _engine.ERROR_TEXT:
        text = text[:_engine.ERROR_TEXT - 3].decode("utf-8", "ignore").encode() + b"..."
    return text


class _Rounds:
    """Executors' rounds of words, bytes and broadcast's rest."""

    def _said(self, exc, kind, deadline):
        """A disagreement this rank found after a round of its call (an out= that does not fit
        what the round said: the root's dtype or block, the rows the others send): said in
        place of the call's next round, so that every other rank's call ends with
        CollectiveMismatchError naming it; then raised here as a CollectiveMismatchError too,
        with its own words (a ValueError as well).  An out= that this rank's own arguments
        show wrong is a plain ValueError, raised at the parse."""
        self._error_round(kind, error_words(exc), deadline)
        raise CollectiveMismatchError(*exc.args) from None

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

    def _long_description(self, length, a, root, kind, deadline):
        """The root's (dtype, shape) when its first round said "long" (a dtype or shape too
        complex for the round: broadcast's and scatter's): pickled by the root (a, its array)
        into a round of `length` bytes of its own, read alike on every rank."""
        meta = np.zeros(length, np.uint8)
        if self.rank == root:
            meta[:] = np.frombuffer(_engine.long_meta(a), np.uint8)
        self._bytes_round(meta, kind, deadline)
        return _unmeta(meta.tobytes())

    def _broadcast_rest(self, got, a, root, out, kind, deadline):
        """broadcast after its first round, when the data did not come (engine/bcast.pxi,
        bcast_ended: (what bcast_read said, the round, its room)); a is what this rank passed
        (or its out=)."""
        P, me = self.size, self.rank
        said, first, room = got
        if said[0] == "long":                 # the root's dtype and shape follow, pickled
            dtype, shape = self._long_description(said[1], a, root, kind, deadline)
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
