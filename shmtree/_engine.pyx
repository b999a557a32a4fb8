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
cdef object _DISCARD = object()      # (Engine.call's out= for an allgather whose result is
DISCARD = _DISCARD                   # not wanted: a gather away from its root; msg_allgather)


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
    RANK_ORDER_TAG = 1      # (Engine.call's tag for ALLREDUCE: two ranks fold x_0 op x_1)
# the collectives by number, for the Python layer (calls.py numbers them alike; ERROR is the
# engine's own)
ALLREDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, ALLGATHER, ALLTOALL, BARRIER, ERROR = (
    COLL_ALLREDUCE, COLL_BROADCAST, COLL_REDUCE, COLL_REDUCE_SCATTER, COLL_ALLGATHER,
    COLL_ALLTOALL, COLL_BARRIER, COLL_ERROR)
SCAN, EXSCAN = COLL_SCAN, COLL_EXSCAN
SCATTER = COLL_SCATTER
DATA_ONLY = BC_DATA_ONLY
RANK_ORDER = RANK_ORDER_TAG


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
include "engine/segment.pxi"
include "engine/engine.pxi"


include "engine/setup.pxi"
include "engine/shares.pxi"
include "engine/msg.pxi"
include "engine/msg_scan.pxi"
include "engine/msg_alltoallv.pxi"
include "engine/bcast.pxi"
include "engine/scatter.pxi"
include "engine/survive.pxi"     # (groups/survive.py: the survive region's words)
