"""The public API: Group, Communicator, run, Pool and the module-level calls (docs/design.md).

Python validates and allocates; the engine (Cython, GIL released) only moves chunks.  Every
collective has the same three steps:
  1. turn the arguments into a message: dtype and op codes, a contiguous source, a contiguous
     destination, a call descriptor (kind, op, dtype, shape; the engine numbers the calls);  local
     errors are raised here, before any communication, so they leave the group usable;
  2. one round on channel 0 (the latency channel) that carries the descriptor, checked against the
     children's at every parent, and the whole message when it fits a small slot; larger messages
     then flow through channel 1 (the bandwidth channel), pipelined chunk by chunk;
  3. drive the engine in time slices: between slices, check the abort word, the peers (dead, gone
     for good, idle in a Pool), the timeout and signals; turn a failure into an exception (and
     abort the group: a half-done collective cannot be resumed).  An interrupt at any point of a
     call either lets it finish or aborts the group: never a call left half-begun.

Arrows point one way: run/Pool -> Communicator -> Group -> plan, transport -> schedule, topology.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os
import signal
import threading
import time
import traceback
import warnings
import weakref
from multiprocessing import reduction

import numpy as np

from . import _engine, _kernels, plan as _plan
from .errors import (CollectiveMismatchError, CollectiveTimeoutError, PeerLostError,
                     ShmtreeError, WorkerError)
from .plan import OPTIONS as GROUP_OPTIONS, SMALL_SLOTS, Plan, plan_group, usable_cpus
from .transport import ChannelPlan, Layout, create_memfd, new_nonce

__all__ = ["Group", "Communicator", "Pool", "run", "allreduce", "barrier", "rank", "size",
           "current"]

# call kinds in the descriptor
KIND_ALLREDUCE = 1
KIND_BARRIER = 2
_KIND_NAMES = {KIND_ALLREDUCE: "allreduce", KIND_BARRIER: "barrier"}

# abort reasons (the header's abort word); the ones marked (note) are explained in the words of
# the rank that aborted, kept in its rank block
ABORT_DIED = 1         # rank = the member found dead
ABORT_TIMEOUT = 2      # rank = the member whose timeout ran out (note)
ABORT_FAILED = 3       # rank = the member that raised or was interrupted (note)
ABORT_CLOSED = 4       # the group was closed by its creator
ABORT_CORRUPT = 5      # rank = the member that found a corrupted ring
ABORT_MEMBERSHIP = 6   # a process tried to join a full group (e.g. a replaced Pool worker)
ABORT_STALL = 7        # rank = a Pool member that waited on idle members (note)
ABORT_LEFT = 8         # rank = a member that waited on one that left the group for good (note)
ABORT_TASK = 9         # rank = a Pool member whose task raised while others waited for it (note)
ABORT_INIT = 10        # rank = a Pool member whose initializer raised (note)
_NOTED = (ABORT_TIMEOUT, ABORT_FAILED, ABORT_STALL, ABORT_LEFT, ABORT_TASK, ABORT_INIT)

# what a member is doing (its rank block's state word): a Pool worker is idle between tasks;
# a member that closed its communicator (returned from run's fn) has left for good
ST_NONE, ST_BUSY, ST_IDLE, ST_LEFT = 0, 1, 2, 3

MPOL_PREFERRED = 1
MPOL_INTERLEAVE = 3

STALL_SLICE_S = 0.02        # engine time slice between liveness / signal / timeout checks
SLICE_NS = int(STALL_SLICE_S * 1e9)
FULL_SCAN_S = 1.0           # every member (not only tree neighbours) is checked this often
RUN_GRACE_S = 5.0           # run(): after a failure, how long the other workers get to report
RAISED_GRACE_S = 0.5        # Pool: how long a member whose task raised may stay idle before
                            # the members waiting for it in a collective give up

# the one op table: names and ufuncs -> kernel op codes
_OPS = {**_kernels.OP_CODES, **_kernels.UFUNC_CODES}
_OP_NAMES = {v: k for k, v in _kernels.OP_CODES.items()}
_SUPPORTED = [[_kernels.supported(o, d) for d in range(len(_kernels.DTYPE_CODES))]
              for o in range(len(_kernels.OP_CODES))]
_DTYPES: dict = {}                          # dtype -> code, filled as dtypes are seen
_DT_NAMES = {v: k for k, v in _kernels.DTYPE_CODES.items()}


def _dtype_code(dtype) -> int:
    code = _DTYPES.get(dtype)
    if code is None:
        code = _DTYPES[dtype] = _kernels.dtype_code(dtype)     # TypeError if unsupported
    return code


def _op_code(op) -> int:
    try:
        return _OPS[op]
    except (KeyError, TypeError):
        return _kernels.op_code(op)                 # raises ValueError with the details


def _plan_property(name, doc):
    return property(lambda self: getattr(self.plan, name), doc=doc)


class Group:
    """A group of `size` ranks: its plan (trees, geometry), its shared memory, its ring layout.

    Create it in the parent; hand it to the workers (inherited by fork, pickled for spawn and
    forkserver, with its plan: a spawned member never plans again); each worker calls
    `group.join(rank)` once.  `close()` (or leaving the `with` block) frees this process's
    mapping and descriptor; in the creator it also marks the group closed.

    Options (see shmtree.plan): topology (Topology, spec string like "2x4", JSON path, or None to
    detect), tree ("auto", "topology", "chain", "binary", "flat", "ring" or an int k), chunk_bytes
    (bytes per pipelined chunk), pin (pin each rank to its core while it is a member; None: when
    ranks fit the usable cores of a detected topology), slots (ring slots per edge), placement
    ("compact" or "spread"), numa ("auto", "consumer", "producer", "interleave" or None: where
    ring pages live), small_bytes (largest message carried inline in the latency round), spin_us
    (busy-wait before yielding), nt_bytes (streaming stores from this size), stall_timeout
    (seconds a member waits on members that are idle in a Pool before failing; None: never).
    """

    def __init__(self, size, *, topology=None, tree=None, chunk_bytes=None, pin=None, slots=None,
                 placement="compact", numa="auto", small_bytes=None, spin_us=None,
                 nt_bytes=None, stall_timeout=None):
        self._closed = True                 # until the segment exists
        self._adopt(plan_group(size, topology=topology, tree=tree, chunk_bytes=chunk_bytes,
                               pin=pin, slots=slots, placement=placement, numa=numa,
                               small_bytes=small_bytes, spin_us=spin_us, nt_bytes=nt_bytes,
                               stall_timeout=stall_timeout))
        self._nonce = new_nonce()
        self._creator = os.getpid()
        self._fd = create_memfd(self.layout.total)
        try:
            self._seg = _engine.Segment(self._fd, self.layout.total, self.size)
            self._seg.init_header(self._nonce, self.plan.digest())
        except BaseException:
            os.close(self._fd)
            raise
        self._closed = False

    def _adopt(self, plan: Plan):
        """Take a plan: the layout of the segment follows from it."""
        self.plan = plan
        self.size = plan.size
        self.layout = Layout(plan.size, [
            ChannelPlan(plan.small_tree, SMALL_SLOTS, max(plan.small_bytes, 64)),
            ChannelPlan(plan.large_tree, plan.slots, plan.chunk_bytes,
                        ring=plan.large_schedule == "ring")])
        self.numa_errno = None
        self._comm = None               # weak reference to this process's member, once joined
        self._procs = {}                # psutil handles of the members, by (rank, pid)

    topology = _plan_property("topology", "The machine the trees are laid on.")
    tree_kind = _plan_property("tree_kind", "The tree option as given (parsed).")
    placement = _plan_property("placement", "'compact' or 'spread'.")
    chunk_bytes = _plan_property("chunk_bytes", "Bytes per pipelined chunk.")
    slots = _plan_property("slots", "Ring slots per edge of the bandwidth channel.")
    small_bytes = _plan_property("small_bytes", "The largest message carried inline.")
    nt_bytes = _plan_property("nt_bytes", "Streaming stores for messages from this size.")
    spin_ns = _plan_property("spin_ns", "Busy-wait before yielding, in ns.")
    pin = _plan_property("pin", "Whether members are pinned to their cores.")
    cpu_of = _plan_property("cpu_of", "The core of each rank (None: not pinned).")
    node_of = _plan_property("node_of", "The NUMA node of each rank.")
    numa = _plan_property("numa", "The NUMA placement policy of ring pages (None: first touch).")
    large_schedule = _plan_property("large_schedule", "'tree' or 'ring' (bandwidth channel).")
    stall_timeout = _plan_property("stall_timeout", "Seconds before a Pool stall fails.")

    @property
    def trees(self):
        """(latency tree, bandwidth tree)."""
        return self.plan.small_tree, self.plan.large_tree

    # ---- pickling for spawn / forkserver: the plan and the memfd (as a descriptor) travel ----

    def __reduce__(self):
        if self._closed:
            raise ShmtreeError("shmtree: a closed group cannot be sent to another process")
        return _rebuild_group, (self.plan, reduction.DupFd(self._fd), self._nonce,
                                self.layout.total)

    def _attach(self, fd, nonce, total):
        """Map the segment in a spawned process, after checking that it is this group's (the
        caller closes fd if this raises)."""
        if os.fstat(fd).st_size != total or total != self.layout.total:
            raise ShmtreeError("shmtree: the group segment has the wrong size")
        self._nonce = nonce
        self._creator = None
        self._seg = _engine.Segment(fd, total, self.size)
        try:
            self._verify_header()
        except ShmtreeError:
            self._seg.unmap()
            raise
        self._fd = fd
        self._closed = False

    def _verify_header(self):
        """Refuse a segment whose header is not this group's (magic, version, ranks, size,
        nonce, plan digest): another group's memory, a corrupted one, or a member that planned
        the group differently."""
        magic, version, nranks, total, nonce, digest = self._seg.header()
        problems = [what for what, ok in (
            ("magic", magic == _engine.MAGIC), ("version", version == _engine.VERSION),
            ("rank count", nranks == self.size), ("size", total == self.layout.total),
            ("nonce", nonce == self._nonce), ("plan digest", digest == self.plan.digest()))
            if not ok]
        if problems:
            raise ShmtreeError(f"shmtree: the shared segment is not this group's or is corrupted "
                               f"(wrong {', '.join(problems)}); refusing to use it")

    # ---- membership ----

    def join(self, rank) -> "Communicator":
        """Join as `rank` (once per rank, in the worker process); returns its Communicator."""
        self._check_open()
        if isinstance(rank, bool) or not hasattr(rank, "__index__") \
                or not 0 <= rank.__index__() < self.size:
            raise ValueError(f"shmtree: rank must be an int in [0, {self.size}), got {rank!r}")
        rank = rank.__index__()
        self._verify_header()
        reason, _ = self._seg.abort_state()
        if reason:
            raise PeerLostError(f"shmtree: cannot join: {self.describe_abort()}")
        import psutil

        me = psutil.Process()
        if not self._seg.mark_joined(rank, os.getpid(), me.create_time()):
            raise ShmtreeError(f"shmtree: rank {rank} has already joined this group")
        self._seg.set_state(rank, ST_BUSY)
        other = _current if (_current is not None and not _current._closed
                             and _current._gen == _fork_gen) else None
        if other is not None and other.group is not self:
            warnings.warn(f"shmtree: this process is rank {other.rank} of another group and now "
                          f"joins a second one as rank {rank}; shmtree.current() and the "
                          f"module-level calls use the new group from here on", RuntimeWarning,
                          stacklevel=2)
        cpu = self.plan.cpu_of[rank]
        if self.plan.pin and cpu is not None:
            try:
                _plan.pin_to(cpu)
            except OSError:
                pass
        self._place_rings(rank)
        comm = Communicator(self, rank)
        self._comm = weakref.ref(comm)
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
        numa, node_of = self.plan.numa, self.plan.node_of
        if numa is None:
            return set()
        if numa == "interleave":
            return set(node_of)
        if numa == "producer" or not consumers:
            return {node_of[producer]}
        votes = [node_of[c] for c in consumers]           # consumer: where most readers are
        best = max(set(votes), key=lambda n: (votes.count(n), n == node_of[producer]))
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

    def abort(self, reason=ABORT_FAILED, rank=-1, note=None):
        """Abort the group: every rank waiting in (or later entering) a collective raises.  A
        member aborting in its own name (rank = its rank) may say why in `note`; the first
        abort wins, so a note is only written while the group is healthy."""
        if self._closed:
            return
        if note is not None and rank >= 0 and not self._seg.abort_state()[0]:
            self._seg.set_note(rank, note.encode("utf-8", "replace"))
        self._seg.set_abort(reason, rank)

    def aborted(self) -> bool:
        return (not self._closed) and self._seg.abort_state()[0] != 0

    def describe_abort(self) -> str:
        reason, who = self._seg.abort_state()
        note = self._seg.note(who) if reason in _NOTED and who >= 0 else ""
        if note and reason != ABORT_FAILED:
            return f"{note}; the group is aborted"
        return {
            0: "the group is healthy",
            ABORT_DIED: f"rank {who} died",
            ABORT_TIMEOUT: f"rank {who} timed out in a collective",
            ABORT_FAILED: f"rank {who} failed ({note or 'raised or was interrupted'})",
            ABORT_CLOSED: "the group was closed",
            ABORT_CORRUPT: f"rank {who} found corrupted shared memory",
            ABORT_MEMBERSHIP: "a process tried to join a full group (a worker was replaced?)",
        }.get(reason, f"aborted (reason {reason}, rank {who})") + "; the group is aborted"

    def member(self, rank):
        return self._seg.member(rank)

    # ---- lifetime ----

    def _check_open(self):
        if self._closed:
            raise ShmtreeError("shmtree: the group is closed")

    def close(self):
        """Free this process's mapping and descriptor, and leave the group if this process
        joined it (its CPU mask is restored).  In the process that created the group this also
        marks the group closed, so members still inside a collective raise PeerLostError."""
        if self._closed:
            return
        comm = self._comm() if self._comm is not None else None
        if comm is not None and comm._pid == os.getpid():
            comm.close()
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
        # every copy (the creator's, a forked child's, an unpickled one) holds a descriptor of
        # its own: dropping the copy closes it (the mapping goes with the last Segment user)
        try:
            if not self._closed:
                self._closed = True
                os.close(self._fd)
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return (f"<shmtree.Group size={self.size} tree={self.plan.tree_kind!r} "
                f"chunk_bytes={self.plan.chunk_bytes} {state}>")


class _ClosedSegment:
    """Stands in for the unmapped segment of a closed group (Engine objects keep the real one
    alive until they go)."""

    def abort_state(self):
        return ABORT_CLOSED, -1

    def __getattr__(self, name):
        raise ShmtreeError("shmtree: the group is closed")


def _rebuild_group(plan, dupfd, nonce, total):
    """Unpickle a group: its creator's plan, and the segment's descriptor (closed again here
    if anything is wrong with it)."""
    fd = dupfd.detach()
    try:
        group = Group.__new__(Group)
        group._closed = True            # until attached
        group._adopt(plan)
        group._attach(fd, nonce, total)
    except BaseException:
        os.close(fd)
        raise
    return group


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
        self._lock = threading.Lock()
        self._closed = False
        specs = [group.layout.engine_spec(ch, rank) for ch in range(2)]
        self._seg = group._seg
        self._engine = _engine.Engine(group._seg, rank, specs, spin_ns=group.plan.spin_ns,
                                      nt_bytes=group.plan.nt_bytes)
        self._small_bytes = group.plan.small_bytes
        # the ranks this one waits for (tree parent and children; ring predecessor, successor)
        self._neighbours = sorted({r for spec in specs for r in [spec["parent"], *spec["children"]]
                                   if r >= 0})
        self._next_full_scan = 0.0
        self._stall = None                    # (seq, since): idle members seen since

    def __reduce__(self):
        raise TypeError("shmtree: a Communicator cannot be sent to another process (it is one "
                        "rank's membership); send the Group instead and call group.join(rank) "
                        "in the worker, or use shmtree.run / shmtree.Pool")

    # ---- public calls ----

    def allreduce(self, array, op="sum", *, out=None, timeout=None):
        """Reduce `array` over all ranks with `op`; a new array, or `out` when given."""
        eng = self._engine
        if self._gen == _fork_gen and not (self._closed or self.group._closed):
            # the fast path (engine.quick declines a call when another thread of this rank is
            # inside one: that call then fails on the general path)
            t0 = 0.0 if timeout is None else time.monotonic()
            try:
                r = eng.quick(array, op, out, self._small_bytes, SLICE_NS, timeout)
                if r is not None:
                    if r[0] != _engine.DONE:
                        self._drive(eng.seq, None if timeout is None else t0 + timeout, r[0])
                    return r[1]
            except BaseException:
                self._interrupted(eng)
                raise
        opc = _op_code(op)
        if isinstance(array, np.ma.MaskedArray) or isinstance(out, np.ma.MaskedArray):
            raise TypeError("shmtree: masked arrays are not supported (the mask would be "
                            "dropped); reduce array.filled(...) or the mask separately")
        a = array if type(array) is np.ndarray else np.asarray(array)
        dtc = _dtype_code(a.dtype)
        if not _SUPPORTED[opc][dtc]:
            raise TypeError(f"shmtree: op {_OP_NAMES[opc]!r} is not defined for dtype {a.dtype}"
                            + (" (complex numbers have no order)" if a.dtype.kind == "c" else
                               " (bitwise ops need an integer or bool dtype)"))
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
        """Leave the group (local, not a collective): later calls raise, peers that wait for
        this rank in a collective it never made fail at once, and the process gets back the CPU
        mask it had before it joined."""
        if self._closed:
            return
        self._closed = True
        if self._pid == os.getpid() and self._gen == _fork_gen:
            try:
                if not self.group._closed:
                    self._seg.set_state(self.rank, ST_LEFT)
            except ShmtreeError:
                pass
            _plan.unpin()
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
        deadline = None if timeout is None else time.monotonic() + _timeout_s(timeout)
        eng = self._engine
        if eng.in_call or not self._lock.acquire(False):
            raise ShmtreeError(_CONCURRENT)
        try:
            itemsize = src.itemsize if src is not None else 1
            try:
                rc = eng.begin(src, dst, itemsize, opc, dtc, kind, shape, self._small_bytes)
            except RuntimeError as exc:      # another thread's fast path got in first
                raise ShmtreeError(_CONCURRENT) from exc
            self._drive(eng.seq, deadline, rc if rc == _engine.ABORTED else None)
        except BaseException:
            self._interrupted(eng)           # (only a call this thread began)
            raise
        finally:
            self._lock.release()

    def _interrupted(self, eng):
        """An exception (an interrupt, an error) left this thread's call half-done: forget it and
        abort the group, which is the only clean way out of a half-done collective."""
        if eng is not None and eng.owns_call():
            eng.cancel()
            self.group.abort(ABORT_FAILED, self.rank,
                             note=f"interrupted inside {self._call_name(eng.seq)}")

    def _drive(self, seq, deadline, rc=None):
        """Run the engine to the end of call `seq` (rc: the result of a slice already run), and
        between time slices check the group, the peers and the deadline."""
        eng = self._engine
        while True:
            if rc is None:
                budget = STALL_SLICE_S
                if deadline is not None:
                    budget = max(0.0005, min(budget, deadline - time.monotonic()))
                rc = eng.progress(int(budget * 1e9))
            if rc == _engine.DONE:
                return
            if rc == _engine.STALLED:
                self._check_peers(seq, deadline)
                rc = None
                continue
            if rc == _engine.ABORTED:
                raise PeerLostError(f"shmtree: rank {self.rank}: {self.group.describe_abort()}")
            if rc == _engine.MISMATCH:
                raise CollectiveMismatchError(self._mismatch_message(seq))
            self.group.abort(ABORT_CORRUPT, self.rank)
            raise ShmtreeError(f"shmtree: rank {self.rank}: a ring holds data of another call "
                               "(corrupted shared memory); the group is aborted")

    # ---- checks ----

    def _check_peers(self, seq, deadline):
        """Between two slices of call `seq`: raise if it cannot complete (the group is aborted,
        a peer died or left for good, this rank's deadline passed, or Pool members idle)."""
        group = self.group
        if group.aborted():                   # say the first cause, not a consequence
            raise PeerLostError(f"shmtree: rank {self.rank}: {group.describe_abort()}")
        absent = self._absent(seq)
        left = [r for r, st in absent if st == ST_LEFT]        # (said before it exits)
        if left:
            self._fail(ABORT_LEFT, ShmtreeError,
                       f"{_ranks_text(left)} left the group (closed its communicator or "
                       f"returned from its function) after {self._seg.completed(left[0])} "
                       f"collective(s), while {self._waiting_text(seq)} waited in "
                       f"{self._call_name(seq)}")
        dead = self._find_dead(seq)
        if dead is not None:
            r, how = dead
            group.abort(ABORT_DIED, r)
            raise PeerLostError(f"shmtree: rank {self.rank}: rank {r} died ({how}); the group "
                                "is aborted")
        if deadline is not None and time.monotonic() >= deadline:
            self._fail(ABORT_TIMEOUT, CollectiveTimeoutError,
                       f"rank {self.rank} timed out in {self._call_name(seq)}; "
                       f"{_ranks_text([r for r, _ in absent]) if absent else 'no rank'} had "
                       f"not arrived" + (f" ({_states_text(absent)})" if absent else ""))
        self._check_stall(seq, absent)

    def _check_stall(self, seq, absent):
        """A Pool member waits in call seq while members that have not made it are idle (no
        task): once that has lasted stall_timeout, fail (they will never arrive).  When an idle
        member's last task raised, its round of collectives is broken: fail after a short grace
        (the time a worker takes to pick up a queued task) instead."""
        timeout = self.group.plan.stall_timeout
        idle = [r for r, st in absent if st == ST_IDLE]
        if timeout is None or not idle:
            self._stall = None
            return
        now = time.monotonic()
        if self._stall is None or self._stall[0] != seq:
            self._stall = (seq, now)
            return
        raised = [note for r in idle for note in [self._seg.note(r)] if note]
        if raised:
            timeout = min(timeout, RAISED_GRACE_S)
        if now - self._stall[1] < timeout:
            return
        self._fail(ABORT_STALL, ShmtreeError,
                   f"shmtree.Pool: {self._call_name(seq)} cannot complete: "
                   f"{self._waiting_text(seq)} waited in it for {now - self._stall[1]:.1f} s "
                   f"while {_ranks_text(idle)} {'was' if len(idle) == 1 else 'were'} idle (no "
                   f"task, or finished their task without making it)"
                   + (f"; {'; '.join(raised)}" if raised else "")
                   + "; every task must make the same collectives on every worker: give the "
                   "pool a multiple of its size in tasks (map deals them one at a time), or use "
                   "pool.run(fn)")

    def _fail(self, reason, exc_type, text):
        self.group.abort(reason, self.rank, note=text)
        raise exc_type(f"shmtree: rank {self.rank}: {text}; the group is aborted")

    def _absent(self, seq):
        """(rank, state) of the members that have neither completed call seq nor entered it."""
        seg = self._seg
        return [(r, seg.state(r)) for r in range(self.size)
                if r != self.rank and seg.completed(r) <= seq and seg.call_of(r) != seq + 1]

    def _waiting_text(self, seq):
        seg = self._seg
        return _ranks_text([r for r in range(self.size)
                            if r == self.rank or seg.call_of(r) == seq + 1])

    def _call_name(self, seq):
        """'allreduce #3': the kind of call seq (from this rank's descriptor) and its number,
        counted from 1 in the order the group's calls were made."""
        kind = self._seg.descriptor(self.rank, seq)[2]
        return f"{_KIND_NAMES.get(kind, 'collective')} #{seq + 1}"

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
        seg = self._seg
        for r in ranks:
            if r != self.rank and seg.completed(r) <= seq:
                how = self.group.death_of(r)
                if how and seg.completed(r) <= seq:
                    return r, how
        return None

    def _mismatch_message(self, seq) -> str:
        seen = {}
        for r in range(self.size):
            dseq, nbytes, kind, opc, dtc, shape = self._seg.descriptor(r, seq)
            if dseq != seq:
                what = "a different call"
            elif kind == KIND_BARRIER:
                what = "barrier"
            else:
                what = (f"allreduce(shape={shape}, dtype={_dtype_name(dtc)}, "
                        f"op={_OP_NAMES.get(opc, opc)!r})")
            seen.setdefault(what, []).append(r)
        parts = "; ".join(f"{_ranks_text(rs)}: {what}" for what, rs in seen.items())
        return f"shmtree: ranks disagree on the collective call: {parts}"


def _dtype_name(code):
    return str(np.dtype(_DT_NAMES.get(code, "u1").replace("b1", "?")))


def _ranks_text(ranks):
    """'rank 2' or 'ranks 0,1,3'."""
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) != 1 else ''} {','.join(map(str, ranks))}"


