# cython: language_level=3
"""One rank's pipelined tree allreduce over lock-free rings in shared memory.

Layers, bottom up:
  * ring access (inline, nogil): a ring is a page-aligned region of the group's segment holding a
    head counter (written only by the producer), one tail counter per consumer (each written only by
    its consumer), every counter on its own 128-byte line, then S slots of a 64-byte slot header
    followed by the chunk payload.  Counters only grow; step k lives in slot k mod S.  Heads and
    tails are published with release stores and observed with acquire loads (shm_sync.h).
  * waking (inline, nogil): each rank owns a bell (a futex word) and a sleepers flag.  A waiter
    raises its flag, reads the bell, re-checks its conditions, then sleeps on the bell; whoever
    publishes something checks (after a full fence) the flag of the rank that may wait for it and
    rings its bell.  The fence pair makes a lost wake-up impossible.
  * the chunk steps: up (children's chunk j + own input -> one fused reduction -> parent's ring, or
    at the root the result ring and the output) and down (parent's result chunk j -> own result ring
    for the children and the output).
  * Engine (a cdef class): one rank's view of the group, one resumable call at a time; progress()
    runs the interleaved up/down loop with the GIL released until the call is done, the group is
    aborted, or nothing moved for a time budget (the Python layer then checks its peers and signals
    and calls again).
  * Segment (a cdef class): the mapping of the group's memfd, and the header fields the Python
    layer reads and writes (abort word, rank claims, join records, call descriptors).

Vocabulary: chunk (a piece of the message of at most `payload` bytes), slot (a place in a ring),
step (a counter value: the k-th chunk a ring has carried since the group began), edge (child ->
parent), up (towards the root, being reduced), down (from the root, the result).
"""
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t, int32_t
from libc.string cimport memcpy, memcmp, memset
from libc.stdlib cimport malloc, free, calloc
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED

from shmtree._kernels cimport reduce_fn, get_kernel
cimport numpy as cnp
from cpython.pythread cimport PyThread_get_thread_ident

cnp.import_array()

cdef extern from "sched.h" nogil:
    int sched_yield()

cdef extern from "<errno.h>" nogil:
    int errno

cdef extern from "<unistd.h>" nogil:
    long syscall(long number, ...)

cdef extern from "<sys/syscall.h>" nogil:
    long SYS_mbind
    long SYS_move_pages

cdef extern from "_csrc/shm_sync.h" nogil:
    uint64_t shm_load_acquire64(const uint64_t *p)
    uint64_t shm_load_relaxed64(const uint64_t *p)
    void shm_store_release64(uint64_t *p, uint64_t v)
    uint32_t shm_load_acquire32(const uint32_t *p)
    void shm_store_seqcst32(uint32_t *p, uint32_t v)
    uint32_t shm_load_seqcst32(const uint32_t *p)
    uint32_t shm_fetch_add32(uint32_t *p, uint32_t v)
    int shm_cas32(uint32_t *p, uint32_t expected, uint32_t desired)
    void shm_fence()
    void shm_cpu_relax()
    int64_t shm_now_ns()
    int shm_futex_wait(uint32_t *addr, uint32_t expected, int64_t timeout_ns)
    void shm_futex_wake_all(uint32_t *addr)
    void shm_copy_nt(void *dst, const void *src, size_t n)
    void shm_store_fence()

# ---- layout constants (mirrored in transport.py, which computes the offsets) ----
DEF LINE = 128
DEF PAGE = 4096
DEF SLOT_HDR = 64
DEF HDR_BYTES = 4096
DEF RANK_BLOCK = 1024
DEF MAX_DIMS = 12       # dims kept in a descriptor for messages (the shape digest covers all)
DEF MAX_NDIM = 64       # numpy's limit

# header fields (offsets in the segment)
DEF H_MAGIC = 0        # u64
DEF H_VERSION = 8      # u32
DEF H_NRANKS = 12      # u32
DEF H_TOTAL = 16       # u64
DEF H_NONCE = 24       # 16 bytes
DEF H_DIGEST = 48      # 16 bytes: digest of the group's plan (trees, geometry): join checks it
DEF H_ABORT = 128      # u32 reason (0: healthy), own line
DEF H_ABORT_RANK = 132 # i32
DEF H_CLAIM = 256      # u32 next rank to hand out (Pool workers), own line

# rank block fields (offsets from the block)
DEF R_BELL = 0         # u32 futex word
DEF R_SLEEPERS = 4     # u32
DEF R_JOINED = 128     # u32: 0 free, 1 being claimed, 2 joined (pid and ctime valid)
DEF R_PID = 132        # u32
DEF R_CTIME = 136      # f64 process create time (psutil)
DEF R_DONE = 144       # u64 seq + 1 of the last call this rank has completed (its part of it
                       #     is all published; a call that ended in a mismatch counts)
DEF R_STATE = 152      # u32 what the member is doing (ST_*, written by the Python layer)
DEF R_CALL = 160       # u64 seq + 1 of the call this rank is in, 0 between calls
DEF R_DESC = 256       # two call descriptors of 128 bytes, by call seq parity
DEF R_NOTE = 512       # u32 length + text: why this rank aborted the group (its own words)
DEF NOTE_MAX = RANK_BLOCK - R_NOTE - 4

# call descriptor (in the rank block, and its first 32 bytes echoed in slot headers)
DEF D_SEQ = 0          # u64
DEF D_NBYTES = 8       # u64
DEF D_SHAPE = 16       # u64 shape hash
DEF D_KIND = 24        # u16
DEF D_OP = 26          # u8
DEF D_DTYPE = 27       # u8
DEF D_NDIM = 28        # u32
DEF D_DIMS = 32        # i64[MAX_DIMS]
DEF D_CMP = 32         # bytes compared between ranks
# slot header: the descriptor's first D_CMP bytes, then the chunk index and flags
DEF S_CHUNK = 32       # u64
DEF S_FLAGS = 40       # u32

DEF FLAG_MISMATCH = 1

DEF N_TYPENUMS = 64
DEF PIPE_CHUNKS = 4         # a message on the bandwidth channel is cut into at least this many
DEF MIN_CHUNK = 4096        # chunks (down to this size), so that its pieces overlap
DEF KIND_ALLREDUCE = 1

import numpy as np
from shmtree import _kernels

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
_OP_CODE_OF = {**_kernels.OP_CODES, **_kernels.UFUNC_CODES}     # the kernels' one op table


