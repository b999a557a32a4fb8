# cython: language_level=3
"""One rank's pipelined tree allreduce over lock-free rings in shared memory.

The engine is one extension built from several files (included, so that every cdef type is shared
and the primitives inline into the algorithms):
  * shmtree/_csrc/layout.h: the segment layout as C structs (header, rank block, call descriptor,
    slot header); shm_sync.h: atomics, fences, futex, streaming copy.
  * engine/types.pxi: the state the nogil code works on (Conn, Chan, Call, Eng) and the algorithm
    interface (Alg: setup, ready, step, done).
  * engine/prims.pxi: ring access, waking, the output copy, readiness checks and the chunk
    primitives (send, recv, recv_reduce_send, recv_reduce_copy, recv_reduce_copy_send,
    recv_copy_send) with the flow control, memory ordering and wake-ups inside them.
  * engine/wait.pxi: spin / yield / futex sleep when nothing is ready, the abort word, the slice.
  * engine/alg_*.pxi: one algorithm per file, written in the primitives: alg_inline (the
    channel-0 round with the call descriptor, and small messages), alg_tree (pipelined tree up +
    down), alg_ring (ring schedule: reduce-scatter + allgather), alg_chain and alg_blocks (the
    other collectives), alg_exchange (blocks between any pairs, through outboxes), alg_direct
    (the single copies of shared arrays, no rings), alg_cma (the single copy of private buffers
    by cross-memory attach, no rings).
  * engine/scan.pxi: the fold of scan and exscan (rows in rank order, numpy's bits).
  * engine/msg.pxi: the call's parser (one per collective, the C twin of calls.py) and the
    selection (which algorithm a call runs: the Plan's table); engine/bcast.pxi: broadcast's
    call whole (its first round's layout, building and reading it, the hand-over to the data);
    engine/setup.pxi: channels and scratch; engine/shares.pxi: the shared arrays' registry and
    where a call's buffers lie in them.
  * here: the table of algorithms [collective][algorithm], the one loop driver, Engine (one rank's
    view of the group, one resumable call at a time: call() parses a call and runs its first
    time slice, progress() drives it with the GIL released until it is done, the group is
    aborted, or the time slice ends - the Python layer then checks its peers and signals and
    calls again - cancel() forgets it after an abort) and Segment (the mapping of the group's
    memfd, and the header fields the Python layer reads and writes: abort word, rank claims, join
    records, call descriptors).
"""
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t, int32_t
from libc.string cimport memcpy, memcmp, memmove, memset
from libc.stdlib cimport malloc, free, calloc, realloc
from libc.stdint cimport uintptr_t
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED

from shmtree._kernels cimport (reduce_fn, get_kernel, DT_BOOL, DT_I1, DT_I2, DT_I4, DT_I8,
                               DT_U1, DT_U2, DT_U4, DT_U8, DT_F2, DT_F4, DT_F8, DT_C8, DT_C16,
                               DT_BF16, N_DTYPES, OP_SUM, OP_PROD, OP_MIN, OP_MAX, OP_BAND,
                               OP_BOR, OP_BXOR, N_OPS)
from libc.math cimport INFINITY
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
cimport numpy as cnp
from cpython.pythread cimport PyThread_get_thread_ident

cnp.import_array()

cdef extern from "<errno.h>" nogil:
    int errno

cdef extern from "<unistd.h>" nogil:
    long syscall(long number, ...)

cdef extern from "<sys/syscall.h>" nogil:
    long SYS_mbind
    long SYS_move_pages

# the abort word and the rank it names (the header's abort_reason at 128, abort_rank at 132: one
# aligned 64-bit word, reason in its low half) are set together, in one compare-and-swap, and read
# together: a reader that sees a reason sees its rank (never the rank field's old 0)
cdef extern from *:
    """
    static inline int shmtree_abort_cas(volatile uint32_t *reason_word, uint32_t reason,
                                        int32_t rank) {
        uint64_t expected = 0;
        uint64_t desired = (uint64_t)reason | ((uint64_t)(uint32_t)rank << 32);
        return __atomic_compare_exchange_n((volatile uint64_t *)reason_word, &expected, desired,
                                           0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    }
    static inline uint64_t shmtree_abort_load(const volatile uint32_t *reason_word) {
        return __atomic_load_n((const volatile uint64_t *)reason_word, __ATOMIC_SEQ_CST);
    }
    """
    int shmtree_abort_cas(uint32_t *reason_word, uint32_t reason, int32_t rank) nogil
    uint64_t shmtree_abort_load(const uint32_t *reason_word) nogil

cdef enum:
    MAX_NDIM = 64           # numpy's limit
    N_TYPENUMS = 64
    PIPE_CHUNKS = 4         # a message on the bandwidth channel is cut into at least this many
    MIN_CHUNK = 4096        # chunks (down to this size), so that its pieces overlap
    REDUCE_PIECE = 16384    # a final result is reduced and copied out this much at a time
    KIND_ALLREDUCE = 1

include "engine/types.pxi"
include "engine/prims.pxi"
include "engine/wait.pxi"
include "engine/alg_tree.pxi"
include "engine/alg_ring.pxi"
include "engine/alg_inline.pxi"
include "engine/alg_chain.pxi"
include "engine/alg_blocks.pxi"
include "engine/alg_direct.pxi"
include "engine/alg_exchange.pxi"
include "engine/alg_cma.pxi"
include "engine/scan.pxi"

import os
import pickle

import numpy as np
from shmtree import _kernels

cdef object _NDARRAY = np.ndarray    # (a C static: `type(x) is _NDARRAY` looks nothing up by
                                     # name, where `np.ndarray` reads a module attribute)
from shmtree.frontend.calls import _named_by_str    # (does dt.str name dt: one rule, calls.py's)

# numpy type number -> DT_* code (-1: unsupported), for the fast path
cdef int _TYPENUM_CODE[N_TYPENUMS]
for _i in range(N_TYPENUMS):
    _TYPENUM_CODE[_i] = -1
for _ch in np.typecodes["All"]:
    try:
        _dt = np.dtype(_ch)
        if _dt.num < N_TYPENUMS:
            _TYPENUM_CODE[_dt.num] = _kernels.dtype_code(_dt)
    except (TypeError, ValueError):
        pass
cdef dict _OP_CODE_OF = {**_kernels.OP_CODES, **_kernels.UFUNC_CODES}   # the kernels' one op
                                                                        # table
cdef object _UFUNC = np.ufunc


cdef bint _reducible(cnp.ndarray a, op, int *opc, int *dtc):
    """Can a fast path reduce `a` with `op` as it is: a C-contiguous, aligned, native-endian
    array of a dtype that has a kernel for the op (a known op name or ufunc)?  Sets the codes."""
    cdef int num = cnp.PyArray_TYPE(a)
    if (num < 0 or num >= N_TYPENUMS or _TYPENUM_CODE[num] < 0
            or not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISNOTSWAPPED(a)
            or not cnp.PyArray_ISALIGNED(a)):
        return False
    code = _OP_CODE_OF.get(op) if (type(op) is str or type(op) is _UFUNC) else None
    if code is None:
        return False
    opc[0] = code
    dtc[0] = _TYPENUM_CODE[num]
    return get_kernel(opc[0], dtc[0]) != NULL


