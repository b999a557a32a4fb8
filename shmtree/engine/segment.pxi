# (included by shmtree/_engine.pyx) The group's shared mapping: one memfd, its header and the
# ranks' blocks (layout.h).  Python reaches it through Engine.seg and groups/.

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
