"""Shared arrays (docs/design.md, "Shared arrays"): comm.empty / comm.zeros, and the single-copy
reduce and reduce_scatter that read and write them in place (the engine does the others).

Memory.  Every rank's array of an allocation is a memfd of its own (anonymous: not counted in
/dev/shm, nor limited by its size), mapped by its owner; the peers map it too, through
/proc/<owner pid>/fd/<fd> while the owner still holds the descriptor (same user only).  The
allocation is a collective: the ranks exchange (pid, fd, bytes, a claim of shape and dtype) in
one allgather, every rank checks the claims (a difference raises CollectiveMismatchError on
every rank), maps the others, and the ranks agree that every mapping succeeded before the
owners close their descriptors.  Then only mappings remain: rank r's memory is freed when r has
dropped its array (every view included) and every peer has dropped its own array of the same
allocation (a rank's mappings of the peers' arrays go with its own array: weakref.finalize on
its mapping), or when the communicator is closed (the peers' mappings are dropped; arrays still
referenced stay valid as private memory).

Single copy.  Each allocation is also registered with the communicator's engine (its number,
this rank's stretch, every rank's mapping), which runs allreduce, broadcast and allgather of
shared arrays single-copy itself, from small_bytes up, with no Python in between
(shmtree/engine/alg_direct.pxi; docs/design.md, "Shared arrays").  Here: reduce_scatter and
reduce.  A call of at least MIN_BYTES (and more than small_bytes) in a group that has made an
allocation first exchanges, in one small allgather, what each rank passed: whether its arrays
are whole, contiguous stretches of one shared allocation and where.  When every rank passed the
same allocation and offsets, each rank folds its part straight from every rank's input, a chunk
at a time (reduced in cache), and writes it into its own output (reduce_scatter) or the root's
(reduce).  A barrier ends the call (nobody returns while someone may still read or write its
arrays).  Otherwise the call runs on the private path, unchanged.

Sizes.  These single copies are Python around the kernels: an agreement round, the work, a
barrier and the calls between them cost tens of us more than the private paths' C engine, so
they run only from the size at which that pays (MIN_BYTES, the same on every rank; below it the
private path runs on shared arrays too, without asking).  Measured on the 2-core development
machine at P=2, under the load of other jobs (shared arrays in place, the private path against
the single copy on the same arrays, alternating; single/private over 2-5 runs):
reduce_scatter 3.1x at 64 KiB, 1.1-1.5x at 512 KiB, 1.07x at 1 MiB, 0.95x at 2 MiB, 0.91x at
4 MiB; reduce 3.9x at 64 KiB, 1.4x at 512 KiB, a wash (0.65-1.5x) from 1 to 16 MiB.
SINGLE_COPY_MIN (at most the smallest of them) is the communicator's gate: smaller calls on
shared arrays take the private path at once.

The same bits as the private path: each part is reduced in the order the private path would
use for those elements (docs/algorithms.md): the ring order of reduce_scatter's blocks, the
chain's order towards reduce's root (float16 and bfloat16 rounded after every step, as each
hop does).
"""
from __future__ import annotations

import os
import weakref

import numpy as np

from . import _kernels, _moving
from .codes import KIND_BARRIER as _BARRIER
from .errors import CollectiveMismatchError, ShmtreeError

# from how many bytes (the message) reduce and reduce_scatter run their single copy
MIN_BYTES = {"reduce_scatter": 1 << 20, "reduce": 1 << 20}
SINGLE_COPY_MIN = 64 << 10      # smaller calls do not even ask (at most min(MIN_BYTES))
CHUNK_BYTES = 256 << 10         # a part is reduced in chunks of this size, in cache


def _rounds_per_step(dtype) -> bool:
    """float16 and bfloat16 folds round after every step of a ring or chain (as its hops do).
    (dtype.name is asked only of kind "V", ml_dtypes' bfloat16: numpy computes it in Python,
    about 4 us a call, which every single-copy reduction paid.)"""
    return dtype == np.float16 or (dtype.kind == "V" and dtype.name == "bfloat16")


