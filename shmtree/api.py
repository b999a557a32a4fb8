"""The public API: Group, Communicator, run, Pool and the module-level calls (DESIGN.md section 5).

Python validates and allocates; the engine (Cython, GIL released) only moves chunks.  Every
collective has the same three steps:
  1. turn the arguments into a message: dtype and op codes, a contiguous source, a contiguous
     destination, a call descriptor (seq, kind, op, dtype, shape);  local errors are raised here,
     before any communication, so they leave the group usable;
  2. one round on channel 0 (the latency channel) that carries the descriptor, checked against the
     children's at every parent, and the whole message when it fits a small slot; larger messages
     then flow through channel 1 (the bandwidth channel), pipelined chunk by chunk;
  3. drive the engine: between its time slices, check the peers' liveness, the timeout and
     signals; turn a failure into an exception (and abort the group: a half-done collective
     cannot be resumed).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os
import signal
import threading
import time
import traceback
import weakref
from multiprocessing import reduction

import numpy as np

from . import _engine, _kernels
from .errors import (CollectiveMismatchError, CollectiveTimeoutError, PeerLostError,
                     ShmtreeError, WorkerError)
from .schedule import build_tree, parse_tree_kind, SMALL_MESSAGE_BYTES
from .topology import Topology
from .transport import ChannelPlan, Layout, create_memfd, new_nonce

__all__ = ["Group", "Communicator", "Pool", "run", "allreduce", "barrier", "rank", "size",
           "current"]

# call kinds in the descriptor
KIND_ALLREDUCE = 1
KIND_BARRIER = 2

# abort reasons (the header's abort word)
ABORT_DIED = 1         # rank = the member found dead
ABORT_TIMEOUT = 2      # rank = the member whose timeout ran out
ABORT_FAILED = 3       # rank = the member that raised or was interrupted
ABORT_CLOSED = 4       # the group was closed by its creator
ABORT_CORRUPT = 5      # rank = the member that found a corrupted ring
ABORT_MEMBERSHIP = 6   # a process tried to join a full group (e.g. a replaced Pool worker)

# NUMA placement of ring pages.  "consumer" (the default on a machine with several nodes): each
# ring lives on the node of the process that reads it, so the reader's loads are local and only
# the producer's stores cross the socket link, once per chunk; "producer": on the writer's node;
# "interleave": pages spread over the group's nodes; None: first touch by the producer.
NUMA_POLICIES = ("auto", "consumer", "producer", "interleave", None)
MPOL_PREFERRED = 1
MPOL_INTERLEAVE = 3

DEFAULT_CHUNK_BYTES = 256 * 1024
AUTO_FLAT_OVERSUBSCRIBED = 8    # "auto" with more ranks than cores: a flat tree up to this size
DEFAULT_SLOTS = 4
DEFAULT_SMALL_BYTES = 4096
OVERSUBSCRIBED_SMALL_BYTES = 64 * 1024      # the default when ranks outnumber the usable cores
# messages of at least this many bytes write their output with streaming (non-temporal) stores:
# the output of so large a call is not read back from cache, and skipping the read-for-ownership
# of every output line saves a third of the traffic of the copy out; 0 disables
DEFAULT_NT_BYTES = 8 * 1024 * 1024
SMALL_SLOTS = 2
STALL_SLICE_S = 0.02        # engine time slice between liveness / signal / timeout checks
SLICE_NS = int(STALL_SLICE_S * 1e9)
FULL_SCAN_S = 1.0           # every member (not only tree neighbours) is checked this often
RUN_GRACE_S = 5.0           # run(): after a failure, how long the other workers get to report

_OP_NAMES = {v: k for k, v in _kernels.OP_CODES.items()}
_OPS = dict(_kernels.OP_CODES)
_OPS.update({np.add: _OPS["sum"], np.multiply: _OPS["prod"], np.minimum: _OPS["min"],
             np.maximum: _OPS["max"]})
_SUPPORTED = [[_kernels.supported(o, d) for d in range(len(_kernels.DTYPE_CODES))]
              for o in range(len(_kernels.OP_CODES))]
_DTYPES: dict = {}                          # dtype -> code, filled as dtypes are seen


def _dtype_code(dtype) -> int:
    code = _DTYPES.get(dtype)
    if code is None:
        code = _DTYPES[dtype] = _kernels.dtype_code(dtype)     # TypeError if unsupported
    return code

_DT_NAMES = {v: k for k, v in _kernels.DTYPE_CODES.items()}


def _usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


class Group:
    """A group of `size` ranks: its shared memory, its trees, its ring layout.

    Create it in the parent; hand it to the workers (inherited by fork, pickled for spawn and
    forkserver); each worker calls `group.join(rank)` once.  `close()` (or leaving the `with`
    block) frees the parent's mapping and marks the group closed.

    Options: topology (Topology, spec string like "2x4", JSON path, or None to detect), tree
    ("auto", "topology", "chain", "binary", "flat", "ring" or an int k), chunk_bytes (bytes per
    pipelined chunk), pin (pin each rank to its core; None: when ranks fit the usable cores of a
    detected topology), slots (ring slots per edge), placement ("compact" or "spread"), numa
    ("auto", "consumer", "producer", "interleave" or None: where ring pages live; "auto" is
    "consumer" on a machine with several NUMA nodes, else first touch),
    small_bytes (largest message carried inline in the latency round), spin_us (busy-wait before
    yielding; None: 20 us, or 0 when ranks outnumber the usable cores).
    """

    def __init__(self, size, *, topology=None, tree=None, chunk_bytes=None, pin=None, slots=None,
                 placement="compact", numa="auto", small_bytes=None, spin_us=None,
                 nt_bytes=None):
        self._plan(size, topology=Topology.resolve(topology), tree=tree, chunk_bytes=chunk_bytes,
                   pin=pin, slots=slots, placement=placement, numa=numa, small_bytes=small_bytes,
                   spin_us=spin_us, nt_bytes=nt_bytes)
        self._nonce = new_nonce()
        self._creator = os.getpid()
        self._fd = create_memfd(self.layout.total)
        self._seg = _engine.Segment(self._fd, self.layout.total, size)
        self._seg.init_header(self._nonce)
        self._closed = False

    def _plan(self, size, *, topology, tree, chunk_bytes, pin, slots, placement, numa, small_bytes,
              spin_us, nt_bytes):
        """Validate the options and compute trees, placement and layout (pure arithmetic: a
        spawned process recomputes exactly the same plan from the same options)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"shmtree: group size must be an int >= 1, got {size!r}")
        if size > 4096:
            raise ValueError("shmtree: group size is limited to 4096 ranks")
        if placement not in ("compact", "spread"):
            raise ValueError(f"shmtree: placement must be 'compact' or 'spread', got {placement!r}")
        self.size = size
        self.topology = topology
        self.tree_kind = parse_tree_kind("auto" if tree is None else tree)
        self.placement = placement
        self.chunk_bytes = _positive("chunk_bytes", chunk_bytes, DEFAULT_CHUNK_BYTES, 64)
        self.slots = _positive("slots", slots, DEFAULT_SLOTS, 1)
        cpus = _usable_cpus()
        # with more ranks than cores every hand-off is a context switch: one round carrying the
        # whole message beats a header round plus a pipeline, up to larger sizes
        self.small_bytes = _positive("small_bytes", small_bytes, DEFAULT_SMALL_BYTES if
                                     size <= len(cpus) else OVERSUBSCRIBED_SMALL_BYTES, 0)
        self.nt_bytes = _positive("nt_bytes", nt_bytes, DEFAULT_NT_BYTES, 0)
        self._options = dict(topology=topology, tree=tree, chunk_bytes=chunk_bytes, pin=pin,
                             slots=slots, placement=placement, numa=numa, small_bytes=small_bytes,
                             spin_us=spin_us, nt_bytes=nt_bytes)
        real = not topology.synthetic
        where = topology.placement(size, placement)
        self.cpu_of = [s.cpu if (real and s.cpu in cpus) else None for s in where]
        self.node_of = [s.numa for s in where]
        if numa not in NUMA_POLICIES:
            raise ValueError(f"shmtree: numa must be one of {NUMA_POLICIES}, got {numa!r}")
        if numa == "auto":
            numa = "consumer" if real and topology.nnodes > 1 else None
        elif numa is not None and not real:
            numa = None                   # a synthetic machine's nodes do not exist here
        self.numa = numa
        self.numa_errno = None
        if pin is None:
            pin = size <= len(cpus) and real
        self.pin = bool(pin)
        if spin_us is None:
            spin_us = 20.0 if size <= len(cpus) else 0.0
        if not isinstance(spin_us, (int, float)) or spin_us < 0:
            raise ValueError(f"shmtree: spin_us must be a number >= 0, got {spin_us!r}")
        self.spin_ns = int(spin_us * 1000)
        self.trees, self.large_schedule = self._plan_trees(len(cpus))
        ring = self.large_schedule == "ring"
        self.layout = Layout(size, [
            ChannelPlan(self.trees[0], SMALL_SLOTS, max(self.small_bytes, 64)),
            # the ring schedule needs two slots: each item waits for its successor to have
            # consumed the previous one, which the successor does while producing its own
            ChannelPlan(self.trees[1], max(self.slots, 2) if ring else self.slots,
                        self.chunk_bytes, ring=ring)])

    def _plan_trees(self, ncpus):
        """Channel 0 (latency) and channel 1 (bandwidth) trees, and the schedule of channel 1
        ("tree" or "ring": the ring schedule runs around the tree's depth-first order).

        "auto" (measured on a 2-core machine, P = 2 and 4, see README): the topology tree where
        the machine has several sockets or NUMA nodes; else a flat tree for the latency round,
        and for larger messages the ring schedule (reduce-scatter + allgather: every rank
        reduces 1/P of the data, so no rank is the bottleneck), except when ranks outnumber
        the cores and are few (<= 8): then a flat tree, which needs the fewest context switches.
        tree="ring" runs the ring around the bandwidth tree "auto" would pick (the machine's
        hierarchy: each socket link is crossed once per direction)."""
        kind = self.tree_kind
        small = build_tree("auto" if kind == "ring" else kind, self.size, self.topology,
                           placement=self.placement,
                           message_bytes=min(self.small_bytes, SMALL_MESSAGE_BYTES - 1))
        large_kind, schedule = kind, "tree"
        if kind == "ring":
            large_kind, schedule = "auto", "ring"
        elif kind == "auto" and not self.topology.multi_level:
            if self.size <= ncpus or self.size > AUTO_FLAT_OVERSUBSCRIBED:
                large_kind, schedule = "chain", "ring"
            else:
                large_kind = "flat"
        large = build_tree(large_kind, self.size, self.topology, placement=self.placement,
                           message_bytes=max(self.chunk_bytes, SMALL_MESSAGE_BYTES))
        return (small, large), schedule

    # ---- pickling for spawn / forkserver: the memfd travels as a descriptor ----

    def __reduce__(self):
        if self._closed:
            raise ShmtreeError("shmtree: a closed group cannot be sent to another process")
        return _rebuild_group, (self.size, self._options, reduction.DupFd(self._fd),
                                self._nonce, self.layout.total)

    def _attach(self, fd, nonce, total):
        """Map the segment in a spawned process, after checking that it is this group's."""
        self._fd = fd
        self._nonce = nonce
        self._creator = None
        self._closed = False
        st = os.fstat(fd)
        if st.st_size != total or total != self.layout.total:
            os.close(fd)
            raise ShmtreeError("shmtree: the group segment has the wrong size")
        self._seg = _engine.Segment(fd, total, self.size)
        try:
            self._verify_header()
        except ShmtreeError:
            self._seg.unmap()
            os.close(fd)
            raise

    def _verify_header(self):
        """Refuse a segment whose header is not this group's (magic, version, ranks, size,
        nonce): another group's memory, or a corrupted one."""
        magic, version, nranks, total, nonce = self._seg.header()
        problems = [what for what, ok in (
            ("magic", magic == _engine.MAGIC), ("version", version == _engine.VERSION),
            ("rank count", nranks == self.size), ("size", total == self.layout.total),
            ("nonce", nonce == self._nonce)) if not ok]
        if problems:
            raise ShmtreeError(f"shmtree: the shared segment is not this group's or is corrupted "
                               f"(wrong {', '.join(problems)}); refusing to use it")

    # ---- membership ----

    def join(self, rank) -> "Communicator":
        """Join as `rank` (once per rank, in the worker process); returns its Communicator."""
        self._check_open()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ValueError(f"shmtree: rank must be an int in [0, {self.size}), got {rank!r}")
        self._verify_header()
        reason, _ = self._seg.abort_state()
        if reason:
            raise PeerLostError(f"shmtree: cannot join: {self.describe_abort()}")
        import psutil

        me = psutil.Process()
        if not self._seg.mark_joined(rank, os.getpid(), me.create_time()):
            raise ShmtreeError(f"shmtree: rank {rank} has already joined this group")
        cpu = self.cpu_of[rank]
        if self.pin and cpu is not None:
            try:
                os.sched_setaffinity(0, {cpu})
            except OSError:
                pass
        self._place_rings(rank)
        comm = Communicator(self, rank)
        _set_current(comm)
        return comm

    def _place_rings(self, rank):
        """Bind the rings this rank produces to the NUMA node(s) the policy names, then touch
        them (after pinning): their pages are allocated now, where they belong."""
        for off, length, consumers in self.layout.produced_rings(rank):
            nodes = self._ring_nodes(rank, consumers)
            if nodes:
                mode = MPOL_INTERLEAVE if len(nodes) > 1 else MPOL_PREFERRED
                self.numa_errno = self._seg.bind(off, length, mode, sorted(nodes)) or None
            self._seg.touch(off, length)

    def _ring_nodes(self, producer, consumers):
        """The NUMA nodes for a ring under the group's policy (empty: first touch decides)."""
        if self.numa is None:
            return set()
        if self.numa == "interleave":
            return set(self.node_of)
        if self.numa == "producer" or not consumers:
            return {self.node_of[producer]}
        votes = [self.node_of[c] for c in consumers]           # consumer: where most readers are
        best = max(set(votes), key=lambda n: (votes.count(n), n == self.node_of[producer]))
        return {best}

    def ring_placement(self, ranks=None):
        """Where the pages of the rings produced by `ranks` (default: all) are: a list of dicts
        (producer, consumers, offset, bytes, pages per NUMA node).  None where the kernel refuses
        the query.  The query (move_pages) sees the pages this process has mapped: a producer
        sees all of its rings' pages (it touched them at join); elsewhere a page this process
        has not accessed yet counts under node -2.  For the bench and tests."""
        self._check_open()
        out = []
        for rank in (range(self.size) if ranks is None else ranks):
            for off, length, consumers in self.layout.produced_rings(rank):
                nodes = self._seg.page_nodes(off, length)
                if nodes is None:
                    return None
                counts = {}
                for n in nodes:
                    counts[n] = counts.get(n, 0) + 1
                out.append({"producer": rank, "consumers": consumers, "offset": off,
                            "bytes": length, "pages": counts})
        return out

    def death_of(self, r) -> str:
        """'' while rank r's process lives (or has not joined yet); else how it is gone: exited,
        a zombie nobody has reaped yet, or its pid now used by another process."""
        import psutil

        joined, pid, ctime = self._seg.member(r)
        if not joined:
            return ""                    # not started yet: nothing to say
        procs = self.__dict__.setdefault("_procs", {})      # psutil handles, per process
        proc = procs.get((r, pid))
        try:
            if proc is None:
                proc = psutil.Process(pid)
                if abs(proc.create_time() - ctime) > 0.05:
                    return f"pid {pid} now belongs to another process"
                procs[(r, pid)] = proc
            if not proc.is_running():
                return f"pid {pid} is gone"
            if proc.status() == psutil.STATUS_ZOMBIE:
                return f"pid {pid} is a zombie"
            return ""
        except psutil.NoSuchProcess:
            return f"pid {pid} is gone"
        except psutil.Error:
            return ""

    def claim_rank(self) -> int:
        """The next unclaimed rank (Pool workers); >= size once every rank has been handed out."""
        self._check_open()
        return self._seg.claim_rank()

    def abort(self, reason=ABORT_FAILED, rank=-1):
        """Abort the group: every rank waiting in (or later entering) a collective raises."""
        if not self._closed:
            self._seg.set_abort(reason, rank)

    def aborted(self) -> bool:
        return (not self._closed) and self._seg.abort_state()[0] != 0

    def describe_abort(self) -> str:
        reason, who = self._seg.abort_state()
        return {
            0: "the group is healthy",
            ABORT_DIED: f"rank {who} died",
            ABORT_TIMEOUT: f"rank {who} timed out in a collective",
            ABORT_FAILED: f"rank {who} failed (raised or was interrupted)",
            ABORT_CLOSED: "the group was closed",
            ABORT_CORRUPT: f"rank {who} found corrupted shared memory",
            ABORT_MEMBERSHIP: "a process tried to join a full group (a worker was replaced?)",
        }.get(reason, f"aborted (reason {reason})") + "; the group is aborted"

    def member(self, rank):
        return self._seg.member(rank)

    # ---- lifetime ----

    def _check_open(self):
        if self._closed:
            raise ShmtreeError("shmtree: the group is closed")

    def close(self):
        """Free this process's mapping.  In the process that created the group this also marks
        the group closed, so members still inside a collective raise PeerLostError."""
        if self._closed:
            return
        if self._creator == os.getpid():
            self._seg.set_abort(ABORT_CLOSED, -1)
        self._closed = True
        self._seg = _ClosedSegment()
        try:
            os.close(self._fd)
        except OSError:
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._closed and self._creator == os.getpid():
                os.close(self._fd)
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return (f"<shmtree.Group size={self.size} tree={self.tree_kind!r} "
                f"chunk_bytes={self.chunk_bytes} {state}>")