_STATE_NAMES = {ST_NONE: "not joined yet", ST_BUSY: "busy outside the collective",
                ST_IDLE: "idle, no task", ST_LEFT: "left the group"}


def _states_text(absent):
    return "; ".join(f"rank {r}: {_STATE_NAMES.get(st, st)}" for r, st in absent)


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
_pool_group = None      # (group, fork generation) in a Pool worker, even one without a rank
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
        if _pool_group is not None and _pool_group[1] == _fork_gen:
            group = _pool_group[0]
            raise PeerLostError("shmtree.Pool: this worker has no rank in the pool's group ("
                                + (group.describe_abort() if not group.closed else
                                   "the pool is closed") + ")")
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


def _context(context=None):
    """A multiprocessing context from None (fork where the platform has it), a start-method name
    ("fork", "spawn", "forkserver") or a context object."""
    if context is None:
        methods = multiprocessing.get_all_start_methods()
        context = "fork" if "fork" in methods else methods[0]
    if isinstance(context, str):
        return multiprocessing.get_context(context)       # ValueError names the valid methods
    if not hasattr(context, "get_start_method"):
        raise TypeError(f"shmtree: context must be a start method name or a multiprocessing "
                        f"context, got {context!r}")
    return context


def _check_picklable(who, ctx, **things):
    """Under spawn and forkserver everything a worker gets is pickled (ctx None: pickled whatever
    the start method, as pool tasks are): say so clearly, with the remedy, before any process
    starts (pickle's own error surfaces late and says neither)."""
    method = None if ctx is None else ctx.get_start_method()
    if method == "fork":
        return
    for name, value in things.items():
        try:
            reduction.ForkingPickler.dumps(value)
        except Exception as exc:
            how = ("pool tasks are pickled whatever the start method" if method is None else
                   f"under {method!r} everything a worker gets is pickled")
            raise TypeError(f"{who}: cannot send {name} to the workers ({exc}); {how}: functions "
                            f"must be defined at module level (not a lambda or a local function) "
                            f"and arguments picklable"
                            + ("" if method is None else "; or use the 'fork' start method")
                            ) from exc


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
        if not group.closed and not group.aborted():
            group.abort(ABORT_FAILED, rank, note=f"fn raised {type(exc).__name__}: {exc}")
        try:
            conn.send((False, report))
        except Exception:
            pass
    finally:
        if comm is not None:
            comm.close()
        conn.close()