cdef object _output(cnp.ndarray a, out, int nd, cnp.npy_intp *dims, int num,
                    bint in_place_ok):
    """A fast path's output for input `a`: a new array of type number num and shape dims when
    out is None, else out itself when it is an ndarray of that type and shape, C-contiguous,
    writable, aligned, native-endian and clear of `a` (or `a` itself, when in_place_ok); None
    when it is not (the general path takes the call)."""
    if out is None:
        return cnp.PyArray_EMPTY(nd, dims, num, 0)
    if type(out) is not _NDARRAY:
        return None
    cdef cnp.ndarray res = <cnp.ndarray>out
    if (cnp.PyArray_TYPE(res) != num or cnp.PyArray_NDIM(res) != nd
            or memcmp(cnp.PyArray_DIMS(res), dims, nd * sizeof(cnp.npy_intp)) != 0
            or not cnp.PyArray_IS_C_CONTIGUOUS(res) or not cnp.PyArray_ISWRITEABLE(res)
            or not cnp.PyArray_ISALIGNED(res) or not cnp.PyArray_ISNOTSWAPPED(res)):
        return None
    if in_place_ok:
        if _clash(a, res):
            return None
    elif cnp.PyArray_NBYTES(res) and _ranges_overlap(a, res):
        return None
    return res


cdef int64_t _budget(int64_t slice_ns, timeout):
    """A fast path's time slice: slice_ns, or less when timeout (None or seconds, a float or int
    >= 0) is shorter, but at least 0.5 ms; -1 for a timeout the general path must check."""
    cdef double wait
    if timeout is None:
        return slice_ns
    if type(timeout) is not float and type(timeout) is not int:
        return -1
    wait = timeout
    if not wait >= 0:
        return -1
    if wait * 1e9 < slice_ns:
        slice_ns = <int64_t>(wait * 1e9)
    return slice_ns if slice_ns >= 500000 else 500000


cdef bint _ranges_overlap(cnp.ndarray a, cnp.ndarray b):
    cdef char *pa = <char *>cnp.PyArray_DATA(a)
    cdef char *pb = <char *>cnp.PyArray_DATA(b)
    return pa < pb + cnp.PyArray_NBYTES(b) and pb < pa + cnp.PyArray_NBYTES(a)


# ---- the overlap rule (DESIGN sections 5, 6, 8), the one place it is decided ----
# An input and an output that are the very same bytes (in place) or share no byte are used as
# they are; any other overlap goes through a copy of the input first: the engine's algorithms
# read the input while they write the output, piece by piece (the kernels' 16 KiB pieces, the
# two-rank exchange, chunks of the pipeline), so a partly overlapping input would be read after
# it was overwritten.  Engine.call's parser declines such calls (_output, msg_allgather); the
# Python layer, which then normalises the call, copies the input (asking clash(): collectives.py,
# nodes.py) and enters Engine.call again.

cdef inline bint _clash_c(const char *pa, uint64_t na, const char *pb, uint64_t nb) noexcept nogil:
    """Do [pa, pa + na) and [pb, pb + nb) share a byte without being the very same bytes?"""
    if na == 0 or nb == 0 or (pa == pb and na == nb):
        return False
    return pa < pb + nb and pb < pa + na


cdef inline bint _clash(cnp.ndarray a, cnp.ndarray b):
    """_clash_c of two C-contiguous arrays."""
    return _clash_c(<const char *>cnp.PyArray_DATA(a), cnp.PyArray_NBYTES(a),
                    <const char *>cnp.PyArray_DATA(b), cnp.PyArray_NBYTES(b))


cdef void _extent(cnp.ndarray a, const char **lo, const char **hi):
    """The lowest byte a's elements occupy and one past the highest (any strides)."""
    cdef const char *p = <const char *>cnp.PyArray_DATA(a)
    cdef cnp.npy_intp *dims = cnp.PyArray_DIMS(a)
    cdef cnp.npy_intp *strides = cnp.PyArray_STRIDES(a)
    cdef int i
    lo[0] = p
    hi[0] = p + cnp.PyArray_ITEMSIZE(a)
    for i in range(cnp.PyArray_NDIM(a)):
        if strides[i] < 0:
            lo[0] += (dims[i] - 1) * strides[i]
        else:
            hi[0] += (dims[i] - 1) * strides[i]


def clash(a, b):
    """The overlap rule for the Python layers: do ndarrays a and b (any layout) share memory
    without being the very same elements (the very same bytes when both are C-contiguous, else
    the same first byte, shape, strides and item size)?
    True: an input that is read while `b` is written must be copied first.  False for the very
    same array (in place) and for disjoint memory.  (By extents: strided views that interleave
    without sharing an element count as sharing; the copy is then merely unneeded.)"""
    cdef cnp.ndarray x = a
    cdef cnp.ndarray y = b
    cdef const char *xl
    cdef const char *xh
    cdef const char *yl
    cdef const char *yh
    cdef int nd = cnp.PyArray_NDIM(x)
    if cnp.PyArray_SIZE(x) == 0 or cnp.PyArray_SIZE(y) == 0:
        return False
    if cnp.PyArray_IS_C_CONTIGUOUS(x) and cnp.PyArray_IS_C_CONTIGUOUS(y):
        return _clash(x, y)               # (the very same bytes: the same elements, in order)
    if (cnp.PyArray_DATA(x) == cnp.PyArray_DATA(y) and nd == cnp.PyArray_NDIM(y)
            and cnp.PyArray_ITEMSIZE(x) == cnp.PyArray_ITEMSIZE(y)
            and memcmp(cnp.PyArray_DIMS(x), cnp.PyArray_DIMS(y), nd * sizeof(cnp.npy_intp)) == 0
            and memcmp(cnp.PyArray_STRIDES(x), cnp.PyArray_STRIDES(y),
                       nd * sizeof(cnp.npy_intp)) == 0):
        return False
    _extent(x, &xl, &xh)
    _extent(y, &yl, &yh)
    return xl < yh and yl < xh


MAGIC = 0x3130454552544d53   # "SMTREE01" little endian
VERSION = 5
# the layout constants, for transport.py (one definition: layout.h)
LINE_BYTES = SHM_LINE
PAGE_BYTES = SHM_PAGE
SLOT_HDR_BYTES = sizeof(shm_slot_hdr)
HEADER_BYTES = sizeof(shm_seg_hdr)
RANK_BLOCK_BYTES = sizeof(shm_rank_block)

DONE = RC_DONE
STALLED = RC_STALLED
ABORTED = RC_ABORTED
MISMATCH = RC_MISMATCH
CORRUPT = RC_CORRUPT
NEED_OUT = RC_NEED_OUT
# a local error said in a call's round (Engine.call, ERROR): its descriptor's op and dtype, and how many
# bytes of its text the descriptor carries
cdef enum:
    ERR_CODE = 255
ERROR_CODE = ERR_CODE
ERROR_TEXT = SHM_MAX_DIMS * 8

