"""Shared arrays (docs/design.md, "Shared arrays"): comm.empty / comm.zeros.

Memory.  Every rank's array of an allocation is a memfd of its own (anonymous: not counted in
/dev/shm, nor limited by its size; sealed against shrinking and growing, so no reader can take a
SIGBUS), mapped by its owner; the peers map it too, through /proc/<owner pid>/fd/<fd> while the
owner still holds the descriptor (same user only).  The allocation is a collective: the ranks
exchange (pid, fd, bytes, a claim of shape and dtype, the memory this rank can still get) in one
allgather before any page is committed; every rank checks the claims (a difference raises
CollectiveMismatchError on every rank, naming what each asked for) and the memory (more than the
least any rank can get raises MemoryError on every rank), maps the others, and the ranks agree
that every mapping succeeded before the owners close their descriptors.  Then only mappings
remain: rank r's memory is freed when r has dropped its array (every view included) and every
peer has dropped its own array of the same allocation (a rank's mappings of the peers' arrays
go with its own array: weakref.finalize on its mapping), or when the communicator is closed
(the peers' mappings are dropped; arrays still referenced stay valid as private memory).

Single copy.  Each allocation is also registered with the communicator's engine (its number,
this rank's stretch, every rank's mapping: Engine.share), which runs every collective of shared
arrays single-copy itself, from the sizes that do not travel inline up, with no Python in
between (shmtree/engine/alg_direct.pxi; docs/design.md, "Shared arrays"); the entry goes
(Engine.unshare) before the mappings do, and a call that may use the allocation holds its
mappings (Engine.share's keep) until it has ended, whatever another thread does meanwhile.
"""
from __future__ import annotations

import fcntl
import os
import weakref

import numpy as np

from . import _engine, _moving, transport
from .codes import grouped, ranks_text
from .errors import CollectiveMismatchError, ShmtreeError
from .ops import dtype_words


class SharedArrays:
    """A communicator's shared allocations."""

    def __init__(self, comm):
        self._comm = comm
        self.count = 0                # allocations made by the group (the same on every rank)
        self._live = {}               # id -> the peers' memory (flat uint8 arrays, None for
                                      # this rank), holding their mappings while this rank's
                                      # own array of the allocation lives

    # ---- allocation ----

    def allocate(self, shape, dtype, order, what):
        comm = self._comm
        shape, dtype, order = _normalize(shape, dtype, order, what)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        size = max(nbytes, 1)
        available = transport.available_memory()     # (read before this rank commits any)
        fd = os.memfd_create("shmtree-array", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)    # (no page is committed yet)
            # no peer (nor anyone) can shrink or grow it: no reader of it can take a SIGBUS
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            claim = _engine.claim(dtype, shape) ^ (2 if order == "F" else 0)
            mine = np.array([os.getpid(), fd, size, claim, available], np.uint64)
            table = comm.allgather(mine.view(np.int64)).view(np.uint64)
            claims = table[:, 3]
            if (claims != claims[0]).any():           # (every rank reads the same table)
                raise CollectiveMismatchError(self._mismatch(what, shape, dtype, order))
            need, have = int(table[:, 2].sum()), int(table[:, 4].min())
            if need > have:                           # (every rank alike, before any commits)
                raise MemoryError(_shortfall(what, shape, dtype, comm.size, size, need, have))
            own = _moving.Mapping(fd, size, touch=True)     # first touch: the owner's node
            peers, error = [], ""
            for r in range(comm.size):
                peers.append(None)
                if r == comm.rank:
                    continue
                pid, pfd, psize = (int(v) for v in table[r, :3])
                try:
                    peer_fd = os.open(f"/proc/{pid}/fd/{pfd}", os.O_RDWR | os.O_CLOEXEC)
                    try:
                        peers[r] = np.frombuffer(_moving.Mapping(peer_fd, psize), np.uint8)
                    finally:
                        os.close(peer_fd)
                except OSError as exc:
                    error = error or f"rank {comm.rank} cannot map rank {r}'s array: {exc}"
            # every mapping is made (or failed) before any owner closes its descriptor
            failed = comm.allreduce(np.array([bool(error)], np.uint8), "max")[0]
        finally:
            os.close(fd)
        if failed:
            raise ShmtreeError(f"shmtree: {what}: " + (error or "a peer could not map this "
                               "rank's array (ranks must run as the same user)"))
        self.count += 1
        self._live[self.count] = peers
        # the engine's single copies find the allocation by address; a call that may use it
        # holds `peers` (the mappings) until it has ended, even once the allocation is
        # forgotten (unshare: the array dropped, the communicator closed, interpreter exit)
        comm._engine.share(self.count, own.address, nbytes,
                           [own.address if v is None else _address(v) for v in peers], peers)
        # (not at exit: the mappings go with the process; a daemon progress thread may still be
        # inside a call then)
        weakref.finalize(own, self._forget, self.count).atexit = False
        array = np.frombuffer(own, np.uint8, nbytes) if nbytes else np.empty(0, np.uint8)
        return array.view(dtype).reshape(shape, order=order)

    def _mismatch(self, what, shape, dtype, order):
        """The ranks asked for different arrays (their claims differ: every rank knows it):
        say what each asked for, in words (one more round, of fixed-size text)."""
        comm = self._comm
        said = comm._now(lambda: comm._words_round(_described(shape, dtype, order)))
        return ("shmtree: ranks disagree on the collective call: " + what + ": "
                + "; ".join(f"{ranks_text(rs)} asked for {text}" for rs, text in grouped(said))
                + "; every rank must ask for the same shape, dtype and order")

    def _forget(self, ident):
        engine = self._comm._engine
        if engine is not None:
            engine.unshare(ident)
        self._live.pop(ident, None)

    def close(self):
        """Drop every mapping of the peers' arrays (own arrays stay valid, unshared); a call in
        progress in another thread keeps those it uses until it has ended (the engine holds
        them)."""
        engine = self._comm._engine
        while self._live:             # (a finalizer may pop entries meanwhile: no iterator)
            try:
                ident, _ = self._live.popitem()
            except KeyError:
                break
            if engine is not None:
                engine.unshare(ident)


def _described(shape, dtype, order) -> str:
    layout = "C" if order == "C" else "Fortran"
    return f"shape {shape}, dtype {dtype_words(dtype)}, {layout} order"


def _shortfall(what, shape, dtype, nranks, size, need, have) -> str:
    return (f"shmtree: {what}(shape={shape}, dtype={dtype_words(dtype)}) needs {_gib(size)} "
            f"({size} bytes) of shared memory on each of {nranks} rank(s), {need} bytes in all, "
            f"but only {_gib(have)} ({have} bytes) is available (the least any rank sees of "
            "MemAvailable and its memory cgroup's limit); no memory was committed and the group "
            "is usable: allocate less, or free memory first")


def _gib(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _normalize(shape, dtype, order, what):
    if order not in ("C", "F"):
        raise ValueError(f"shmtree: {what}: order must be 'C' or 'F', got {order!r}")
    try:
        shape = tuple(int(n.__index__()) for n in (shape if isinstance(shape, (tuple, list))
                                                  else (shape,)))
    except (AttributeError, TypeError):
        raise TypeError(f"shmtree: {what}: shape must be an int or a tuple of ints, got "
                        f"{shape!r}") from None
    if any(n < 0 for n in shape):
        raise ValueError(f"shmtree: {what}: negative dimension in shape {shape}")
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"shmtree: {what}: dtype {dtype} holds Python objects, which cannot be "
                        "shared between processes")
    return shape, dtype, order


_address = _moving.address
