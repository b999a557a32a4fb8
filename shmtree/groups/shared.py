"""Shared arrays (docs/design.md, "Shared arrays"): comm.empty / comm.zeros.

Memory.  Every rank's array of an allocation is a memfd of its own (anonymous: not counted in
/dev/shm, nor limited by its size; sealed against shrinking and growing, so no reader can take a
SIGBUS), mapped by its owner; the peers map it too, through /proc/<owner pid>/fd/<fd> while the
owner still holds the descriptor (same user only).  The allocation is a collective: the ranks
exchange (pid, fd, bytes, a claim of shape and dtype, and this rank's limits: the memory it can
still get and which limit binds that, its file-size limit, what its address-space limit still
lets it map, and whether sizing its memory file was refused) in one allgather before any page is
committed; every rank checks the claims (a difference raises CollectiveMismatchError on every
rank, naming what each asked for) and the limits (_refusal: any limit of any rank that refuses
the allocation raises MemoryError on every rank, naming the sizes and the limit; no memory file
is sized past the file-size limit, whose ftruncate would raise SIGXFSZ), maps the others, and
the ranks agree that every mapping succeeded before the owners close their descriptors.  Then
only mappings remain: rank r's memory is freed when r has dropped its array (every view
included) and every peer has dropped its own array of the same allocation (a rank's mappings of
the peers' arrays go with its own array: weakref.finalize on its mapping), or when the
communicator is closed (the peers' mappings are dropped; arrays still referenced stay valid as
private memory).

Single copy.  Each allocation is also registered with the communicator's engine (its number,
this rank's stretch, every rank's mapping: Engine.share), which runs every collective of shared
arrays single-copy itself, from the sizes that do not travel inline up, with no Python in
between (shmtree/engine/alg_direct.pxi; docs/design.md, "Shared arrays"); the entry goes
(Engine.unshare) before the mappings do, and a call that may use the allocation holds its
mappings (Engine.share's keep) until it has ended, whatever another thread does meanwhile.
"""
from __future__ import annotations

import errno
import fcntl
import os
import weakref

import numpy as np