# ---------------------------------------------------------------------------------------------
# the algorithms, by collective and algorithm (as _kernels' _TABLE[op][dtype]): a new collective
# or algorithm is a new engine/alg_*.pxi and an entry here.  Every call begins with ALG_INLINE on
# channel 0; a message the selection (engine/msg.pxi, select: the Plan's table) does not keep
# inline then runs on channel 1 with ALG_TREE or ALG_RING (the channel's plan says which), or,
# when every rank's input and output lie in the group's shared arrays, with ALG_DIRECT (on
# channel 1's slot, without its rings; every collective).  A barrier is an allreduce of nothing.
# The other collectives have ring-schedule algorithms (their channel-0 round is the allreduce's,
# without data), or run on the allreduce where the selection says so.

cdef enum:
    COLL_ALLREDUCE = 0
    COLL_BROADCAST = 1
    COLL_REDUCE = 2
    COLL_REDUCE_SCATTER = 3
    COLL_ALLGATHER = 4
    COLL_ALLTOALL = 5       # (and gather, scatter, scan's exchanges: blocks of any sizes
                            # between any pairs, alg_exchange.pxi)
    N_COLL = 6

cdef enum:
    ALG_INLINE = 0
    ALG_TREE = 1
    ALG_RING = 2
    ALG_DIRECT = 3          # shared arrays: single copy
    ALG_CMA = 4             # private buffers: single copy by cross-memory attach
    N_ALG = 5

cdef Alg _ALGS[N_COLL][N_ALG]
memset(_ALGS, 0, sizeof(_ALGS))


cdef void _register(int coll, int alg, alg_setup_fn setup, alg_ready_fn ready, alg_step_fn step,
                    alg_done_fn done):
    _ALGS[coll][alg].setup = setup
    _ALGS[coll][alg].ready = ready
    _ALGS[coll][alg].step = step
    _ALGS[coll][alg].done = done


_register(COLL_ALLREDUCE, ALG_INLINE, inline_setup, inline_ready, inline_step, tree_done)
_register(COLL_ALLREDUCE, ALG_TREE, tree_setup, tree_ready, tree_step, tree_done)
_register(COLL_ALLREDUCE, ALG_RING, ring_setup, ring_ready, ring_step, ring_done)
assert (DIRECT_ALLREDUCE, DIRECT_BROADCAST, DIRECT_REDUCE, DIRECT_REDUCE_SCATTER,
        DIRECT_ALLGATHER, DIRECT_ALLTOALL) == (COLL_ALLREDUCE, COLL_BROADCAST, COLL_REDUCE,
                                               COLL_REDUCE_SCATTER, COLL_ALLGATHER, COLL_ALLTOALL)
for _c in range(N_COLL):
    _register(_c, ALG_DIRECT, direct_setup, direct_ready, direct_step, direct_done)
for _c in range(1, N_COLL):           # every call's channel-0 round: descriptors, no data
    _register(_c, ALG_INLINE, inline_setup, inline_ready, inline_step, tree_done)
_register(COLL_BROADCAST, ALG_RING, chain_setup, chain_ready, chain_step, chain_done)
_register(COLL_REDUCE, ALG_RING, chain_setup, chain_ready, chain_step, chain_done)
_register(COLL_REDUCE_SCATTER, ALG_RING, blocks_setup, blocks_ready, rs_step, blocks_done)
_register(COLL_ALLGATHER, ALG_RING, blocks_setup, blocks_ready, ag_step, blocks_done)
_register(COLL_ALLTOALL, ALG_RING, xchg_setup, xchg_ready, xchg_step, xchg_done)
_register(COLL_ALLGATHER, ALG_CMA, cma_setup, cma_ready, cma_step, cma_done)
_register(COLL_ALLTOALL, ALG_CMA, cma_setup, cma_ready, cma_step, cma_done)
from shmtree.codes import ABORT_FAILED as _ABORT_FAILED
assert CMA_ABORT_FAILED == _ABORT_FAILED
cdef enum:
    COLL_BARRIER = 6        # (Engine.call: an allreduce of nothing)
    COLL_ERROR = 7          # (Engine.call: a local error said in the call's round)
    COLL_SCAN = 9           # (Engine.call: scan and exscan, an allgather of the inputs and the
    COLL_EXSCAN = 10        # fold of the rows this rank needs: msg_scan; calls.py's numbers)
    COLL_SCATTER = 8        # (Engine.call: scatter's round, and its exchange: scatter.pxi)
    BC_DATA_ONLY = 1        # (Engine.call's tag for BROADCAST: the data alone, no first round)
# the collectives by number, for the Python layer (calls.py numbers them alike; ERROR is the
# engine's own)
ALLREDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, ALLGATHER, ALLTOALL, BARRIER, ERROR = (
    COLL_ALLREDUCE, COLL_BROADCAST, COLL_REDUCE, COLL_REDUCE_SCATTER, COLL_ALLGATHER,
    COLL_ALLTOALL, COLL_BARRIER, COLL_ERROR)
SCAN, EXSCAN = COLL_SCAN, COLL_EXSCAN
SCATTER = COLL_SCATTER
DATA_ONLY = BC_DATA_ONLY


cdef int drive(Eng *e, const Alg *alg) noexcept nogil:
    """The one loop: run the algorithm's steps on the call's channel while they are ready, wait
    (wait.pxi) while none is.  Returns DONE or MISMATCH when the algorithm is done, STALLED when
    the time slice ends first, ABORTED or CORRUPT."""
    cdef Call *k = &e.call
    cdef Chan *c = &e.chans[k.ch]
    cdef Idle w
    cdef int rc, action, steps = 0
    w.since = e.idle_since            # (a wait goes on across slices: a rank parked on its bell
    w.spins = 0                       # does not spin and yield again after each slice's checks)
    w.spinning = False
    while True:
        if alg.done(e, c, k):
            e.idle_since = 0
            return RC_MISMATCH if k.mismatch else RC_DONE
        action = alg.ready(e, c, k)
        if action == 0:
            rc = idle(e, &w, alg, c, k)
            if rc != RC_DONE:
                e.idle_since = w.since
                return rc
            continue
        rc = alg.step(e, c, k, action)
        if rc != RC_DONE:
            e.idle_since = 0
            return rc
        w.since = 0
        if slice_over(e, &steps) and not alg.done(e, c, k):
            e.idle_since = 0
            return RC_STALLED