cdef bint _ranges_overlap(cnp.ndarray a, cnp.ndarray b):
    cdef char *pa = <char *>cnp.PyArray_DATA(a)
    cdef char *pb = <char *>cnp.PyArray_DATA(b)
    return pa < pb + cnp.PyArray_NBYTES(b) and pb < pa + cnp.PyArray_NBYTES(a)


MAGIC = 0x3130454552544d53   # "SMTREE01" little endian
VERSION = 2
# the layout constants, for transport.py (one definition)
LINE_BYTES = LINE
PAGE_BYTES = PAGE
SLOT_HDR_BYTES = SLOT_HDR
HEADER_BYTES = HDR_BYTES
RANK_BLOCK_BYTES = RANK_BLOCK

# progress() results
cdef enum:
    RC_DONE = 0
    RC_STALLED = 1
    RC_ABORTED = 2
    RC_MISMATCH = 3
    RC_CORRUPT = 4

DONE = RC_DONE
STALLED = RC_STALLED
ABORTED = RC_ABORTED
MISMATCH = RC_MISMATCH
CORRUPT = RC_CORRUPT

# ---------------------------------------------------------------------------------------------
# ring access


cdef inline uint64_t ring_hdr_bytes(int ntails) noexcept nogil:
    cdef uint64_t b = <uint64_t>LINE * (1 + ntails)
    return (b + PAGE - 1) // PAGE * PAGE


cdef inline uint64_t *ring_head(char *ring) noexcept nogil:
    return <uint64_t *>ring


cdef inline uint64_t *ring_tail(char *ring, int i) noexcept nogil:
    return <uint64_t *>(ring + LINE * (1 + i))


cdef struct Chan:
    int ring              # 1: the ring schedule (parent = successor, the one child = predecessor)
    int ring_pos          # this rank's position on the ring
    int parent            # -1 at the root
    int index             # this rank's index among the parent's children (its tail there)
    int nchild
    int *children
    char *up              # ring this rank produces towards its parent (NULL at the root)
    char *down            # ring of this rank's results, read by its children (NULL at a leaf)
    char **child_up       # the children's up rings, consumed here
    char *parent_down     # the parent's result ring, read here
    uint64_t up_hdr, down_hdr, pdown_hdr
    uint64_t nslots, stride, payload


cdef inline char *slot_at(char *ring, uint64_t hdr, Chan *c, uint64_t step) noexcept nogil:
    return ring + hdr + (step % c.nslots) * c.stride


# ---------------------------------------------------------------------------------------------
# the call in progress