class _ClosedSegment:
    """Stands in for the unmapped segment of a closed group (Engine objects keep the real one
    alive until they go)."""

    def abort_state(self):
        return ABORT_CLOSED, -1

    def __getattr__(self, name):
        raise ShmtreeError("shmtree: the group is closed")


def _rebuild_group(size, options, dupfd, nonce, total):
    group = Group.__new__(Group)
    group._closed = True            # until attached
    group._plan(size, **options)
    group._attach(dupfd.detach(), nonce, total)
    return group


def _positive(name, value, default, minimum):
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"shmtree: {name} must be an int >= {minimum}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# the communicator


class Communicator:
    """One rank's handle on its group: `rank`, `size`, `allreduce`, `barrier`, `close`."""

    def __init__(self, group: Group, rank: int):
        self.group = group
        self.rank = int(rank)
        self.size = int(group.size)
        self._pid = os.getpid()
        self._gen = _fork_gen                 # a forked child sees another generation
        self._seq = 0
        self._lock = threading.Lock()
        self._closed = False
        specs = [group.layout.engine_spec(ch, rank) for ch in range(2)]
        self._engine = _engine.Engine(group._seg, rank, specs, spin_ns=group.spin_ns,
                                      nt_bytes=group.nt_bytes)
        self._small_bytes = group.small_bytes
        # the ranks this one waits for (tree parent and children; ring predecessor, successor)
        self._neighbours = sorted({r for spec in specs for r in [spec["parent"], *spec["children"]]
                                   if r >= 0})
        self._next_full_scan = 0.0

    # ---- public calls ----

    def allreduce(self, array, op="sum", *, out=None, timeout=None):
        """Reduce `array` over all ranks with `op`; a new array, or `out` when given."""
        if self._gen == _fork_gen and not (self._closed or self.group._closed):
            # the fast path (engine.quick declines a call when another thread of this rank is
            # inside one: that call then fails on the general path)
            seq = self._seq
            r = self._engine.quick(array, op, out, seq, self._small_bytes, SLICE_NS, timeout)
            if r is not None:
                self._seq = seq + 1
                if r[0] != _engine.DONE:
                    # the slice ran at least min(timeout, STALL_SLICE_S) of the timeout
                    deadline = None if timeout is None else \
                        time.monotonic() + max(0.0, timeout - STALL_SLICE_S)
                    self._drive(seq, deadline, r[0])
                return r[1]
        try:
            opc = _OPS[op]
        except (KeyError, TypeError):
            opc = _kernels.op_code(op)                 # raises ValueError with the details
        a = array if type(array) is np.ndarray else np.asarray(array)
        dtc = _dtype_code(a.dtype)
        if not _SUPPORTED[opc][dtc]:
            raise TypeError(f"shmtree: op {_OP_NAMES[opc]!r} is not defined for dtype {a.dtype}")
        flags = a.flags
        src = a if (flags.c_contiguous and flags.aligned) else np.array(a, order="C")
        result, dst, copy_back = _destination(a, out)
        if src is not dst and _overlaps(src, dst):
            src = src.copy()                  # out overlaps the input without being it
        self._collective(KIND_ALLREDUCE, opc, dtc, src, dst, a.shape, timeout)
        if copy_back is not None:
            copy_back[...] = dst.reshape(copy_back.shape)
        return result

    def ring_placement(self):
        """Group.ring_placement of the rings this rank produces (all their pages are mapped
        here): where the NUMA policy put them."""
        return self.group.ring_placement([self.rank])

    def barrier(self, timeout=None):
        """Return once every rank has entered the barrier."""
        self._collective(KIND_BARRIER, _OPS["max"], _kernels.DTYPE_CODES["u1"], None, None, (),
                         timeout)

    def close(self):
        """Release this rank's engine (local, not a collective).  Later calls raise."""
        self._closed = True
        self._engine = None
        global _current
        if _current is self:
            _current = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<shmtree.Communicator rank={self.rank} size={self.size}>"

    # ---- one collective ----

    def _collective(self, kind, opc, dtc, src, dst, shape, timeout):
        if self._closed or self._gen != _fork_gen or self.group._closed:
            self._check_usable()
        if self._engine.in_call or not self._lock.acquire(False):
            raise ShmtreeError(_CONCURRENT)
        try:
            deadline = None if timeout is None else time.monotonic() + _timeout_s(timeout)
            seq = self._seq
            itemsize = src.itemsize if src is not None else 1
            try:
                rc = self._engine.begin(src, dst, itemsize, opc, dtc, seq, kind, shape,
                                        self._small_bytes)
            except RuntimeError:                 # another thread's fast path got in first
                raise ShmtreeError(_CONCURRENT) from None
            self._seq = seq + 1
            self._drive(seq, deadline, rc if rc == _engine.ABORTED else None)
        finally:
            self._lock.release()

    def _drive(self, seq, deadline, rc=None):
        """Run the engine to the end of the call (rc: the result of a slice already run),
        checking peers, timeout and signals between time slices.  Any exception leaves the
        group aborted (a half-done call can't resume)."""
        eng = self._engine
        try:
            while True:
                if rc is None:
                    budget = STALL_SLICE_S
                    if deadline is not None:
                        budget = max(0.0005, min(budget, deadline - time.monotonic()))
                    rc = eng.progress(int(budget * 1e9))
                if rc == _engine.STALLED:
                    if self.group.aborted():          # say the first cause, not a consequence
                        raise PeerLostError(
                            f"shmtree: rank {self.rank}: {self.group.describe_abort()}")
                    dead = self._find_dead(seq)
                    if dead is None:
                        if deadline is not None and time.monotonic() >= deadline:
                            self.group.abort(ABORT_TIMEOUT, self.rank)
                            raise CollectiveTimeoutError(
                                f"shmtree: rank {self.rank}: collective timed out; the group "
                                "is aborted")
                        rc = None
                        continue
                    r, how = dead
                    self.group.abort(ABORT_DIED, r)
                    raise PeerLostError(f"shmtree: rank {self.rank}: rank {r} died ({how}); the "
                                        "group is aborted")
                if rc == _engine.DONE:
                    return
                if rc == _engine.ABORTED:
                    raise PeerLostError(f"shmtree: rank {self.rank}: {self.group.describe_abort()}")
                if rc == _engine.MISMATCH:
                    raise CollectiveMismatchError(self._mismatch_message(seq))
                self.group.abort(ABORT_CORRUPT, self.rank)
                raise ShmtreeError(f"shmtree: rank {self.rank}: a ring holds data of another call "
                                   "(corrupted shared memory); the group is aborted")
        except CollectiveMismatchError:
            raise                              # every rank raises it; the rings stay consistent
        except BaseException:
            if eng.in_call:
                eng.cancel()
                self.group.abort(ABORT_FAILED, self.rank)
            raise

    # ---- checks ----

    def _check_usable(self):
        if self._closed:
            raise ShmtreeError("shmtree: this communicator is closed")
        if self._gen != _fork_gen or os.getpid() != self._pid:
            raise ShmtreeError(f"shmtree: this communicator belongs to process {self._pid} (rank "
                               f"{self.rank}); a forked child cannot use it")
        if self.group.closed:
            raise ShmtreeError("shmtree: the group is closed")
        if self.group.aborted():
            raise PeerLostError(f"shmtree: rank {self.rank}: {self.group.describe_abort()}")

    def _find_dead(self, seq):
        """(rank, how) of a member that died (gone, a zombie, or its pid reused) before finishing
        its part of call `seq`, else None.  (A member that completed the call and exited is no
        loss to it.)  Tree neighbours every slice, every member once a second."""
        ranks = self._neighbours
        now = time.monotonic()
        if now >= self._next_full_scan:
            ranks = range(self.size)
            self._next_full_scan = now + FULL_SCAN_S
        seg = self.group._seg
        for r in ranks:
            if r != self.rank and seg.completed(r) <= seq:
                how = self.group.death_of(r)
                if how and seg.completed(r) <= seq:
                    return r, how
        return None

    def _mismatch_message(self, seq) -> str:
        seen = {}
        for r in range(self.size):
            dseq, nbytes, kind, opc, dtc, shape = self.group._seg.descriptor(r, seq)
            if dseq != seq:
                what = "a different call"
            elif kind == KIND_BARRIER:
                what = "barrier"
            else:
                what = (f"allreduce(shape={shape}, dtype={_dtype_name(dtc)}, "
                        f"op={_OP_NAMES.get(opc, opc)!r})")
            seen.setdefault(what, []).append(r)
        parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranges(rs)}: {what}"
                          for what, rs in seen.items())
        return f"shmtree: ranks disagree on the collective call: {parts}"