from .. import _engine, _moving
from . import transport
from ..codes import grouped, ranks_text
from ..errors import CollectiveMismatchError, ShmtreeError
from ..ops import dtype_words


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
        # this rank's limits, read before it commits any (_LIMITS: what each column says)
        room, room_kind = transport.memory_room()
        file_limit = transport.file_size_limit()
        map_room = transport.address_space_room()
        fd = os.memfd_create("shmtree-array", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            refused = 0               # (the errno of a refused ftruncate: every rank hears it)
            if size <= file_limit:    # (past the file-size limit, ftruncate raises SIGXFSZ)
                try:
                    os.ftruncate(fd, size)    # (no page is committed yet)
                    # no peer (nor anyone) can shrink or grow it: no reader of it can take a
                    # SIGBUS
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
                except OSError as exc:
                    refused = exc.errno or errno.EIO
            claim = _engine.claim(dtype, shape) ^ (2 if order == "F" else 0)
            mine = np.array([os.getpid(), fd, size, claim, room, room_kind, file_limit, map_room,
                             refused], np.uint64)
            table = comm.allgather(mine.view(np.int64)).view(np.uint64)
            claims = table[:, 3]
            if (claims != claims[0]).any():           # (every rank reads the same table)
                raise CollectiveMismatchError(self._mismatch(what, shape, dtype, order))
            refusal = _refusal(what, shape, dtype, table)
            if refusal is not None:                   # (every rank alike, before any commits)
                raise refusal
            peers, error, nomem = [], "", False
            try:
                own = _moving.Mapping(fd, size, touch=True)     # first touch: the owner's node
            except OSError as exc:
                own, nomem = None, exc.errno == errno.ENOMEM
                error = f"rank {comm.rank} cannot map its own array: {exc}"
            for r in range(comm.size):
                peers.append(None)
                if r == comm.rank or own is None:
                    continue
                pid, pfd, psize = (int(v) for v in table[r, :3])
                try:
                    peer_fd = os.open(f"/proc/{pid}/fd/{pfd}", os.O_RDWR | os.O_CLOEXEC)
                    try:
                        peers[r] = np.frombuffer(_moving.Mapping(peer_fd, psize), np.uint8)
                    finally:
                        os.close(peer_fd)
                except OSError as exc:
                    nomem = nomem or exc.errno == errno.ENOMEM
                    error = error or f"rank {comm.rank} cannot map rank {r}'s array: {exc}"
            # every mapping is made (or failed) before any owner closes its descriptor
            failed = int(comm.allreduce(np.array([2 if nomem else 1 if error else 0], np.uint8),
                                        "max")[0])
        finally:
            os.close(fd)
        if failed:
            text = f"shmtree: {what}: " + (error or "a peer could not map this rank's array" + (
                " (the kernel had no memory for the mapping: ENOMEM)" if failed == 2 else
                " (ranks must run as the same user)"))
            raise (MemoryError if failed == 2 else ShmtreeError)(
                text + "; no array was made and the group is usable")
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


# comm.zeros's table: one row per rank, these columns (uint64), gathered in one allgather
# before any page is committed.  Every rank decides from the same table (_refusal): a size that
# any limit of any rank refuses is a MemoryError on every rank, with nothing committed.
_LIMITS = ("pid", "fd", "size", "claim",
           "room",            # the memory the machine still gives this rank (transport.memory_room)
           "room kind",       # which limit binds it (transport.ROOM_*)
           "file limit",      # RLIMIT_FSIZE: the most this rank's own memory file may hold
           "map room",        # RLIMIT_AS less the address space in use: what it may still map
           "refused")         # the errno of this rank's ftruncate (0: it was not refused)


def _refusal(what, shape, dtype, table):
    """The MemoryError of an allocation some limit refuses (every rank's array together; each
    rank's own file; each rank's mappings: its own array and every peer's), else None.  A pure
    function of the gathered table: every rank raises the same error, or none does."""
    nranks = len(table)
    sizes = [int(v) for v in table[:, 2]]
    need = sum(sizes)
    size = sizes[0]
    limits = []                             # (text of one refusal, in words)
    rooms = [int(v) for v in table[:, 4]]
    have = min(rooms)
    if need > have:
        r = rooms.index(have)
        limits.append(f"only {_gib(have)} ({have} bytes) is available (the least any rank sees "
                      f"of MemAvailable and its memory cgroup's limit; the least: rank {r}'s "
                      f"{transport.ROOM_NAMES.get(int(table[r, 5]), 'limit')})")
    fsize = [r for r in range(nranks) if sizes[r] > int(table[r, 6])]
    if fsize:
        limit = int(table[fsize[0], 6])
        limits.append(f"the file-size limit (RLIMIT_FSIZE, ulimit -f) of {ranks_text(fsize)}, "
                      f"{_gib(limit)} ({limit} bytes), is below one rank's array (each rank's "
                      "array is a memory file of its own)")
    maps = [r for r in range(nranks) if need > int(table[r, 7])]
    if maps:
        room = int(table[maps[0], 7])
        limits.append(f"the address-space limit (RLIMIT_AS, ulimit -v) leaves {ranks_text(maps)} "
                      f"only {_gib(room)} ({room} bytes) to map, and every rank maps every "
                      "rank's array")
    refused = {}
    for r in range(nranks):
        e = int(table[r, 8])
        if e:
            refused.setdefault(e, []).append(r)
    for e, rs in refused.items():
        name = errno.errorcode.get(e, str(e))
        limits.append(f"the kernel refused to size the memory file of {ranks_text(rs)} "
                      f"({name}: {os.strerror(e)})")
    if not limits:
        return None
    text = (f"shmtree: {what}(shape={shape}, dtype={dtype_words(dtype)}) needs {_gib(size)} "
            f"({size} bytes) of shared memory on each of {nranks} rank(s), {need} bytes in all, "
            f"but {'; and '.join(limits)}; no memory was committed and the group is usable: "
            "allocate less, or free memory or raise the limit first")
    if len(limits) == len(refused) and not set(refused) & set(transport.MEMORY_ERRNOS):
        return ShmtreeError(text)           # (no limit: an error of another kind, said alike)
    return MemoryError(text)


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