cdef struct Call:
    int ch
    const char *src
    char *dst
    uint64_t nbytes, chunk, m     # payload bytes, bytes per chunk, chunk (tree) or item (ring) count
    uint64_t block, nc            # ring: bytes per block, chunks per block
    int itemsize
    reduce_fn fn
    uint64_t j_up, j_down
    uint64_t up_base, down_base, pdown_base
    uint64_t *child_base
    char desc[D_CMP]
    int check_desc                # compare descriptors in chunk 0 (the channel-0 round)
    int mismatch


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

    cdef inline char *rank_block(self, int r) noexcept nogil:
        return self.base + HDR_BYTES + <uint64_t>r * RANK_BLOCK

    cdef inline void _live(self) except *:
        if self.base == NULL:
            raise ValueError("shmtree: the group's segment is closed")

    def init_header(self, bytes nonce, bytes digest):
        self._live()
        if len(nonce) != 16 or len(digest) != 16:
            raise ValueError("shmtree: nonce and digest are 16 bytes")
        (<uint64_t *>(self.base + H_MAGIC))[0] = MAGIC
        (<uint32_t *>(self.base + H_VERSION))[0] = VERSION
        (<uint32_t *>(self.base + H_NRANKS))[0] = self.nranks
        (<uint64_t *>(self.base + H_TOTAL))[0] = self.size
        memcpy(self.base + H_NONCE, <char *>nonce, 16)
        memcpy(self.base + H_DIGEST, <char *>digest, 16)

    def header(self):
        """(magic, version, nranks, total size, nonce, plan digest) as stored: the attach check
        reads these."""
        self._live()
        return ((<uint64_t *>(self.base + H_MAGIC))[0], (<uint32_t *>(self.base + H_VERSION))[0],
                (<uint32_t *>(self.base + H_NRANKS))[0], (<uint64_t *>(self.base + H_TOTAL))[0],
                (self.base + H_NONCE)[:16], (self.base + H_DIGEST)[:16])

    def set_abort(self, uint32_t reason, int rank):
        """Mark the group aborted (the first reason wins) and wake every sleeping rank."""
        self._live()
        if shm_cas32(<uint32_t *>(self.base + H_ABORT), 0, reason):
            (<int32_t *>(self.base + H_ABORT_RANK))[0] = rank
            shm_fence()
        cdef int r
        cdef char *b
        for r in range(self.nranks):
            b = self.rank_block(r)
            shm_fetch_add32(<uint32_t *>(b + R_BELL), 1)
            shm_futex_wake_all(<uint32_t *>(b + R_BELL))

    def abort_state(self):
        """(reason, rank): reason 0 while the group is healthy."""
        self._live()
        cdef uint32_t reason = shm_load_seqcst32(<uint32_t *>(self.base + H_ABORT))
        return reason, (<int32_t *>(self.base + H_ABORT_RANK))[0] if reason else -1

    def claim_rank(self):
        """Hand out ranks 0, 1, 2... in order of asking (Pool workers); may exceed nranks."""
        self._live()
        return shm_fetch_add32(<uint32_t *>(self.base + H_CLAIM), 1)

    def mark_joined(self, int rank, uint32_t pid, double ctime):
        """Record that `rank` joined as process pid; False if the rank had joined already."""
        self._live()
        cdef char *b = self.rank_block(rank)
        if not shm_cas32(<uint32_t *>(b + R_JOINED), 0, 1):
            return False
        (<uint32_t *>(b + R_PID))[0] = pid
        (<double *>(b + R_CTIME))[0] = ctime
        shm_store_seqcst32(<uint32_t *>(b + R_JOINED), 2)     # published: pid and ctime are set
        return True

    def completed(self, int rank):
        """How many collectives rank is through (seq + 1 of its last completed call: all it had
        to publish for it is out)."""
        self._live()
        return shm_load_acquire64(<uint64_t *>(self.rank_block(rank) + R_DONE))

    def call_of(self, int rank):
        """seq + 1 of the call rank is inside, 0 when it is between calls."""
        self._live()
        return shm_load_acquire64(<uint64_t *>(self.rank_block(rank) + R_CALL))

    def set_state(self, int rank, uint32_t state):
        """Publish what rank's process is doing (the Python layer's ST_* codes)."""
        self._live()
        shm_store_seqcst32(<uint32_t *>(self.rank_block(rank) + R_STATE), state)

    def state(self, int rank):
        self._live()
        return shm_load_seqcst32(<uint32_t *>(self.rank_block(rank) + R_STATE))

    def set_note(self, int rank, bytes text):
        """rank's own explanation of an abort it is about to cause (truncated to fit)."""
        self._live()
        cdef char *b = self.rank_block(rank)
        cdef uint32_t n = min(len(text), NOTE_MAX)
        memcpy(b + R_NOTE + 4, <char *>text, n)
        shm_store_seqcst32(<uint32_t *>(b + R_NOTE), n)

    def note(self, int rank):
        self._live()
        cdef char *b = self.rank_block(rank)
        cdef uint32_t n = min(shm_load_seqcst32(<uint32_t *>(b + R_NOTE)), NOTE_MAX)
        return (b + R_NOTE + 4)[:n].decode("utf-8", "replace")

    def member(self, int rank):
        """(joined, pid, create time) of a rank."""
        self._live()
        cdef char *b = self.rank_block(rank)
        if shm_load_seqcst32(<uint32_t *>(b + R_JOINED)) != 2:
            return False, 0, 0.0
        return True, (<uint32_t *>(b + R_PID))[0], (<double *>(b + R_CTIME))[0]

    def descriptor(self, int rank, uint64_t seq):
        """The call descriptor rank wrote for call `seq`: (seq, nbytes, kind, op, dtype, shape)."""
        self._live()
        cdef char *d = self.rank_block(rank) + R_DESC + (seq & 1) * 128
        cdef uint32_t ndim = (<uint32_t *>(d + D_NDIM))[0]
        cdef int64_t *dims = <int64_t *>(d + D_DIMS)
        shape = tuple(dims[i] for i in range(min(ndim, MAX_DIMS)))
        if ndim > MAX_DIMS:
            shape = shape + (Ellipsis,)
        return ((<uint64_t *>(d + D_SEQ))[0], (<uint64_t *>(d + D_NBYTES))[0],
                (<uint16_t *>(d + D_KIND))[0], (<uint8_t *>(d + D_OP))[0],
                (<uint8_t *>(d + D_DTYPE))[0], shape)

    def bind(self, uint64_t offset, uint64_t nbytes, int mode, nodes):
        """mbind(2) a page-aligned range to a set of NUMA nodes (mode: 1 preferred, 2 bind,
        3 interleave) before its pages are touched.  Returns 0 or the errno (EPERM where a
        sandbox forbids it, ENOSYS without NUMA support): the caller falls back to first touch."""
        self._live()
        if offset % PAGE or offset + nbytes > self.size:
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
        cdef uint64_t first = offset // PAGE * PAGE
        cdef Py_ssize_t count = (offset + nbytes - first + PAGE - 1) // PAGE
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
            pages[i] = self.base + first + i * PAGE
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
    cdef int rank, nranks, nchan
    cdef Chan chans[2]
    cdef Call call
    cdef int busy
    cdef uint32_t *abort_word
    cdef public int64_t spin_ns, yield_ns, sleep_ns
    # the message of the call in progress (begin): both phases read it
    cdef object src_ref, dst_ref
    cdef const char *src_p
    cdef char *dst_p
    cdef uint64_t msg_nbytes, small_bytes
    cdef int msg_itemsize, msg_op, msg_dtype, phase
    cdef uint64_t ncalls
    cdef uint64_t next_seq            # seq of the next call (the engine numbers the calls)
    cdef uint64_t cur_seq             # seq of the call begun last
    cdef int64_t slice_end            # monotonic ns at which the running slice ends (0: the
    cdef int64_t slice_ns             # clock was not read yet: a call that finishes at once
                                      # never reads it)
    cdef unsigned long owner          # the thread that began the call in progress
    cdef uint64_t n_yields, n_sleeps, n_timeouts
    cdef public uint64_t nt_bytes     # messages of at least this size write their output with
    cdef bint nt                      # streaming stores (nt: for the call in progress)

    def __cinit__(self):
        memset(&self.chans[0], 0, sizeof(Chan) * 2)
        memset(&self.call, 0, sizeof(Call))

    def __init__(self, Segment seg, int rank, list channels, int64_t spin_ns=20000,
                 int64_t yield_ns=200000, int64_t sleep_ns=5000000, uint64_t nt_bytes=0):
        """channels: per channel a dict with parent, index, children, up, down, child_up,
        parent_down (segment offsets, -1 for none), nslots, stride, payload."""
        self.seg = seg
        self.rank = rank
        self.nranks = seg.nranks
        self.nchan = len(channels)
        if self.nchan < 1 or self.nchan > 2:
            raise ValueError("shmtree: an engine has one or two channels")
        self.abort_word = <uint32_t *>(seg.base + H_ABORT)
        self.spin_ns = spin_ns
        self.yield_ns = yield_ns
        self.sleep_ns = sleep_ns
        self.nt_bytes = nt_bytes
        maxchild = 0
        for i, spec in enumerate(channels):
            self._setup(&self.chans[i], spec)
            maxchild = max(maxchild, len(spec["children"]))
        self.call.child_base = <uint64_t *>calloc(maxchild + 1, sizeof(uint64_t))
        if self.call.child_base == NULL:
            raise MemoryError()

    cdef char *_ptr(self, int64_t off, uint64_t need) except? NULL:
        if off < 0:
            return NULL
        if <uint64_t>off + need > self.seg.size:
            raise ValueError("shmtree: ring offset outside the segment")
        return self.seg.base + off

    cdef _setup(self, Chan *c, dict spec):
        cdef int i
        cdef list children = list(spec["children"])
        c.ring = 1 if spec.get("ring") else 0
        c.ring_pos = spec.get("ring_pos", 0)
        c.parent = spec["parent"]
        c.index = spec["index"]
        c.nchild = len(children)
        c.nslots = spec["nslots"]
        c.stride = spec["stride"]
        c.payload = spec["payload"]
        if c.nslots < 1 or c.stride < c.payload + SLOT_HDR:
            raise ValueError("shmtree: bad ring geometry")
        c.up_hdr = ring_hdr_bytes(1)
        c.down_hdr = ring_hdr_bytes(c.nchild)
        c.pdown_hdr = ring_hdr_bytes(spec["parent_nchild"])
        span_up = c.up_hdr + c.nslots * c.stride
        c.up = self._ptr(spec["up"], span_up)
        c.down = self._ptr(spec["down"], c.down_hdr + c.nslots * c.stride)
        c.parent_down = self._ptr(spec["parent_down"], c.pdown_hdr + c.nslots * c.stride)
        c.children = <int *>calloc(c.nchild + 1, sizeof(int))
        c.child_up = <char **>calloc(c.nchild + 1, sizeof(char *))
        if c.children == NULL or c.child_up == NULL:
            raise MemoryError()
        for i in range(c.nchild):
            c.children[i] = children[i]
            c.child_up[i] = self._ptr(spec["child_up"][i], span_up)
        if c.ring:
            if (c.parent >= 0) != (c.up != NULL) or c.nchild > 1 or c.down != NULL:
                raise ValueError("shmtree: inconsistent ring schedule")
            return
        if (c.parent >= 0) != (c.up != NULL) or (c.parent >= 0) != (c.parent_down != NULL):
            raise ValueError("shmtree: inconsistent parent rings")
        if (c.nchild > 0) != (c.down != NULL):
            raise ValueError("shmtree: inconsistent child rings")

    def __dealloc__(self):
        cdef int i
        for i in range(2):
            free(self.chans[i].children)
            free(self.chans[i].child_up)
        free(self.call.child_base)

    # ---- the call ----

    def begin(self, src, dst, int itemsize, int op, int dtype, int kind, tuple shape,
              uint64_t small_bytes):
        """Begin a collective: src and dst are C-contiguous numpy arrays of the same size (dst
        writable; they may be the same array), or None for a call that carries no data.

        Phase 0 is one round on channel 0 that carries this rank's call descriptor, which every
        parent compares with its children's (MISMATCH on any difference), and the data itself
        when it is at most small_bytes; phase 1 pipelines larger messages through channel 1.
        The call gets the engine's next seq (`seq` tells it).  Returns DONE when started, ABORTED
        if the group is already aborted (no seq is used then)."""
        if self.busy:
            raise RuntimeError("shmtree: a call is already in progress on this engine")
        if src is not None and cnp.PyArray_NBYTES(dst) != cnp.PyArray_NBYTES(src):
            raise ValueError("shmtree: source and destination sizes differ")
        if get_kernel(op, dtype) == NULL:
            raise TypeError("shmtree: no kernel for this op and dtype")
        if shm_load_acquire32(self.abort_word):
            return RC_ABORTED
        cdef int64_t dims[MAX_NDIM]
        cdef int i, nd = len(shape)
        if nd > MAX_NDIM:
            raise ValueError(f"shmtree: at most {MAX_NDIM} dimensions")
        for i in range(nd):
            dims[i] = shape[i]
        self._begin_c(src, dst, itemsize, op, dtype, kind, nd, dims, small_bytes)
        return RC_DONE

    @property
    def seq(self):
        """The seq of the call begun last (calls are numbered 0, 1, ... by the engine)."""
        return self.cur_seq

    cdef void _begin_c(self, src, dst, int itemsize, int op, int dtype, int kind,
                       int ndim, int64_t *dims, uint64_t small_bytes):
        """Set up a call whose arguments are checked (see begin and quick): it takes the next
        seq, and says so in the rank block (R_CALL) for peers that explain a stall."""
        cdef uint64_t nbytes = 0
        cdef uint64_t seq = self.next_seq
        self.next_seq = seq + 1
        self.cur_seq = seq
        self.owner = PyThread_get_thread_ident()
        shm_store_release64(<uint64_t *>(self.seg.rank_block(self.rank) + R_CALL), seq + 1)
        self.src_p = NULL
        self.dst_p = NULL
        if src is not None:
            nbytes = cnp.PyArray_NBYTES(src)
            if nbytes:
                self.src_p = <const char *>cnp.PyArray_DATA(src)
                self.dst_p = <char *>cnp.PyArray_DATA(dst)
        self.src_ref = src
        self.dst_ref = dst
        self.msg_nbytes = nbytes
        self.nt = self.nt_bytes > 0 and nbytes >= self.nt_bytes
        self.msg_itemsize = itemsize if itemsize > 0 else 1
        self.msg_op = op
        self.msg_dtype = dtype
        self.small_bytes = small_bytes
        self._write_desc(seq, nbytes, kind, op, dtype, ndim, dims)
        self.phase = 0
        if nbytes <= small_bytes:
            self._start_phase(0, self.src_p, self.dst_p, nbytes, 1)
        else:
            self._start_phase(0, NULL, NULL, 0, 1)
        self.busy = 1

    cdef void _start_phase(self, int ch, const char *src, char *dst, uint64_t nbytes,
                           uint64_t m) noexcept nogil:
        """Set up the call state for one channel: m chunks (tree) over nbytes of src into dst."""
        cdef Chan *c = &self.chans[ch]
        cdef Call *k = &self.call
        cdef uint64_t nitems
        cdef int i
        k.fn = get_kernel(self.msg_op, self.msg_dtype)
        k.ch = ch
        k.src = src
        k.dst = dst
        k.nbytes = nbytes
        k.itemsize = self.msg_itemsize
        k.chunk = (c.payload // k.itemsize) * k.itemsize
        k.m = m
        if c.ring and c.parent >= 0:
            # P blocks of whole items; every block travels as nc chunks; 2(P-1) blocks per rank
            nitems = nbytes // k.itemsize
            k.block = (nitems + self.nranks - 1) // self.nranks * k.itemsize
            k.nc = (k.block + k.chunk - 1) // k.chunk if k.block else 1
            k.m = 2 * (self.nranks - 1) * k.nc     # sends; as many items are received
        k.j_up = 0
        k.j_down = 0
        k.mismatch = 0
        k.check_desc = ch == 0
        # bases: each counter is written only by this rank, so its own last value is current
        k.up_base = shm_load_relaxed64(ring_head(c.up)) if c.up != NULL else 0
        k.down_base = shm_load_relaxed64(ring_head(c.down)) if c.down != NULL else 0
        k.pdown_base = (shm_load_relaxed64(ring_tail(c.parent_down, c.index))
                        if c.parent_down != NULL else 0)
        for i in range(c.nchild):
            k.child_base[i] = shm_load_relaxed64(ring_tail(c.child_up[i], 0))

    cdef int _run_call(self) noexcept nogil:
        """Run the phases of the call in progress (see begin)."""
        cdef int rc = self._run()
        cdef Chan *c
        cdef uint64_t chunk
        if rc == RC_DONE and self.phase == 0 and self.msg_nbytes > self.small_bytes:
            self.phase = 1
            chunk = self._chunk_for(&self.chans[1], self.msg_nbytes)
            self._start_phase(1, self.src_p, self.dst_p, self.msg_nbytes,
                              (self.msg_nbytes + chunk - 1) // chunk)
            self.call.chunk = chunk
            rc = self._run()
        return rc

    cdef inline uint64_t _chunk_for(self, Chan *c, uint64_t nbytes) noexcept nogil:
        """Bytes per chunk for a message on a tree channel: the slot payload, or less so that a
        mid-sized message is still cut into PIPE_CHUNKS chunks that overlap in the pipeline
        (never below MIN_CHUNK).  A function of (nbytes, itemsize, payload) alone: every rank
        cuts the message the same way."""
        cdef uint64_t item = self.msg_itemsize
        cdef uint64_t chunk = c.payload // item * item
        cdef uint64_t want = (nbytes + PIPE_CHUNKS - 1) // PIPE_CHUNKS
        if c.ring or want >= chunk:
            return chunk
        if want < MIN_CHUNK:
            want = MIN_CHUNK
        want = (want + 63) // 64 * 64                    # whole cache lines ...
        want = (want + item - 1) // item * item          # ... of whole items
        return want if want < chunk else chunk

    cdef void _write_desc(self, uint64_t seq, uint64_t nbytes, int kind, int op, int dtype,
                          int ndim, int64_t *dims) noexcept:
        """This rank's call descriptor, in its rank block (read by others to explain a
        mismatch) and in self.call.desc (stamped on every slot of the call)."""
        cdef char *d = self.seg.rank_block(self.rank) + R_DESC + (seq & 1) * 128
        cdef int i
        cdef int nkept = ndim if ndim < MAX_DIMS else MAX_DIMS
        cdef uint64_t h = 1469598103934665603ULL        # FNV-1a over all the dims
        for i in range(ndim):
            h = (h ^ <uint64_t>dims[i]) * 1099511628211ULL
        h = (h ^ <uint64_t>ndim) * 1099511628211ULL
        memset(d, 0, 128)
        (<uint64_t *>(d + D_SEQ))[0] = seq
        (<uint64_t *>(d + D_NBYTES))[0] = nbytes
        (<uint64_t *>(d + D_SHAPE))[0] = h
        (<uint16_t *>(d + D_KIND))[0] = kind
        (<uint8_t *>(d + D_OP))[0] = op
        (<uint8_t *>(d + D_DTYPE))[0] = dtype
        (<uint32_t *>(d + D_NDIM))[0] = ndim
        for i in range(nkept):
            (<int64_t *>(d + D_DIMS))[i] = dims[i]
        memcpy(self.call.desc, d, D_CMP)

    def progress(self, int64_t budget_ns):
        """Run the call until DONE, ABORTED, MISMATCH or CORRUPT, or STALLED when the time slice
        of budget_ns ends first (whether or not steps were taken: the caller checks its deadline,
        signals and peers between slices).  Releases the GIL."""
        if not self.busy:
            raise RuntimeError("shmtree: no call in progress")
        return self._progress(budget_ns)

    cdef int _progress(self, int64_t budget_ns):
        cdef int rc
        cdef char *me = self.seg.rank_block(self.rank)
        with nogil:
            self.slice_end = 0
            self.slice_ns = budget_ns
            rc = self._run_call()
            if rc != RC_STALLED and self.nt:
                shm_store_fence()             # the output's streaming stores are complete
        if rc != RC_STALLED:
            self.busy = 0
            self.src_ref = None
            self.dst_ref = None
            if rc == RC_DONE:
                self.ncalls += 1
            if rc == RC_DONE or rc == RC_MISMATCH:      # either way every rank is through it
                shm_store_release64(<uint64_t *>(me + R_DONE), self.cur_seq + 1)
            shm_store_release64(<uint64_t *>(me + R_CALL), 0)
        return rc

    def quick(self, array, op, out, uint64_t small_bytes, int64_t slice_ns, timeout):
        """The allreduce fast path, for the common case: `array` a C-contiguous, aligned,
        native-endian ndarray of a supported dtype, `op` a known op for it, `out` None or such
        an ndarray of the same dtype and shape that is the input itself or does not overlap it.
        Begins the call and runs it for one time slice: slice_ns, or less when timeout (None or
        seconds, a float or int >= 0) is shorter.  Returns (rc, result), or None when the general
        path must handle the call (validation, copies, error messages)."""
        if self.busy or type(array) is not np.ndarray:
            return None
        cdef int64_t budget_ns = slice_ns
        cdef double wait
        if timeout is not None:
            if type(timeout) is not float and type(timeout) is not int:
                return None
            wait = timeout
            if not wait >= 0:
                return None
            if wait * 1e9 < budget_ns:
                budget_ns = <int64_t>(wait * 1e9)
            if budget_ns < 500000:
                budget_ns = 500000
        cdef cnp.ndarray a = <cnp.ndarray>array
        cdef cnp.ndarray res
        cdef int num = cnp.PyArray_TYPE(a)
        if (num < 0 or num >= N_TYPENUMS or _TYPENUM_CODE[num] < 0
                or not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISNOTSWAPPED(a)
                or not cnp.PyArray_ISALIGNED(a)):
            return None
        code = _OP_CODE_OF.get(op) if (type(op) is str or type(op) is np.ufunc) else None
        if code is None:
            return None
        cdef int opc = code
        cdef int dtc = _TYPENUM_CODE[num]
        if get_kernel(opc, dtc) == NULL:
            return None
        cdef int nd = cnp.PyArray_NDIM(a)
        if out is None:
            res = cnp.PyArray_EMPTY(nd, cnp.PyArray_DIMS(a), num, 0)
        else:
            if type(out) is not np.ndarray:
                return None
            res = <cnp.ndarray>out
            if (cnp.PyArray_TYPE(res) != num or cnp.PyArray_NDIM(res) != nd
                    or not cnp.PyArray_IS_C_CONTIGUOUS(res) or not cnp.PyArray_ISWRITEABLE(res)
                    or not cnp.PyArray_ISALIGNED(res) or not cnp.PyArray_ISNOTSWAPPED(res)
                    or memcmp(cnp.PyArray_DIMS(res), cnp.PyArray_DIMS(a),
                              nd * sizeof(cnp.npy_intp)) != 0):
                return None
            if res is not a and _ranges_overlap(a, res):
                return None
        if shm_load_acquire32(self.abort_word):
            return RC_ABORTED, res
        self._begin_c(a, res, cnp.PyArray_ITEMSIZE(a), opc, dtc, KIND_ALLREDUCE, nd,
                      <int64_t *>cnp.PyArray_DIMS(a), small_bytes)
        return self._progress(budget_ns), res

    def cancel(self):
        """Forget the call in progress (after an abort: the rings are not reused)."""
        self.busy = 0
        self.src_ref = None
        self.dst_ref = None
        shm_store_release64(<uint64_t *>(self.seg.rank_block(self.rank) + R_CALL), 0)

    def stats(self):
        """Counters of this rank's waiting since it joined: calls completed, sched_yield calls,
        futex sleeps, and sleeps that ran out their time (nobody woke the rank)."""
        return {"calls": self.ncalls, "yields": self.n_yields, "sleeps": self.n_sleeps,
                "sleep_timeouts": self.n_timeouts}

    @property
    def in_call(self):
        return bool(self.busy)

    def owns_call(self):
        """Is a call in progress that the calling thread began?  (Only that thread may cancel
        it: another thread's call must not be torn down by a concurrency error.)"""
        return bool(self.busy) and self.owner == PyThread_get_thread_ident()

    # ---- writing the output ----

    cdef inline void _out(self, char *dst, const char *src, uint64_t n) noexcept nogil:
        """Copy result bytes into the caller's output: streaming stores for large messages
        (nt_bytes and up), whose output will not be read back from cache soon."""
        if self.nt:
            shm_copy_nt(dst, src, n)
        else:
            memcpy(dst, src, n)

    # ---- waking ----

    cdef inline void _wake(self, int r) noexcept nogil:
        """Ring rank r's bell if it is (about to be) asleep; callers have fenced."""
        cdef char *b = self.seg.rank_block(r)
        if shm_load_seqcst32(<uint32_t *>(b + R_SLEEPERS)):
            shm_fetch_add32(<uint32_t *>(b + R_BELL), 1)
            shm_futex_wake_all(<uint32_t *>(b + R_BELL))

    # ---- readiness ----

    cdef inline bint _up_ready(self, Chan *c, Call *k) noexcept nogil:
        cdef uint64_t j = k.j_up
        cdef int i
        cdef uint64_t t, low
        for i in range(c.nchild):
            if shm_load_acquire64(ring_head(c.child_up[i])) <= k.child_base[i] + j:
                return False
        if c.up != NULL:
            if k.up_base + j - shm_load_acquire64(ring_tail(c.up, 0)) >= c.nslots:
                return False
        elif c.down != NULL:
            return self._down_room(c, k.down_base + j)
        return True

    cdef inline bint _down_room(self, Chan *c, uint64_t step) noexcept nogil:
        """Is there a free slot for `step` in this rank's result ring (all children past it)?"""
        cdef int i
        for i in range(c.nchild):
            if step - shm_load_acquire64(ring_tail(c.down, i)) >= c.nslots:
                return False
        return True

    cdef inline bint _down_ready(self, Chan *c, Call *k) noexcept nogil:
        if shm_load_acquire64(ring_head(c.parent_down)) <= k.pdown_base + k.j_down:
            return False
        if c.down != NULL:
            return self._down_room(c, k.down_base + k.j_down)
        return True

    # ---- chunk steps ----

    cdef inline void _stamp(self, char *slot, Call *k, uint64_t j) noexcept nogil:
        memcpy(slot, k.desc, D_CMP)
        (<uint64_t *>(slot + S_CHUNK))[0] = j
        (<uint32_t *>(slot + S_FLAGS))[0] = FLAG_MISMATCH if k.mismatch else 0

    cdef inline bint _slot_ok(self, const char *slot, Call *k, uint64_t j) noexcept nogil:
        """Does a received slot belong to this call and chunk?  (Only the seq when the
        descriptors are being compared: a different descriptor is a mismatch, not corruption.)"""
        if (<uint64_t *>(slot + S_CHUNK))[0] != j:
            return False
        return (<uint64_t *>(slot + D_SEQ))[0] == (<uint64_t *>(k.desc + D_SEQ))[0]

    cdef int _up_step(self, Chan *c, Call *k) noexcept nogil:
        cdef uint64_t j = k.j_up
        cdef uint64_t lo = j * k.chunk
        cdef uint64_t n = 0
        cdef int i, nsrc = 1
        cdef char *slot
        cdef char *target
        cdef const void *srcs[257]
        cdef const void **sv = srcs
        cdef const void **heap = NULL
        if lo < k.nbytes:
            n = k.nbytes - lo
            if n > k.chunk:
                n = k.chunk
        if c.nchild + 1 > 257:
            heap = <const void **>malloc((c.nchild + 1) * sizeof(void *))
            if heap == NULL:
                return RC_CORRUPT
            sv = heap
        sv[0] = k.src + lo if k.src != NULL else NULL
        for i in range(c.nchild):
            slot = slot_at(c.child_up[i], c.up_hdr, c, k.child_base[i] + j)
            if not self._slot_ok(slot, k, j):
                free(heap)
                return RC_CORRUPT
            if k.check_desc and ((<uint32_t *>(slot + S_FLAGS))[0] & FLAG_MISMATCH
                                 or memcmp(slot, k.desc, D_CMP) != 0):
                k.mismatch = 1
            sv[nsrc] = slot + SLOT_HDR
            nsrc += 1
        if c.up != NULL:
            slot = slot_at(c.up, c.up_hdr, c, k.up_base + j)
        elif c.down != NULL:
            slot = slot_at(c.down, c.down_hdr, c, k.down_base + j)
        else:
            slot = NULL
        target = slot + SLOT_HDR if slot != NULL else k.dst + lo
        if n and not k.mismatch:
            if nsrc == 1 and target == <char *>sv[0]:
                pass
            elif nsrc == 1:
                memcpy(target, sv[0], n)
            else:
                k.fn(target, sv, nsrc, n // k.itemsize)
            if slot != NULL and c.up == NULL:        # the root keeps its own copy of the result
                self._out(k.dst + lo, target, n)
        free(heap)
        if slot != NULL:
            self._stamp(slot, k, j)
        for i in range(c.nchild):                     # children's slots are consumed
            shm_store_release64(ring_tail(c.child_up[i], 0), k.child_base[i] + j + 1)
        if c.up != NULL:
            shm_store_release64(ring_head(c.up), k.up_base + j + 1)
        elif c.down != NULL:
            shm_store_release64(ring_head(c.down), k.down_base + j + 1)
        shm_fence()
        for i in range(c.nchild):
            self._wake(c.children[i])
        if c.parent >= 0:
            self._wake(c.parent)
        k.j_up = j + 1
        if c.parent < 0:
            k.j_down = j + 1                          # the root's result is final at once
        return RC_DONE

    cdef int _down_step(self, Chan *c, Call *k) noexcept nogil:
        cdef uint64_t j = k.j_down
        cdef uint64_t lo = j * k.chunk
        cdef uint64_t n = 0
        cdef int i
        cdef char *mine
        cdef char *slot = slot_at(c.parent_down, c.pdown_hdr, c, k.pdown_base + j)
        if not self._slot_ok(slot, k, j):
            return RC_CORRUPT
        if (<uint32_t *>(slot + S_FLAGS))[0] & FLAG_MISMATCH:
            k.mismatch = 1
        if lo < k.nbytes:
            n = k.nbytes - lo
            if n > k.chunk:
                n = k.chunk
        if k.mismatch:
            n = 0
        if c.down != NULL:                            # pass the result on to the children
            mine = slot_at(c.down, c.down_hdr, c, k.down_base + j)
            if n:
                memcpy(mine + SLOT_HDR, slot + SLOT_HDR, n)
            self._stamp(mine, k, j)
            if n:
                self._out(k.dst + lo, mine + SLOT_HDR, n)
        elif n:
            self._out(k.dst + lo, slot + SLOT_HDR, n)
        shm_store_release64(ring_tail(c.parent_down, c.index), k.pdown_base + j + 1)
        if c.down != NULL:
            shm_store_release64(ring_head(c.down), k.down_base + j + 1)
        shm_fence()
        self._wake(c.parent)
        for i in range(c.nchild):
            self._wake(c.children[i])
        k.j_down = j + 1
        return RC_DONE

    # ---- the loop ----

    cdef inline bint _done(self, Chan *c, Call *k) noexcept nogil:
        return k.j_down >= k.m and k.j_up >= k.m

    cdef inline bint _can_up(self, Chan *c, Call *k) noexcept nogil:
        return k.j_up < k.m and self._up_ready(c, k)

    cdef inline bint _can_down(self, Chan *c, Call *k) noexcept nogil:
        return c.parent >= 0 and k.j_down < k.j_up and self._down_ready(c, k)

    cdef inline bint _slice_over(self, int *steps) noexcept nogil:
        """After a step: has the time slice ended?  (The clock is read every 8th step.)"""
        steps[0] += 1
        return (steps[0] & 7) == 0 and self._now_past_slice(shm_now_ns())

    cdef inline bint _now_past_slice(self, int64_t now) noexcept nogil:
        """Is `now` past the end of the slice?  The slice is timed from the first look at the
        clock (at most 8 steps or one idle turn after its start)."""
        if self.slice_end == 0:
            self.slice_end = now + self.slice_ns
        return now >= self.slice_end

    cdef int _run(self) noexcept nogil:
        cdef Chan *c = &self.chans[self.call.ch]
        cdef Call *k = &self.call
        cdef int64_t idle_since = 0
        cdef int rc, spins = 0, steps = 0
        cdef bint spinning = False
        if c.ring and c.parent >= 0:
            return self._run_ring(c, k)
        while True:
            if self._done(c, k):
                return RC_MISMATCH if k.mismatch else RC_DONE
            if self._can_down(c, k):
                rc = self._down_step(c, k)
            elif self._can_up(c, k):
                rc = self._up_step(c, k)
            else:
                rc = self._idle(&idle_since, &spins, &spinning, c, k)
                if rc != RC_DONE:
                    return rc
                continue
            if rc != RC_DONE:
                return rc
            idle_since = 0
            if self._slice_over(&steps) and not self._done(c, k):
                return RC_STALLED
            if rc != RC_DONE:
                return rc

    cdef inline bint _ready(self, Chan *c, Call *k) noexcept nogil:
        if c.ring:
            return self._ring_send_ready(c, k) or self._ring_last_ready(c, k)
        return self._can_down(c, k) or self._can_up(c, k)

    cdef int _idle(self, int64_t *idle_since, int *spins, bint *spinning, Chan *c,
                   Call *k) noexcept nogil:
        """Nothing was ready: spin (pause), then yield, then sleep on the bell.  RC_DONE means
        'look again'; RC_STALLED or RC_ABORTED end the slice."""
        cdef char *me = self.seg.rank_block(self.rank)
        cdef uint32_t *bell = <uint32_t *>(me + R_BELL)
        cdef uint32_t *sleepers = <uint32_t *>(me + R_SLEEPERS)
        cdef int64_t idle, now
        cdef uint32_t seen
        if shm_load_acquire32(self.abort_word):
            return RC_ABORTED
        if idle_since[0] == 0:
            idle_since[0] = shm_now_ns()
            spinning[0] = self.spin_ns > 0
            spins[0] = 0
        spins[0] += 1
        if spinning[0] and (spins[0] & 31):
            shm_cpu_relax()
            return RC_DONE
        now = shm_now_ns()
        if self._now_past_slice(now):
            return RC_STALLED
        idle = now - idle_since[0]
        if idle < self.spin_ns:
            shm_cpu_relax()
        elif idle < self.spin_ns + self.yield_ns:
            spinning[0] = False
            self.n_yields += 1
            sched_yield()
        else:
            spinning[0] = False
            shm_store_seqcst32(sleepers, 1)
            shm_fence()                 # pairs with the publisher's fence before it reads the flag
            seen = shm_load_seqcst32(bell)
            if not (self._ready(c, k) or shm_load_acquire32(self.abort_word)):
                self.n_sleeps += 1
                self.n_timeouts += shm_futex_wait(bell, seen, min(self.sleep_ns,
                                                                  self.slice_end - now))
            shm_store_seqcst32(sleepers, 0)
        return RC_DONE

    # ---- the ring schedule (reduce-scatter, then allgather, around tree.ring) ----
    #
    # The message is cut into P blocks of nc chunks.  Chunk column c of every block goes round the
    # ring on its own: position p sends 2(P-1) items for it, step s = 0 .. 2P-3, to its successor:
    #   s = 0            block p, own input;
    #   1 <= s < P-1     block p-s: predecessor's item (c, s-1) (op) own input   (reduce-scatter);
    #   s = P-1          block p+1: the same, now complete: also written to the output;
    #   s >= P           block p+1-(s-P+1): predecessor's item (c, s-1), copied to the output too;
    # then receives the predecessor's item (c, 2P-3) into the output only.  Item t = c*(2P-2) + s
    # depends on the predecessor's item t-1 alone, so the ring never needs more than two slots
    # however large the blocks (ordering items block by block would need a whole block of slots).
    # Each block is completed at exactly one rank, so every rank gets the same bits.

    cdef inline void _ring_piece(self, Chan *c, Call *k, uint64_t col, int64_t s,
                                 uint64_t *lo, uint64_t *n) noexcept nogil:
        """Byte range of chunk column col of the block this position handles at step s
        (s = 2P-2, one past its last send, is the block of the final receive)."""
        cdef int64_t P = self.nranks
        cdef int64_t b
        cdef uint64_t bhi, clo
        if s < P - 1:
            b = c.ring_pos - s
        else:
            b = c.ring_pos + 1 - (s - (P - 1))
        b = ((b % P) + P) % P
        bhi = (<uint64_t>b + 1) * k.block
        if bhi > k.nbytes:
            bhi = k.nbytes
        clo = <uint64_t>b * k.block + col * k.chunk
        lo[0] = clo
        n[0] = 0
        if clo < bhi:
            n[0] = bhi - clo
            if n[0] > k.chunk:
                n[0] = k.chunk

    cdef inline bint _ring_recv_next(self, Call *k) noexcept nogil:
        """Is the next action the final receive of a column (not a send)?"""
        cdef uint64_t steps = 2 * (self.nranks - 1)
        return k.j_up > 0 and k.j_up % steps == 0 and k.j_down < k.j_up

    cdef inline bint _ring_send_ready(self, Chan *c, Call *k) noexcept nogil:
        cdef uint64_t t = k.j_up
        cdef uint64_t steps = 2 * (self.nranks - 1)
        if t >= k.m or self._ring_recv_next(k):
            return False
        if k.up_base + t - shm_load_acquire64(ring_tail(c.up, 0)) >= c.nslots:
            return False
        if t % steps and shm_load_acquire64(ring_head(c.child_up[0])) < k.child_base[0] + t:
            return False
        return True

    cdef inline bint _ring_last_ready(self, Chan *c, Call *k) noexcept nogil:
        return (self._ring_recv_next(k)
                and shm_load_acquire64(ring_head(c.child_up[0])) > k.child_base[0] + k.j_down)

    cdef int _ring_send(self, Chan *c, Call *k) noexcept nogil:
        cdef uint64_t t = k.j_up
        cdef uint64_t P = self.nranks
        cdef uint64_t s = t % (2 * (P - 1))
        cdef uint64_t lo, n
        cdef char *mine = slot_at(c.up, c.up_hdr, c, k.up_base + t)
        cdef char *got = NULL
        cdef const void *srcs[2]
        self._ring_piece(c, k, t // (2 * (P - 1)), s, &lo, &n)
        if s >= 1:
            got = slot_at(c.child_up[0], c.up_hdr, c, k.child_base[0] + t - 1)
            if not self._slot_ok(got, k, t - 1):
                return RC_CORRUPT
        if n:
            if s == 0:
                memcpy(mine + SLOT_HDR, k.src + lo, n)
            elif s <= P - 1:
                srcs[0] = got + SLOT_HDR
                srcs[1] = k.src + lo
                k.fn(mine + SLOT_HDR, srcs, 2, n // k.itemsize)
            else:
                memcpy(mine + SLOT_HDR, got + SLOT_HDR, n)
            if s >= P - 1:
                self._out(k.dst + lo, mine + SLOT_HDR, n)
        self._stamp(mine, k, t)
        if s >= 1:
            shm_store_release64(ring_tail(c.child_up[0], 0), k.child_base[0] + t)
            k.j_down = t
        shm_store_release64(ring_head(c.up), k.up_base + t + 1)
        shm_fence()
        self._wake(c.parent)
        self._wake(c.children[0])
        k.j_up = t + 1
        return RC_DONE

    cdef int _ring_last(self, Chan *c, Call *k) noexcept nogil:
        """The predecessor's last item of a column (its final allgather step): output only."""
        cdef uint64_t u = k.j_down
        cdef uint64_t lo, n
        cdef char *got = slot_at(c.child_up[0], c.up_hdr, c, k.child_base[0] + u)
        if not self._slot_ok(got, k, u):
            return RC_CORRUPT
        self._ring_piece(c, k, u // (2 * (self.nranks - 1)), 2 * (self.nranks - 1), &lo, &n)
        if n:
            self._out(k.dst + lo, got + SLOT_HDR, n)
        shm_store_release64(ring_tail(c.child_up[0], 0), k.child_base[0] + u + 1)
        shm_fence()
        self._wake(c.children[0])
        k.j_down = u + 1
        return RC_DONE

    cdef int _run_ring(self, Chan *c, Call *k) noexcept nogil:
        cdef int64_t idle_since = 0
        cdef int rc, spins = 0, steps = 0
        cdef bint spinning = False
        while True:
            if k.j_up >= k.m and k.j_down >= k.m:
                return RC_DONE
            if self._ring_send_ready(c, k):
                rc = self._ring_send(c, k)
            elif self._ring_last_ready(c, k):
                rc = self._ring_last(c, k)
            else:
                rc = self._idle(&idle_since, &spins, &spinning, c, k)
                if rc != RC_DONE:
                    return rc
                continue
            if rc != RC_DONE:
                return rc
            idle_since = 0
            if self._slice_over(&steps) and not (k.j_up >= k.m and k.j_down >= k.m):
                return RC_STALLED