def _dtype_name(code):
    return str(np.dtype(_DT_NAMES.get(code, "u1").replace("b1", "?")))


def _ranges(ranks):
    return ",".join(str(r) for r in ranks)


def _timeout_s(timeout):
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"shmtree: timeout must be None or a number >= 0, got {timeout!r}")
    return float(timeout)


def _destination(a, out):
    """(result to return, aligned C-contiguous array the engine writes, array to copy it back
    into or None)."""
    if out is None:
        result = np.empty(a.shape, dtype=a.dtype)
        return result, result, None
    o = out if isinstance(out, np.ndarray) else _as_flat_buffer(out)
    if o.dtype != a.dtype:
        raise ValueError(f"shmtree: out has dtype {o.dtype}, the input has {a.dtype}")
    if isinstance(out, np.ndarray):
        if o.shape != a.shape:
            raise ValueError(f"shmtree: out has shape {o.shape}, the input has {a.shape}")
    elif o.size != a.size:
        raise ValueError(f"shmtree: out holds {o.size} items, the input has {a.size}")
    if not o.flags.writeable:
        raise ValueError("shmtree: out is read-only")
    if o.flags.c_contiguous and o.flags.aligned:
        return out, o, None
    tmp = np.empty(a.shape, dtype=a.dtype)
    return out, tmp, o