def run(fn, nprocs, *, args=(), kwargs=None, start_method=None, **group_options):
    """Call fn(comm, *args, **kwargs) in `nprocs` new processes; their return values by rank.

    If a worker raises or dies, the group is aborted, the others are stopped, and WorkerError
    (rank, remote_traceback) is raised for the rank that failed first."""
    import psutil

    ctx = _context(start_method)
    kwargs = dict(kwargs or {})
    _check_picklable("shmtree.run", ctx, fn=fn, args=args, kwargs=kwargs)
    me = (os.getpid(), psutil.Process().create_time())
    with Group(nprocs, **group_options) as group:
        procs, conns = [], []
        try:
            for r in range(group.size):
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



POOL_START_S = 60.0         # how long Pool() waits for its workers to join before it returns


def _pool_worker_init(group, initializer, initargs, parent):
    """A Pool worker's start: take the next rank, join, run the user's initializer.  A worker
    whose initializer raises aborts the group in its own words and stays alive (one that exited
    would be replaced, and its replacement fail the same way, over and over)."""
    # (no PDEATHSIG here: it follows the *thread* that forked the worker, and the pool forks
    # replacements from a handler thread that exits at terminate(), which would kill a worker
    # holding the task queue's lock; the watch thread follows the pool's process instead)
    global _pool_group
    threading.Thread(target=_watch_parent, args=parent, name="shmtree-parent-watch",
                     daemon=True).start()
    _pool_group = (group, _fork_gen)
    rank = group.claim_rank()
    if rank >= group.size:
        # a replacement for a worker that died: the group lost a member for good
        dead = [r for r in range(group.size) if group.death_of(r)]
        if dead:
            group.abort(ABORT_DIED, dead[0])
        else:
            group.abort(ABORT_MEMBERSHIP, -1)
        return
    group.join(rank)
    if initializer is not None:
        try:
            initializer(*initargs)
        except BaseException as exc:
            group.abort(ABORT_INIT, rank, note=f"the Pool's initializer raised on rank {rank}: "
                                               f"{type(exc).__name__}: {exc}")
            return
    group._seg.set_state(rank, ST_IDLE)