# ---------------------------------------------------------------------------------------------
cdef class Segment:
    """The group's shared mapping (one memfd) and its header fields."""
    cdef char *base
    cdef readonly uint64_t size
    cdef readonly int nranks

    def __cinit__(self, int fd, uint64_t size, int nranks):
        cdef void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if p == MAP_FAILED:
            raise OSError("shmtree: mmap of the group segment failed")
        self.base = <char *>p
        self.size = size
        self.nranks = nranks

    def __dealloc__(self):
        self.unmap()

    def unmap(self):
        if self.base != NULL:
            munmap(self.base, self.size)
            self.base = NULL

    cdef inline shm_rank_block *block(self, int r) noexcept nogil:
        return rank_block(self.base, r)

    cdef inline shm_seg_hdr *hdr(self) noexcept nogil:
        return <shm_seg_hdr *>self.base

    cdef inline void _live(self) except *:
        if self.base == NULL:
            raise ValueError("shmtree: the group's segment is closed")

    def init_header(self, bytes nonce, bytes digest):
        self._live()
        if len(nonce) != 16 or len(digest) != 16:
            raise ValueError("shmtree: nonce and digest are 16 bytes")
        cdef shm_seg_hdr *h = self.hdr()
        h.magic = MAGIC
        h.version = VERSION
        h.nranks = self.nranks
        h.total = self.size
        memcpy(h.nonce, <char *>nonce, 16)
        memcpy(h.digest, <char *>digest, 16)

    def header(self):
        """(magic, version, nranks, total size, nonce, plan digest) as stored: the attach check
        reads these."""
        self._live()
        cdef shm_seg_hdr *h = self.hdr()
        return (h.magic, h.version, h.nranks, h.total, (<char *>h.nonce)[:16],
                (<char *>h.digest)[:16])

    def set_abort(self, uint32_t reason, int rank):
        """Mark the group aborted (the first reason wins) and wake every sleeping rank."""
        self._live()
        cdef shm_seg_hdr *h = self.hdr()
        if reason == 0:
            raise ValueError("shmtree: an abort needs a reason")
        shmtree_abort_cas(&h.abort_reason, reason, rank)     # (the first reason wins; with it
                                                             # its rank, in the same word)
        cdef int r
        cdef shm_rank_block *b
        for r in range(self.nranks):
            b = self.block(r)
            shm_fetch_add32(&b.bell, 1)
            shm_futex_wake_all(&b.bell)

    def abort_state(self):
        """(reason, rank): reason 0 while the group is healthy."""
        self._live()
        cdef uint64_t word = shmtree_abort_load(&self.hdr().abort_reason)
        cdef uint32_t reason = <uint32_t>word
        return reason, <int32_t><uint32_t>(word >> 32) if reason else -1

    def abort_address(self):
        """The address of the abort word (its reason half, 0 while the group is healthy), for a
        native check that reads it with no call (_p2p.Quick): valid while this Segment lives."""
        self._live()
        return <size_t>&self.hdr().abort_reason

    def claim_rank(self):
        """Hand out ranks 0, 1, 2... in order of asking (Pool workers); may exceed nranks."""
        self._live()
        return shm_fetch_add32(&self.hdr().claim, 1)

    def mark_joined(self, int rank, uint32_t pid, double ctime):
        """Record that `rank` joined as process pid; False if the rank had joined already."""
        self._live()
        cdef shm_rank_block *b = self.block(rank)
        if not shm_cas32(&b.joined, 0, 1):
            return False
        b.pid = pid
        b.ctime = ctime
        shm_store_seqcst32(&b.joined, 2)     # published: pid and ctime are set
        return True

    def completed(self, int rank):
        """How many collectives rank is through (seq + 1 of its last completed call: all it had
        to publish for it is out)."""
        self._live()
        return shm_load_acquire64(&self.block(rank).done)

    def call_of(self, int rank):
        """seq + 1 of the call rank is inside, 0 when it is between calls."""
        self._live()
        return shm_load_acquire64(&self.block(rank).call)

    def set_state(self, int rank, uint32_t state):
        """Publish what rank's process is doing (the Python layer's ST_* codes)."""
        self._live()
        shm_store_seqcst32(&self.block(rank).state, state)

    def state(self, int rank):
        self._live()
        return shm_load_seqcst32(&self.block(rank).state)

    def set_note(self, int rank, bytes text):
        """rank's own explanation of an abort it is about to cause (truncated to fit)."""
        self._live()
        cdef shm_rank_block *b = self.block(rank)
        cdef uint32_t n = min(len(text), <uint32_t>SHM_NOTE_MAX)
        memcpy(b.note, <char *>text, n)
        shm_store_seqcst32(&b.note_len, n)

    def note(self, int rank):
        self._live()
        cdef shm_rank_block *b = self.block(rank)
        cdef uint32_t n = min(shm_load_seqcst32(&b.note_len), <uint32_t>SHM_NOTE_MAX)
        return b.note[:n].decode("utf-8", "replace")

    def member(self, int rank):
        """(joined, pid, create time) of a rank."""
        self._live()
        cdef shm_rank_block *b = self.block(rank)
        if shm_load_seqcst32(&b.joined) != 2:
            return False, 0, 0.0
        return True, b.pid, b.ctime

    def descriptor(self, int rank, uint64_t seq):
        """The call descriptor rank wrote for call `seq`: (seq, nbytes, kind, op, dtype, shape)."""
        self._live()
        cdef shm_desc *d = &self.block(rank).desc[seq & 1]
        cdef uint32_t ndim = d.head.ndim
        shape = tuple(d.dims[i] for i in range(min(ndim, <uint32_t>SHM_MAX_DIMS)))
        if ndim > <uint32_t>SHM_MAX_DIMS:
            shape = shape + (Ellipsis,)
        return (d.head.seq, d.head.nbytes, d.head.kind, d.head.op, d.head.dtype, shape)

    def bind(self, uint64_t offset, uint64_t nbytes, int mode, nodes):
        """mbind(2) a page-aligned range to a set of NUMA nodes (mode: 1 preferred, 2 bind,
        3 interleave) before its pages are touched.  Returns 0 or the errno (EPERM where a
        sandbox forbids it, ENOSYS without NUMA support): the caller falls back to first touch."""
        self._live()
        if offset % SHM_PAGE or offset + nbytes > self.size:
            raise ValueError("shmtree: bind range not page-aligned or outside the segment")
        cdef unsigned long mask[16]
        cdef int n
        memset(mask, 0, sizeof(mask))
        for n in nodes:
            if not 0 <= n < 1024:
                raise ValueError(f"shmtree: NUMA node {n} out of range")
            mask[n // 64] |= 1UL << (n % 64)
        cdef long rc = syscall(SYS_mbind, self.base + offset, nbytes, mode, mask, 1025, 0)
        return errno if rc != 0 else 0

    def page_nodes(self, uint64_t offset, uint64_t nbytes):
        """The NUMA node of each page of a range (move_pages(2) query); -errno for a page that is
        not present (-2: never touched).  None if the kernel refuses the query."""
        self._live()
        if offset + nbytes > self.size:
            raise ValueError("shmtree: range outside the segment")
        cdef uint64_t first = offset // SHM_PAGE * SHM_PAGE
        cdef Py_ssize_t count = (offset + nbytes - first + SHM_PAGE - 1) // SHM_PAGE
        cdef Py_ssize_t i
        if count == 0:
            return []
        cdef void **pages = <void **>malloc(count * sizeof(void *))
        cdef int *status = <int *>malloc(count * sizeof(int))
        if pages == NULL or status == NULL:
            free(pages)
            free(status)
            raise MemoryError()
        for i in range(count):
            pages[i] = self.base + first + i * SHM_PAGE
            status[i] = -1
        cdef long rc = syscall(SYS_move_pages, 0, count, pages, NULL, status, 0)
        try:
            if rc < 0:
                return None
            return [status[i] for i in range(count)]
        finally:
            free(pages)
            free(status)

    def touch(self, uint64_t offset, uint64_t nbytes):
        """Write zeros over a range so its pages are placed by the calling (pinned) process."""
        self._live()
        if offset + nbytes > self.size:
            raise ValueError("shmtree: touch range outside the segment")
        with nogil:
            memset(self.base + offset, 0, nbytes)


cdef class Engine:
    """One rank's state: its channels (the rings of its tree edges) and the call in progress."""
    cdef Segment seg
    cdef Eng e                        # all the nogil code sees (types.pxi)
    cdef int nchan
    cdef int busy
    # the call in progress (call): what both phases read, and what it holds until it ends here
    cdef object src_ref, dst_ref, offs_ref, fin_ref
    cdef object result                # the output, for the caller (call, take_result)
    cdef const char *src_p
    cdef char *dst_p
    cdef char *fin_from               # copied to fin_to (fin_n bytes) when the call ends
    cdef char *fin_to
    cdef uint64_t fin_n
    cdef uint64_t msg_nbytes
    cdef int msg_itemsize, msg_op, msg_dtype, phase, coll, alg
    cdef uint64_t ncalls
    cdef uint64_t next_seq            # seq of the next call (the engine numbers the calls)
    cdef uint64_t cur_seq             # seq of the call begun last
    cdef unsigned long owner          # the thread that began the call in progress
    cdef public uint64_t nt_bytes     # messages of at least this size write their output with
                                      # streaming stores (e.nt: for the call in progress)
    cdef int64_t slice_ns             # a call's time slice (the caller's checks come between)
    # the selection (Plan.selection, given once): by collective, the largest message that
    # travels inline, and the algorithm of a larger one
    cdef uint64_t sel_limit[N_COLL]
    cdef int sel_alg[N_COLL]
    # shared arrays (shared.py registers them): per allocation its id, this rank's own stretch
    # [start, start + nbytes) and every rank's mapping of it
    cdef uint64_t *share_id
    cdef uint64_t *share_start
    cdef uint64_t *share_len
    cdef char **share_bases           # [nshares * nranks]
    cdef int nshares, share_cap
    cdef list share_keep              # [nshares]: what holds the peers' mappings (shared.py's)
    cdef object place_keep, place_keep_out    # those of the allocations (input, output) the
                                      # call in progress may use single-copy: its raw pointers
                                      # (Direct.ins, outs) stay valid until the call has ended
                                      # here, whatever another thread unshares or drops
                                      # meanwhile (Communicator.close, an array's finalizer,
                                      # interpreter exit)
    cdef int direct                   # the call in progress runs ALG_DIRECT in phase 1
    cdef int cma                      # ... or ALG_CMA (alg_cma.pxi)
    cdef public uint64_t cma_bytes    # a call offers ALG_CMA when its largest block is this
    cdef public uint64_t cma_total    # large and its bytes in all this many (alg_cma.pxi:
                                      # CMA_BYTES, CMA_TOTAL)
    cdef Bcast bc                     # a broadcast's call (engine/bcast.pxi)
    cdef object bc_buf                # the last first round (reused by the next)
    cdef object bc_result, bc_out     # its output (given before the round, or made after it)
                                      # and the caller's out=
    cdef object x_full, x_out         # an exchange that travels inline: every rank's blocks,
                                      # and its output (filled from them when the call ends:
                                      # xchg_inline_finish)
    cdef uint64_t x_src_n             # an exchange's input bytes (place: the single copy)
    cdef Xv xv                        # alltoall(counts=): its first round carries the counts
    cdef object xv_buf, xv_a, xv_out, xv_B    # (engine/msg.pxi, msg_alltoallv): the round
                                      # (reused), the input, the output, the byte matrix B
    cdef ScanFold scan                # a scan's fold, run when the call ends (msg_scan)
    cdef object scan_out              # its output (held to the end)
    cdef object scan_stack            # the scans' stack of every rank's row (uint8), kept from
                                      # call to call (no fresh pages each call)
    cdef object scan_bounds           # their blocks by ring position (the blocks algorithm),
    cdef uint64_t scan_bounds_block   # for blocks of this many bytes
    # a scatter's call (engine/scatter.pxi): its mode (0: the call is no scatter), root, the
    # root's array, this rank's output (None: made once the round has said its shape), the
    # byte matrix of its exchange
    cdef int sc_mode, sc_root
    cdef object sc_src, sc_out, sc_B
    cdef const char *sc_src_p
    cdef char *sc_dst_p
    cdef uint64_t *sc_Bp

    def __cinit__(self):
        memset(&self.e, 0, sizeof(Eng))
        memset(&self.bc, 0, sizeof(Bcast))
        memset(&self.xv, 0, sizeof(Xv))
        self.bc.root = -1
        self.bc.room = 64
        self.scan.upto = -1
        self.share_keep = []

    def __init__(self, Segment seg, int rank, list channels, dict selection, int64_t spin_ns=20000,
                 int64_t yield_ns=200000, int64_t sleep_ns=20000000, uint64_t nt_bytes=0,
                 int64_t slice_ns=20000000, exchange=None):
        """channels: per channel a transport.ChannelSpec (parent, index, children, up, down,
        child_up, parent_down: segment offsets, -1 for none; nslots, stride, payload; ring,
        ring_pos).  selection: Plan.selection(), by collective (inline limit, algorithm).
        exchange: transport.Layout.exchange_spec() (the outboxes; None in a group of one)."""
        self.seg = seg
        self.e.base = seg.base
        self.e.rank = rank
        self.e.nranks = seg.nranks
        self.nchan = len(channels)
        if self.nchan < 1 or self.nchan > 3:
            raise ValueError("shmtree: an engine has one to three channels")
        self.e.abort_word = &seg.hdr().abort_reason
        self.e.spin_ns = spin_ns
        self.e.yield_ns = yield_ns
        self.e.sleep_ns = sleep_ns
        self.nt_bytes = nt_bytes
        self.slice_ns = slice_ns
        maxchild = 0
        for i, spec in enumerate(channels):
            chan_setup(self, &self.e.chans[i], spec)
            maxchild = max(maxchild, len(spec.children))
        self.e.chans[0].pair = self.e.nranks == 2 and not self.e.chans[0].ring
        self._select(selection)
        scratch_setup(self, maxchild)
        exchange_setup(self, exchange)
        # the single copy of private buffers (alg_cma.pxi): probed once, as the first call
        # begins or after its round; SHMTREE_CMA=0 switches it off (read once, here)
        self.cma_bytes = CMA_BYTES
        self.cma_total = CMA_TOTAL
        cma_publish_probe(&self.e)
        self.e.cma.state = (CMA_OFF if os.environ.get("SHMTREE_CMA", "1").strip() == "0"
                            else CMA_NO if self.e.nranks == 1 else CMA_UNKNOWN)

    # the waiting policy (wait.pxi), in ns
    @property
    def spin_ns(self):
        return self.e.spin_ns

    @spin_ns.setter
    def spin_ns(self, int64_t v):
        self.e.spin_ns = v

    @property
    def yield_ns(self):
        return self.e.yield_ns

    @yield_ns.setter
    def yield_ns(self, int64_t v):
        self.e.yield_ns = v

    @property
    def sleep_ns(self):
        return self.e.sleep_ns

    @sleep_ns.setter
    def sleep_ns(self, int64_t v):
        self.e.sleep_ns = v

    def __dealloc__(self):
        engine_free(self)

    # ---- shared arrays: the single-copy collectives (alg_direct.pxi, engine/shares.pxi) ----

    def direct_order(self, list ring, list children=None, int root=0):
        """The fold orders of the single copies: the ring order (the ranks by ring position:
        reduce_scatter's and reduce's, and allreduce's under the ring schedule, children None),
        or allreduce's pipelined tree (children[v]: v's children, left to right, under root).
        The same orders as the private paths', hence their bits."""
        direct_order_set(self, ring, children, root)

    def share(self, uint64_t ident, uint64_t start, uint64_t nbytes, bases, keep=None):
        """Register a shared allocation: this rank's own stretch of it, and every rank's mapping
        (bases: their addresses, by rank).  keep: what holds the peers' mappings; the engine
        holds it while registered, and a call that may run single-copy on the allocation holds
        it to its end (unshare does not end that).  This rank's own stretch is held by the
        call's own arrays (which lie in it)."""
        share_add(self, ident, start, nbytes, bases, keep)

    def unshare(self, uint64_t ident):
        """Forget an allocation: later calls do not find it.  A call in progress that may use
        it single-copy keeps its mappings (place_keep) until it has ended."""
        share_remove(self, ident)


    # ---- the call: one entry (Engine.call), then progress, give_output, cancel ----

    def call(self, int coll, array, out, op, int root, int kind, timeout, uint64_t tag=0,
             dims=None, offs=None):
        """Start a collective and run its first time slice; the one way into a call.

        coll: ALLREDUCE (array None: a barrier), REDUCE, REDUCE_SCATTER, ALLGATHER, BROADCAST,
        ALLTOALL, SCAN, EXSCAN or ERROR; root: the root's rank (broadcast, reduce); kind: the descriptor's (KIND_* +
        KIND_ROOT_STEP * root, which every rank compares); timeout: the first slice's limit
        (None or seconds, a float or int >= 0: the slice is the engine's slice_ns or less).
        array, out, op: the call's, as the collective takes them (engine/msg.pxi): a plain
        ndarray call of a supported dtype is taken as it is (the hot path: one C call);
        op is an op name or ufunc, or (op code, dtype code) already checked by the parse;
        tag: ALLGATHER's, ALLTOALL's, SCAN's and EXSCAN's dtype digest, BROADCAST's
        BC_DATA_ONLY; dims: the descriptor's
        shape when it is not the array's; offs: ALLGATHER's block bounds by ring position
        (bytes, 2P uint64) when the blocks differ; ALLTOALL's byte matrix B (with dims), or
        its counts (without dims: alltoall(counts=), engine/msg.pxi's msg_alltoallv).  Which
        algorithm runs is the selection's
        (engine/msg.pxi, select).  Returns (rc, result) - rc as progress's, result the output
        array when it is known from the start (None: take_result() once the call is DONE) - or
        None when the call cannot be taken as it is (the caller normalises it first:
        collectives.py) or another call is in progress (nothing has run then)."""
        cdef int64_t budget = _budget(self.slice_ns, timeout)
        cdef int rc
        if self.busy or budget < 0:
            return None
        self.result = None
        if coll == COLL_ALLREDUCE or coll == COLL_BARRIER:
            rc = msg_allreduce(self, array, out, op, kind, dims)
        elif coll == COLL_REDUCE:
            rc = msg_reduce(self, array, out, op, root, kind)
        elif coll == COLL_REDUCE_SCATTER:
            rc = msg_reduce_scatter(self, array, out, op, kind)
        elif coll == COLL_ALLGATHER:
            rc = msg_allgather(self, array, out, kind, tag, dims, offs)
        elif coll == COLL_BROADCAST:
            rc = msg_broadcast(self, array, out, root, kind, tag)
        elif coll == COLL_ALLTOALL:
            rc = msg_alltoall(self, array, out, kind, tag, dims, offs)
        elif coll == COLL_SCAN or coll == COLL_EXSCAN:
            rc = msg_scan(self, array, out, op, kind, coll == COLL_EXSCAN, tag)
        elif coll == COLL_SCATTER:
            rc = msg_scatter(self, array, out, root, kind, tag)
        elif coll == COLL_ERROR:
            rc = msg_error(self, kind, array)
        else:
            raise ValueError(f"shmtree: Engine.call: no collective {coll}")
        if rc < 0:
            self.result = None
            return None
        if rc == RC_ALONE:                # (one rank: the call is whole already)
            got = self.result
            self.result = None
            return RC_DONE, got
        if rc == RC_DONE:
            rc = self._progress(budget)
            if rc == RC_NEED_OUT:
                return rc, None           # (what the round said: take_result)
        got = self.result                 # (the output known from the start, or the result of
        self.result = None                # a broadcast done in this slice; else take_result)
        return rc, got

    def take_result(self):
        """The result of the call that ended last, when call() could not give it (a broadcast
        whose shape comes from the root): the output array, or a tuple saying what the caller
        must do next (engine/bcast.pxi, bcast_read)."""
        got = self.result
        self.result = None
        return got

    @property
    def seq(self):
        """The seq of the call begun last (calls are numbered 0, 1, ... by the engine)."""
        return self.cur_seq

    cdef int may_begin(self) except -2:
        """Just before a call begins (its arguments are parsed): -1 when another thread began
        a call meanwhile (a collector run by an allocation may have let it in: the caller's
        call is declined), RC_ABORTED when the group is aborted (nothing begins), else
        RC_DONE."""
        if self.busy:
            return -1
        if aborted(&self.e):
            return RC_ABORTED
        return RC_DONE

    cdef int alone(self, cnp.ndarray a, cnp.ndarray res) noexcept:
        """An allreduce in a group of one rank, whole (its arguments checked): the input
        copied to the output, the call numbered and counted as one that ran its round, and
        RC_ALONE (Engine.call: done, no progress to run)."""
        cdef uint64_t seq = self.next_seq
        cdef shm_rank_block *me = self.seg.block(self.e.rank)
        cdef uint64_t n = cnp.PyArray_NBYTES(a)
        self.next_seq = seq + 1
        self.cur_seq = seq
        self.e.idle_since = 0
        if n and cnp.PyArray_DATA(a) != cnp.PyArray_DATA(res):
            memcpy(cnp.PyArray_DATA(res), cnp.PyArray_DATA(a), n)
        self.ncalls += 1
        shm_store_release64(&me.done, seq + 1)
        return RC_ALONE

    cdef void begin_call(self, src, dst, const char *src_p, char *dst_p, uint64_t nbytes,
                         int itemsize, int op, int dtype, int kind, int ndim, int64_t *dims,
                         int coll, int alg) noexcept:
        """Set up a call (its arguments checked): it takes the next seq, and says so in the
        rank block (call) for peers that explain a stall; the call holds src and dst (and
        whatever msg_* made it hold) until it ends here.  alg: the selection's (ALG_INLINE:
        the message travels in the channel-0 round; else it runs on a channel of its own
        after that round, which then carries the descriptor alone)."""
        cdef uint64_t seq = self.next_seq
        self.next_seq = seq + 1
        self.cur_seq = seq
        self.e.idle_since = 0
        self.owner = PyThread_get_thread_ident()
        shm_store_release64(&self.seg.block(self.e.rank).call, seq + 1)
        self.src_p = src_p
        self.dst_p = dst_p
        self.src_ref = src
        self.dst_ref = dst
        self.msg_nbytes = nbytes
        self.e.nt = self.nt_bytes > 0 and nbytes >= self.nt_bytes
        self.msg_itemsize = itemsize if itemsize > 0 else 1
        self.msg_op = op
        self.msg_dtype = dtype
        self.coll = coll
        self.alg = alg
        write_desc(self, seq, nbytes, kind, op, dtype, ndim, dims)
        self.direct = 0
        self.cma = 0
        if self.e.cma.state == CMA_UNKNOWN:
            self.e.cma.state = cma_probe(&self.e, True)   # (where every peer has started)
        cma_place(self, seq, coll, alg, src_p, dst_p)
        if coll == COLL_ALLREDUCE:
            place(self, seq, src_p, dst_p, nbytes, alg != ALG_INLINE)
        elif coll == COLL_BROADCAST or coll == COLL_ALLGATHER:
            place(self, seq, dst_p, dst_p, nbytes, True)     # (every rank's output alone)
        elif coll == COLL_ALLTOALL:
            place(self, seq, src_p, src_p, self.x_src_n, True)    # (every rank's input alone:
                                                                  # each reads its peers')
        elif coll == COLL_REDUCE_SCATTER or dst_p == NULL:
            place(self, seq, src_p, src_p, nbytes, True)     # (every rank's input alone; reduce
        else:                                                # away from the root)
            place(self, seq, src_p, dst_p, nbytes, True)     # (reduce: the root's output must
                                                             # lie in the inputs' allocation)
        self.phase = 0
        if alg == ALG_INLINE:
            self._start_phase(0, ALG_INLINE, self.src_p, self.dst_p, nbytes)
        else:
            self._start_phase(0, ALG_INLINE, NULL, NULL, 0)
        self.busy = 1

    cdef void _begin_reduction(self, cnp.ndarray a, cnp.ndarray res, int opc, int dtc, int kind,
                               int nd, int64_t *dims, int coll) noexcept:
        """begin_call for a reduction whose arguments msg_* checked (res None: reduce away from
        the root); the overlap rule: the fast paths declined a clashing out=."""
        cdef uint64_t nbytes = cnp.PyArray_NBYTES(a)
        self.begin_call(a, res, <const char *>cnp.PyArray_DATA(a) if nbytes else NULL,
                        NULL if res is None or not nbytes else <char *>cnp.PyArray_DATA(res),
                        nbytes, cnp.PyArray_ITEMSIZE(a), opc, dtc, kind, nd, dims, coll,
                        select(self, coll, nbytes) if coll == COLL_ALLREDUCE else ALG_RING)

    cdef _select(self, dict selection):
        """Take the Plan's selection: {collective number: (inline limit, algorithm name)}."""
        cdef int coll
        names = {"tree": ALG_TREE, "ring": ALG_TREE, "chain": ALG_RING, "blocks": ALG_RING,
                 "copy": ALG_TREE, "exchange": ALG_RING}
        for coll in range(N_COLL):
            limit, alg = selection[coll]
            self.sel_limit[coll] = limit
            self.sel_alg[coll] = names[alg]
            if self.sel_alg[coll] == ALG_RING and self._ring_channel() < 0:
                raise ValueError("shmtree: the selection names a ring algorithm, and no "
                                 "channel runs the ring schedule")

    cdef void _start_phase(self, int ch, int alg, const char *src, char *dst,
                           uint64_t nbytes) noexcept nogil:
        """Set up the call state for one channel and algorithm over nbytes of src into dst."""
        cdef Chan *c = &self.e.chans[ch]
        cdef Call *k = &self.e.call
        cdef int i
        k.fn = get_kernel(self.msg_op, self.msg_dtype)
        k.ch = ch
        k.src = src
        k.dst = dst
        k.nbytes = nbytes
        k.itemsize = self.msg_itemsize
        k.j_up = 0
        k.j_down = 0
        k.mismatch = 0
        k.check_desc = 0
        # bases: each counter is written only by this rank, so its own last value is current
        c.up.base = shm_load_relaxed64(ring_head(c.up.ring)) if c.up.ring != NULL else 0
        c.down.base = shm_load_relaxed64(ring_head(c.down.ring)) if c.down.ring != NULL else 0
        c.pdown.base = (shm_load_relaxed64(ring_tail(c.pdown.ring, c.pdown.tail))
                        if c.pdown.ring != NULL else 0)
        for i in range(c.nchild):
            c.cup[i].base = shm_load_relaxed64(ring_tail(c.cup[i].ring, 0))
        _ALGS[self.coll][alg].setup(&self.e, c, k)

    cdef int _ring_channel(self) noexcept nogil:
        """The channel that runs the ring schedule with more than one rank: the bandwidth
        channel, or the ring laid around it when it is a tree; -1 if there is none."""
        cdef int ch
        for ch in range(1, self.nchan):
            if self.e.chans[ch].ring and self.e.chans[ch].parent >= 0:
                return ch
        return -1

    cdef inline int _phase1(self, int *ch) noexcept nogil:
        """Channel and algorithm of the call's phase 1: an allreduce runs on the bandwidth
        channel (its tree or ring schedule, or the single copy), the other collectives on the
        ring channel."""
        if self.direct:
            ch[0] = 1
            return ALG_DIRECT
        if self.cma:
            ch[0] = 1
            return ALG_CMA
        if self.coll == COLL_ALLREDUCE:
            ch[0] = 1
            return ALG_RING if self.e.chans[1].ring and self.e.chans[1].parent >= 0 else ALG_TREE
        ch[0] = self._ring_channel()
        return ALG_RING

    cdef inline const Alg *_alg(self) noexcept nogil:
        """The algorithm of the running phase."""
        cdef int ch
        if self.phase == 0:
            return &_ALGS[self.coll][ALG_INLINE]
        return &_ALGS[self.coll][self._phase1(&ch)]

    cdef int _run_call(self) noexcept nogil:
        """Run the phases of the call in progress (see call)."""
        cdef int rc = drive(&self.e, self._alg())
        cdef int ch, alg
        cdef const char *src
        cdef uint64_t lo
        if rc == RC_DONE and self.phase == 0 and self.e.cma.state == CMA_UNKNOWN:
            self.e.cma.state = cma_probe(&self.e, False)  # (once: every peer has started)
        if rc == RC_DONE and self.phase == 0 and self.bc.pending:
            return scatter_handover(self) if self.sc_mode else bcast_handover(self)
        if rc == RC_DONE and self.phase == 0 and self.xv.pending:
            return RC_XV_ROUND        # (alltoall(counts=): _progress reads the round)
        if rc == RC_DONE and self.phase == 0 and self.alg != ALG_INLINE:
            self.phase = 1
            self.direct = direct_agreed(self)
            self.cma = not self.direct and cma_agreed(self)
            self.e.dir.mode = self.coll
            if self.direct:
                self.e.nt = False     # (measured: streaming stores slow the single copy down,
                                      # 64 MiB at P=2 1.3x the plain stores' time)
            self.e.dir.pairwise = self.msg_dtype == DT_F2 or self.msg_dtype == DT_BF16
            alg = self._phase1(&ch)
            src = self.src_p
            if self.coll == COLL_ALLGATHER and src != NULL and not self.direct:
                lo = self.e.call.offs[2 * self.e.dir.pos]     # (the blocks algorithm sends this
                memcpy(self.dst_p + lo, src,                  # rank's block from its output)
                       self.e.call.offs[2 * self.e.dir.pos + 1] - lo)
                src = NULL
            self._start_phase(ch, alg, src, self.dst_p, self.msg_nbytes)
            rc = drive(&self.e, self._alg())
        return rc

    def progress(self, int64_t budget_ns):
        """Run the call until DONE, ABORTED, MISMATCH or CORRUPT, or STALLED when the time slice
        of budget_ns ends first (whether or not steps were taken: the caller checks its deadline,
        signals and peers between slices).  Releases the GIL."""
        if not self.busy:
            raise RuntimeError("shmtree: no call in progress")
        return self._progress(budget_ns)

    cdef int _progress(self, int64_t budget_ns) except -1:
        cdef int rc
        cdef shm_rank_block *me = self.seg.block(self.e.rank)
        if self.bc.need:
            return RC_NEED_OUT
        with nogil:
            self.e.slice_end = 0
            self.e.slice_ns = budget_ns
            rc = self._run_call()
            if rc != RC_STALLED and rc != RC_NEED_OUT and rc != RC_XV_ROUND and self.e.nt:
                shm_store_fence()             # the output's streaming stores are complete
            if rc == RC_DONE and self.scan.upto >= 0:       # (a scan: its fold, in C)
                fold_prefix(self.scan.op, self.scan.dtype, self.scan.rows, self.scan.stride,
                            self.scan.upto, self.scan.out, self.scan.n)
        if rc == RC_XV_ROUND:                 # (the counts are in: the data, inline or not)
            rc = xv_handover(self)
        if rc == RC_NEED_OUT:                 # (a broadcast's data follows: give_output)
            if self.sc_mode:
                self.result = sc_said(self, <const uint8_t *>cnp.PyArray_DATA(
                    <cnp.ndarray>self.src_ref) + CLAIM * self.e.nranks, True)
            else:
                self.result = bcast_read(self.src_ref, None, self.e.nranks, self.bc.used_room)
            return rc
        if rc != RC_STALLED:
            if rc == RC_DONE:
                self.ncalls += 1
                if self.fin_n:
                    memcpy(self.fin_to, self.fin_from, self.fin_n)
                if self.x_full is not None:
                    xchg_inline_finish(&self.e, <const char *>cnp.PyArray_DATA(self.x_full),
                                       <char *>cnp.PyArray_DATA(self.x_out))
                if self.bc.root >= 0:
                    self.result = bcast_ended(self)
                elif self.sc_mode:
                    self.result = scatter_ended(self)
            self._end_call()
            if rc == RC_DONE or rc == RC_MISMATCH:      # either way every rank is through it
                shm_store_release64(&me.done, self.cur_seq + 1)
            shm_store_release64(&me.call, 0)
        return rc

    cdef void _end_call(self) noexcept:
        """The call has ended here (or is forgotten): it lets go of what it held, the peers'
        mappings included."""
        self.busy = 0
        self.src_ref = self.dst_ref = self.offs_ref = self.fin_ref = None
        self.bc_result = self.bc_out = None
        self.x_full = self.x_out = None
        self.xv_a = self.xv_out = None
        self.xv.pending = 0
        self.scan_out = None
        self.scan.upto = -1
        self.place_keep = self.place_keep_out = None
        self.fin_n = 0
        self.bc.root = -1
        self.bc.pending = self.bc.need = self.bc.ran = 0
        self.sc_mode = 0
        self.sc_src = self.sc_out = None
        self.sc_src_p = self.sc_dst_p = NULL

    def give_output(self, dst):
        """Give the broadcast that stopped with NEED_OUT this rank's output: a C-contiguous
        writable array of the root's dtype and shape (take_result() said them: ("data", dtype,
        shape)); progress() then runs the data."""
        bcast_need_out(self, dst)

    def cancel(self):
        """Forget the call in progress (after an abort: the rings are not reused)."""
        self._end_call()
        self.result = None
        shm_store_release64(&self.seg.block(self.e.rank).call, 0)

    def stats(self):
        """Counters of this rank since it joined: calls completed, sched_yield calls, futex
        sleeps, sleeps that ran out their time (nobody woke the rank), and payload bytes sent
        (published into rings for other ranks)."""
        return {"calls": self.ncalls, "yields": self.e.n_yields, "sleeps": self.e.n_sleeps,
                "sleep_timeouts": self.e.n_timeouts, "bytes_sent": self.e.n_sent}

    def cma_counts(self):
        """The single copy by cross-memory attach (alg_cma.pxi) since this rank joined: calls
        that ran it, and the bytes this rank read out of its peers' buffers."""
        return {"calls": self.e.cma.n_calls, "bytes": self.e.cma.n_bytes}

    @property
    def cma_state(self):
        """The single copy of private buffers (alg_cma.pxi) in this group, as this rank found
        it: "unknown" (not probed yet: after the first call's round), "yes", "no" (the kernel
        does not let this rank read every peer's memory), or "off" (SHMTREE_CMA=0)."""
        return ("unknown", "yes", "no", "off")[self.e.cma.state]

    @property
    def cma_chunk(self):
        """Bytes the single copy by cross-memory attach reads at a time (alg_cma.pxi)."""
        return self.e.cma.chunk

    @cma_chunk.setter
    def cma_chunk(self, uint64_t n):
        if n < 1:
            raise ValueError("shmtree: cma_chunk must be at least 1 byte")
        self.e.cma.chunk = n

    @property
    def in_call(self):
        return bool(self.busy)

    def owns_call(self):
        """Is a call in progress that the calling thread began?  (Only that thread may cancel
        it: another thread's call must not be torn down by a concurrency error.)"""
        return bool(self.busy) and self.owner == PyThread_get_thread_ident()


include "engine/setup.pxi"
include "engine/shares.pxi"
include "engine/msg.pxi"
include "engine/msg_scan.pxi"
include "engine/msg_alltoallv.pxi"
include "engine/bcast.pxi"
include "engine/scatter.pxi"
include "engine/survive.pxi"     # (groups/survive.py: the survive region's words)