def _as_flat_buffer(out):
    try:
        view = memoryview(out)
    except TypeError:
        raise ValueError(f"shmtree: out must be a numpy array or a writable buffer, got "
                         f"{type(out).__name__}") from None
    if view.readonly:
        raise ValueError("shmtree: out is read-only")
    return np.asarray(view).reshape(-1)


def _overlaps(a, b) -> bool:
    """Do two contiguous arrays share memory without being the very same bytes?"""
    if not np.may_share_memory(a, b):
        return False
    same = (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.nbytes == b.nbytes)
    return not same


# ---------------------------------------------------------------------------------------------
# module-level calls, in a process that joined a group

_current: Communicator | None = None
_fork_gen = 0           # incremented in every forked child: communicators are not inherited
_CONCURRENT = ("shmtree: another thread of this rank is inside a collective on the same "
               "communicator; collectives of one rank must not overlap")


def _after_fork_in_child():
    global _fork_gen
    _fork_gen += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def _set_current(comm):
    global _current
    _current = comm


def current() -> Communicator:
    """This process's communicator (set by Group.join, Pool and run)."""
    if _current is None or _current._closed or _current._gen != _fork_gen:
        raise ShmtreeError("shmtree: this process has not joined a group (use shmtree.run, "
                           "shmtree.Pool or Group.join)")
    return _current