def _run_as_task(fn, args, kwargs):
    """Run one pool task in a worker: the member is busy while it runs (idle members are what
    the stall detector looks for), and a task that raises while other members wait for this one
    in a collective aborts the group, saying why, instead of leaving them waiting."""
    comm = _current
    if comm is None or comm._closed or comm.group.closed or comm._gen != _fork_gen:
        return fn(*args, **kwargs)
    seg, r = comm._seg, comm.rank
    seg.set_state(r, ST_BUSY)
    if not seg.abort_state()[0]:
        seg.set_note(r, b"")                  # this rank's last task has not raised (yet)
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        _task_raised(comm, exc)
        raise
    finally:
        if not comm.group.closed:
            seg.set_state(r, ST_IDLE)


def _task_raised(comm, exc):
    group, seg, r = comm.group, comm._seg, comm.rank
    if group.closed or group.aborted():
        return
    text = f"rank {r}'s task raised {type(exc).__name__}: {exc}"
    seg.set_note(r, text.encode("utf-8", "replace"))    # for a stall report, if one comes
    mine = seg.completed(r)
    waiting = [s for s in range(comm.size) if s != r and seg.call_of(s) > mine]
    if waiting:
        seq = seg.call_of(waiting[0]) - 1
        kind = _KIND_NAMES.get(seg.descriptor(waiting[0], seq)[2], "collective")
        group.abort(ABORT_TASK, r, note=f"{text}, while {_ranks_text(waiting)} waited for it "
                                        f"in {kind} #{seq + 1}")