class _Alloc:
    """One allocation as this rank sees it: its own mapping (weakly: the user's array owns it)
    and its place, and the peers' memory as flat uint8 arrays (None for this rank)."""

    __slots__ = ("id", "own", "start", "nbytes", "peers")

    def __init__(self, ident, own, nbytes, peers):
        self.id = ident
        self.own = weakref.ref(own)
        self.start = own.address
        self.nbytes = nbytes
        self.peers = peers

    def views(self):
        """Every rank's memory as a flat uint8 array (while this rank's array lives)."""
        own = self.own()
        if own is None:
            raise ShmtreeError("shmtree: a shared array was dropped during a call")
        return [np.frombuffer(own, np.uint8) if v is None else v for v in self.peers]


class SharedArrays:
    """A communicator's shared allocations."""

    def __init__(self, comm):
        self._comm = comm
        self.count = 0                # allocations made by the group (the same on every rank)
        self._live = {}               # id -> _Alloc, while this rank's own array lives

    # ---- allocation ----

    def allocate(self, shape, dtype, order, what):
        comm = self._comm
        shape, dtype, order = _normalize(shape, dtype, order, what)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        size = max(nbytes, 1)
        fd = os.memfd_create("shmtree-array", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            own = _moving.Mapping(fd, size, touch=True)     # first touch: the owner's node
            claim = _moving.claim(dtype, shape) ^ (2 if order == "F" else 0)
            mine = np.array([os.getpid(), fd, size, claim], np.uint64)
            table = comm.allgather(mine.view(np.int64)).view(np.uint64)
            claims = table[:, 3]
            if (claims != claims[0]).any():
                groups = {}
                for r, c in enumerate(claims.tolist()):
                    groups.setdefault(c, []).append(r)
                raise CollectiveMismatchError(
                    f"shmtree: ranks disagree on the collective call: {what}: "
                    + "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} "
                                "asked for one shape, dtype and order" if i == 0 else
                                f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} "
                                "for another"
                                for i, rs in enumerate(groups.values())))
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
        alloc = _Alloc(self.count, own, nbytes, peers)
        self._live[alloc.id] = alloc
        # the engine's single-copy allreduce finds the allocation by address (and forgets it
        # before the mappings go)
        comm._engine.share(alloc.id, alloc.start, nbytes,
                           [alloc.start if v is None else _address(v) for v in peers])
        weakref.finalize(own, self._forget, alloc.id)
        array = np.frombuffer(own, np.uint8, nbytes) if nbytes else np.empty(0, np.uint8)
        return array.view(dtype).reshape(shape, order=order)

    def _forget(self, ident):
        engine = self._comm._engine
        if engine is not None:
            engine.unshare(ident)
        self._live.pop(ident, None)

    def close(self):
        """Drop every mapping of the peers' arrays (own arrays stay valid, unshared)."""
        engine = self._comm._engine
        for ident in self._live:
            if engine is not None:
                engine.unshare(ident)
        self._live.clear()

    # ---- single copy ----

    def where(self, a) -> tuple:
        """(allocation id, byte offset) when `a` is a C-contiguous, aligned stretch of one of this
        rank's live shared arrays, else (0, 0)."""
        if not (a.flags.c_contiguous and a.flags.aligned) or not a.nbytes:
            return 0, 0
        addr = _address(a)
        for alloc in self._live.values():
            if alloc.start <= addr and addr + a.nbytes <= alloc.start + alloc.nbytes:
                return alloc.id, addr - alloc.start
        return 0, 0

    def reduce_scatter(self, src, dst, lo, hi, opc, deadline) -> bool:
        """reduce_scatter single-copy: every rank folds its own block (bytes lo..hi of the
        message) straight from every rank's input (shared arrays of one allocation, at the same
        place) into its `dst`, private or not, in the ring order the private path uses."""
        if src.nbytes < MIN_BYTES["reduce_scatter"]:
            return False
        comm = self._comm
        sid, soff = self.where(src)
        mine = np.array([bool(sid), sid, soff, src.nbytes], np.int64)
        if not self._agreed(mine, deadline):
            return False
        order = list(comm.group.plan.large_tree.ring)
        P, pos = comm.size, order.index(comm.rank)
        ranks = [order[(pos + 1 + j) % P] for j in range(P)]   # x[p+1] op ... op x[p]
        fold = _ring_fold(ranks, _kernels.op_name(opc), _rounds_per_step(src.dtype))
        item, dtype = src.itemsize, src.dtype

        def work():
            ins = [v[soff + lo:soff + hi].view(dtype) for v in self._live[sid].views()]
            _fold_range(fold, ins, 0, (hi - lo) // item, dst.reshape(-1), [])
        self._guarded(work)
        self._barrier(deadline)
        return True

    def reduce(self, src, dst, root, opc, deadline) -> bool:
        """reduce single-copy: every rank folds one part of the message straight from every
        rank's input into the root's `out` (the input's allocation, or one every rank holds),
        in the chain's order x[q+1] op ... op x[q] (q: the root's ring position)."""
        if src.nbytes < MIN_BYTES["reduce"]:
            return False
        comm = self._comm
        sid, soff = self.where(src)
        did, doff = self.where(dst) if comm.rank == root else (0, 0)
        ok = bool(sid) and (comm.rank != root or bool(
            did and _same_or_apart(sid, soff, did, doff, src.nbytes)))
        mine = np.array([ok, sid, soff, src.nbytes, did, doff], np.int64)
        rows = comm._gather_small(mine, deadline).tolist()
        did, doff = rows[root][4], rows[root][5]
        if not (all(r[0] and r[1:4] == rows[0][1:4] for r in rows) and did in self._live):
            # (each rank still holding the root's out allocation is checked in the same way)
            flag = np.array([0], np.uint8)
        else:
            flag = np.array([1], np.uint8)
        if not all(int(v) for v in comm._gather_small(flag, deadline).reshape(-1)):
            return False
        order = list(comm.group.plan.large_tree.ring)
        P, q = comm.size, order.index(root)
        ranks = [order[(q + 1 + j) % P] for j in range(P)]
        fold = _ring_fold(ranks, _kernels.op_name(opc), _rounds_per_step(src.dtype))
        item, dtype, nbytes = src.itemsize, src.dtype, src.nbytes
        share = -(-(nbytes // item) // P)
        a0, b0 = min(comm.rank * share, nbytes // item), min((comm.rank + 1) * share,
                                                              nbytes // item)

        def work():
            ins = [v[soff:soff + nbytes].view(dtype) for v in self._live[sid].views()]
            out = self._live[did].views()[root][doff:doff + nbytes].view(dtype)
            _fold_range(fold, ins, a0, b0, None, [out])   # (out may be the root's input)
        self._guarded(work)
        self._barrier(deadline)
        return True

    def _agreed(self, row, deadline) -> bool:
        """Did every rank say it can (row[0]) with the very same row?  (One small allgather;
        every rank gets the same answer.)"""
        rows = self._comm._gather_small(row, deadline).tolist()
        return all(r[0] for r in rows) and all(r == rows[0] for r in rows)

    def _guarded(self, work):
        try:
            work()
        except BaseException:
            self._comm._fail_local("interrupted inside a single-copy collective")
            raise

    def _barrier(self, deadline):
        self._comm._collective(_BARRIER, _kernels.OP_CODES["max"], _kernels.DTYPE_CODES["u1"],
                               None, None, (), deadline)


def _same_or_apart(id1, off1, id2, off2, n) -> bool:
    """Are two n-byte stretches of shared allocations the very same bytes, or apart?  (An input
    and an output that partly overlap take the private path, which copies.)"""
    return id1 != id2 or off1 == off2 or off1 + n <= off2 or off2 + n <= off1


def _fold_range(fold, ins, a0, b0, target, copies):
    """Elements a0..b0, a chunk of CHUNK_BYTES at a time: fold every input's chunk into
    target's (or, target None, into a buffer that stays in cache), then copy it into each of
    `copies`."""
    if a0 >= b0:
        return
    step = max(1, CHUNK_BYTES // ins[0].itemsize)
    tmp = np.empty(min(step, b0 - a0), ins[0].dtype) if target is None else None
    for a in range(a0, b0, step):
        b = min(a + step, b0)
        t = tmp[:b - a] if target is None else target[a:b]
        fold(t, [x[a:b] for x in ins])
        for o in copies:
            o[a:b] = t


def _ring_fold(ranks, op, pairwise):
    """Block order of the ring schedule: ins[ranks[0]] op ins[ranks[1]] op ..., one fold (the
    same bits as one fused pass, except float16, which every hop rounds)."""
    def fold(t, ins):
        srcs = [ins[r] for r in ranks]
        if not pairwise or len(srcs) < 3:
            _kernels.reduce_into(t, srcs, op)
            return
        _kernels.reduce_into(t, srcs[:2], op)
        for s in srcs[2:]:
            _kernels.reduce_into(t, [t, s], op)
    return fold


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