def allreduce(array, op="sum", *, out=None, timeout=None):
    return current().allreduce(array, op, out=out, timeout=timeout)


def barrier(timeout=None):
    return current().barrier(timeout=timeout)


def rank() -> int:
    return current().rank


def size() -> int:
    return current().size


# ---------------------------------------------------------------------------------------------
# run: SPMD in new processes


def _default_context(start_method=None):
    if start_method is None:
        methods = multiprocessing.get_all_start_methods()
        start_method = "fork" if "fork" in methods else methods[0]
    return multiprocessing.get_context(start_method)


def _die_with_parent():
    """Linux: the worker gets SIGKILL if the process that started it dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:
            os._exit(1)
    except Exception:
        pass


def _watch_parent(pid, ctime):
    """A run() worker dies with the process that called run(), even when that process is not
    its parent (forkserver workers are the forkserver's children, so PDEATHSIG does not see it)."""
    import psutil

    while True:
        time.sleep(PARENT_WATCH_S)
        try:
            proc = psutil.Process(pid)
            alive = (abs(proc.create_time() - ctime) < 0.05
                     and proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            alive = False
        except psutil.Error:
            alive = True
        if not alive:
            os.kill(os.getpid(), signal.SIGKILL)


def _run_worker(group, rank, fn, args, kwargs, conn, parent=None):
    _die_with_parent()
    if parent is not None:
        threading.Thread(target=_watch_parent, args=parent, name="shmtree-parent-watch",
                         daemon=True).start()
    comm = None
    try:
        comm = group.join(rank)
        result = fn(comm, *args, **kwargs)
        conn.send((True, result))
    except BaseException as exc:
        report = (type(exc).__name__, str(exc), traceback.format_exc(),
                  isinstance(exc, PeerLostError))
        try:
            conn.send((False, report))
        except Exception:
            pass
        if not group.closed and not group.aborted():
            group.abort(ABORT_FAILED, rank)
    finally:
        if comm is not None:
            comm.close()
        conn.close()


def run(fn, nprocs, *, args=(), kwargs=None, start_method=None, **group_options):
    """Call fn(comm, *args, **kwargs) in `nprocs` new processes; their return values by rank.

    If a worker raises or dies, the group is aborted, the others are stopped, and WorkerError
    (rank, remote_traceback) is raised for the rank that failed first."""
    import psutil

    ctx = _default_context(start_method)
    kwargs = dict(kwargs or {})
    me = (os.getpid(), psutil.Process().create_time())
    with Group(nprocs, **group_options) as group:
        procs, conns = [], []
        try:
            for r in range(nprocs):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_run_worker,
                                args=(group, r, fn, args, kwargs, send, me),
                                name=f"shmtree-rank-{r}")
                p.start()
                send.close()
                procs.append(p)
                conns.append(recv)
            return _collect(group, procs, conns)
        finally:
            _stop(procs)
            for c in conns:
                c.close()


def _collect(group, procs, conns):
    """Wait for every worker's report; raise WorkerError for the first root-cause failure (an
    exception other than PeerLostError, or a death), else for the first failure seen."""
    from multiprocessing.connection import wait

    n = len(procs)
    results, failures = [None] * n, []
    listening = set(range(n))           # ranks whose pipe may still bring a report
    reported = [False] * n
    running = set(range(n))
    failed_at = None
    while running:
        waitables = [conns[r] for r in listening] + [procs[r].sentinel for r in running]
        ready = wait(waitables, timeout=0.2)
        for r in list(listening):
            if conns[r] in ready:
                listening.discard(r)
                try:
                    ok, payload = conns[r].recv()
                except (EOFError, OSError):
                    continue                     # closed without a report: see its exit
                reported[r] = True
                if ok:
                    results[r] = payload
                else:
                    name, text, tb, lost = payload
                    failures.append((lost, r, f"{name}: {text}", tb))
        for r in list(running):
            if procs[r].sentinel in ready and r not in listening:
                procs[r].join()
                running.discard(r)
                if not reported[r]:
                    failures.append((False, r, _death(procs[r].exitcode), ""))
        if failures and failed_at is None:
            failed_at = time.monotonic()
            group.abort(ABORT_FAILED, failures[0][1])
        if failed_at is not None and time.monotonic() > failed_at + RUN_GRACE_S:
            break                                # the rest are stopped by run's finally
    if failures:
        lost, r, text, tb = sorted(failures, key=lambda f: f[0])[0]   # root causes first
        raise WorkerError(r, text, tb or text)
    return results


def _death(exitcode):
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"died from {name} (exit code {exitcode})"
    return f"exited with code {exitcode} without reporting a result"


def _stop(procs):
    """Terminate workers that are still alive, then kill the ones that ignore it."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


# ---------------------------------------------------------------------------------------------
# Pool: a multiprocessing pool whose workers form one group


POOL_WATCH_S = 0.05
PARENT_WATCH_S = 0.25
POOL_LOCK_S = 5.0


def _watch_pool(pool_ref, group):
    """Parent side of a Pool: once the group is aborted (a member died, timed out or failed),
    fail every outstanding job with PeerLostError naming the cause.  Without this, a job given
    to a worker that died would never complete (multiprocessing.Pool does not notice)."""
    while True:
        time.sleep(POOL_WATCH_S)
        pool = pool_ref()
        if pool is None or group.closed:
            return
        if group.aborted():
            _fail_jobs(pool, PeerLostError(f"shmtree.Pool: {_pool_failure(group)}"))
        del pool


def _pool_failure(group) -> str:
    for r in range(group.size):
        how = group.death_of(r)
        if how:
            return f"rank {r} failed: died ({how}); the group is aborted"
    return group.describe_abort()


def _fail_jobs(pool, exc):
    """Complete the pool's outstanding jobs with `exc` (late results of those jobs are dropped
    by the pool's result handler, which ignores jobs no longer in its cache)."""
    from multiprocessing.pool import ApplyResult, IMapIterator, MapResult

    for job_id, job in list(pool._cache.items()):
        if isinstance(job, ApplyResult):              # MapResult too
            job._success, job._value = False, exc
            if isinstance(job, MapResult):
                job._number_left = 0
            pool._cache.pop(job_id, None)
            job._event.set()
        elif isinstance(job, IMapIterator):
            with job._cond:
                job._items.append((False, exc))
                pool._cache.pop(job_id, None)
                job._cond.notify()


def _pool_worker_init(group, initializer, initargs, parent):
    # (no PDEATHSIG here: it follows the *thread* that forked the worker, and the pool forks
    # replacements from a handler thread that exits at terminate(), which would kill a worker
    # holding the task queue's lock; the watch thread follows the pool's process instead)
    threading.Thread(target=_watch_parent, args=parent, name="shmtree-parent-watch",
                     daemon=True).start()
    rank = group.claim_rank()
    if rank >= group.size:
        # a replacement for a worker that died: the group lost a member for good
        dead = [r for r in range(group.size) if group.death_of(r)]
        if dead:
            group.abort(ABORT_DIED, dead[0])
        else:
            group.abort(ABORT_MEMBERSHIP, -1)
    else:
        group.join(rank)
    if initializer is not None:
        initializer(*initargs)


class Pool(multiprocessing.pool.Pool):
    """A multiprocessing Pool whose `processes` workers form one shmtree group; each joins once,
    with its own rank, at start.  Tasks use the module-level calls (shmtree.allreduce, rank...).
    `pool.map(task, range(processes))` runs one task per worker (each blocks in its collectives
    until all members arrive)."""

    def __init__(self, processes=None, *, initializer=None, initargs=(), context=None,
                 **group_options):
        if processes is None:
            processes = len(_usable_cpus())
        ctx = context if context is not None else _default_context()
        self._shm_group = Group(processes, **group_options)
        try:
            import psutil

            parent = (os.getpid(), psutil.Process().create_time())
            super().__init__(processes, _pool_worker_init,
                             (self._shm_group, initializer, tuple(initargs), parent), context=ctx)
        except BaseException:
            self._shm_group.close()
            raise
        weakref.finalize(self, Group.close, self._shm_group)
        self._shm_watch = threading.Thread(target=_watch_pool,
                                           args=(weakref.ref(self), self._shm_group),
                                           name="shmtree-pool-watch", daemon=True)
        self._shm_watch.start()

    @property
    def group(self) -> Group:
        return self._shm_group

    @staticmethod
    def _help_stuff_finish(inqueue, task_handler, size):
        """multiprocessing's, except that a worker killed while it held the task queue's read
        lock (idle, waiting for a task) cannot make terminate() hang: give up draining."""
        if not inqueue._rlock.acquire(timeout=POOL_LOCK_S):
            return
        while task_handler.is_alive() and inqueue._reader.poll():
            inqueue._reader.recv()
            time.sleep(0)

    def terminate(self):
        try:
            super().terminate()
        finally:
            self._shm_group.close()

    def join(self):
        super().join()
        self._shm_group.close()