class _Task:
    """A user's task function as the pool sends it (see _run_as_task)."""

    def __init__(self, fn):
        _check_picklable("shmtree.Pool", None, task=fn)
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return _run_as_task(self.fn, args, kwargs)


def _spmd_task(fn, args, kwargs):
    """One worker's part of Pool.run: a barrier first (a worker that took its task cannot take
    another before every worker has one), then fn(comm, ...).  Returns (rank, ok, payload)."""
    comm = current()
    try:
        comm.barrier()
        return comm.rank, True, _run_as_task(fn, (comm,) + tuple(args), kwargs)
    except BaseException as exc:
        return comm.rank, False, (type(exc).__name__, str(exc), traceback.format_exc(),
                                  isinstance(exc, PeerLostError))


class Pool(multiprocessing.pool.Pool):
    """A multiprocessing Pool whose `processes` workers form one shmtree group; each joins once,
    with its own rank, at start.

    Tasks use the module-level calls (shmtree.allreduce, shmtree.rank...).  map/starmap/imap and
    their async forms deal tasks one at a time (chunksize 1 unless given), so any multiple of
    `processes` tasks that each make the same collectives works; `pool.run(fn, *args)` calls
    fn(comm, *args) once on every worker and returns the results by rank.  A collective that
    cannot complete because members are idle (no task) fails on the waiting members after
    `stall_timeout` seconds; a task that raises while others wait for it makes them fail at once,
    with its exception in the message; either way the pool is then broken (PeerLostError).
    `context`: a multiprocessing context or a start method name ("fork", "spawn",
    "forkserver")."""

    def __init__(self, processes=None, *, initializer=None, initargs=(), context=None,
                 stall_timeout=_plan.DEFAULT_STALL_TIMEOUT, **group_options):
        self._state = multiprocessing.pool.INIT       # multiprocessing's __del__ reads it
        self._shm_group = None
        bad = sorted(set(group_options) - set(GROUP_OPTIONS))
        if "maxtasksperchild" in bad:
            raise TypeError("shmtree.Pool: maxtasksperchild is not supported: each worker is a "
                            "rank of the group for the pool's whole life (a worker that exits "
                            "takes its rank with it)")
        if bad:
            raise TypeError(f"shmtree.Pool: unknown option(s) {', '.join(bad)}; Pool takes "
                            f"processes, initializer, initargs, context and the Group options "
                            f"{', '.join(GROUP_OPTIONS)}")
        if initializer is not None and not callable(initializer):
            raise TypeError(f"shmtree.Pool: initializer must be callable, got {initializer!r}")
        ctx = _context(context)
        _check_picklable("shmtree.Pool", ctx, initializer=initializer, initargs=initargs)
        self._shm_group = Group(len(usable_cpus()) if processes is None else processes,
                                stall_timeout=stall_timeout, **group_options)
        try:
            import psutil

            parent = (os.getpid(), psutil.Process().create_time())
            super().__init__(self._shm_group.size, _pool_worker_init,
                             (self._shm_group, initializer, tuple(initargs), parent), context=ctx)
        except BaseException:
            self._shm_group.close()
            raise
        weakref.finalize(self, Group.close, self._shm_group)
        self._shm_watch = threading.Thread(target=_watch_pool,
                                           args=(weakref.ref(self), self._shm_group),
                                           name="shmtree-pool-watch", daemon=True)
        self._shm_watch.start()
        try:
            self._await_workers()
        except BaseException:
            self.terminate()
            raise

    def _await_workers(self):
        """Return once every worker has joined and run the initializer; raise if one failed (the
        initializer's exception, once), or if workers die while starting (each replacement
        would die the same way)."""
        group = self._shm_group
        seg, n = group._seg, group.size
        seen, deadline = set(), time.monotonic() + POOL_START_S
        while True:
            reason, who = seg.abort_state()
            if reason == ABORT_INIT:
                note = seg.note(who)
                raise WorkerError(who, note.split(": ", 1)[-1], note)
            if reason:
                raise PeerLostError(f"shmtree.Pool: a worker failed while the pool started: "
                                    f"{_pool_failure(group)}")
            if all(seg.state(r) == ST_IDLE for r in range(n)) or time.monotonic() > deadline:
                return
            procs = list(self._pool)
            seen.update(p.pid for p in procs)
            if len(seen) > n:
                codes = sorted({p.exitcode for p in procs if p.exitcode is not None} or {"?"})
                raise ShmtreeError(f"shmtree.Pool: workers die while starting ({len(seen)} "
                                   f"processes started for {n} ranks; exit codes "
                                   f"{', '.join(map(str, codes))}): see their output above")
            time.sleep(0.005)

    @property
    def group(self) -> Group:
        return self._shm_group

    def _check_group(self):
        if self._shm_group is not None and self._shm_group.aborted():
            raise PeerLostError(f"shmtree.Pool: the pool is broken: {_pool_failure(self._shm_group)}")

    # ---- tasks: dealt one at a time, each marked busy while it runs ----

    def apply_async(self, func, args=(), kwds={}, callback=None, error_callback=None):
        self._check_group()
        return super().apply_async(_Task(func), args, kwds, callback, error_callback)

    def _map_async(self, func, iterable, mapper, chunksize=None, callback=None,
                   error_callback=None):
        # map, map_async, starmap and starmap_async all come here
        self._check_group()
        return super()._map_async(_Task(func), iterable, mapper,
                                  1 if chunksize is None else chunksize, callback,
                                  error_callback)

    def imap(self, func, iterable, chunksize=1):
        self._check_group()
        return super().imap(_Task(func), iterable, chunksize)

    def imap_unordered(self, func, iterable, chunksize=1):
        self._check_group()
        return super().imap_unordered(_Task(func), iterable, chunksize)

    def run(self, fn, *args, **kwargs) -> list:
        """Call fn(comm, *args, **kwargs) once on every worker (SPMD, as shmtree.run does on new
        processes) and return the results by rank.  If fn raises on some rank, WorkerError
        names the root cause (as shmtree.run's)."""
        self._check_group()
        n = self._shm_group.size
        jobs = [super(Pool, self).apply_async(_spmd_task, (fn, args, kwargs)) for _ in range(n)]
        results, failures = [None] * n, []
        for job in jobs:
            try:
                r, ok, payload = job.get()
            except PeerLostError:
                continue                     # failed by the watch thread: the abort says why
            if ok:
                results[r] = payload
            else:
                name, text, tb, lost = payload
                failures.append((lost, r, f"{name}: {text}", tb))
        roots = [f for f in failures if not f[0]]
        if roots:
            lost, r, text, tb = roots[0]
            raise WorkerError(r, text, tb)
        self._check_group()                  # every failure was a consequence: say its cause
        if failures:
            lost, r, text, tb = failures[0]
            raise WorkerError(r, text, tb)
        return results

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
            if self._shm_group is not None:
                self._shm_group.close()

    def join(self):
        super().join()
        self._shm_group.close()
