# The words of a group's survive region (shmtree/groups/survive.py: agree's votes, proposals and
# decisions, a shrink's offer, a Pool worker's task), read and written by their byte offset in the
# segment, and a futex wait / wake on one of them.  Nothing of the engine's calls touches the
# region: it works the same after the group is aborted (revoked), which is what agree needs.

cdef extern from *:
    """
    static inline int shmtree_cas64(volatile uint64_t *p, uint64_t expected, uint64_t desired) {
        return __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST,
                                           __ATOMIC_SEQ_CST);
    }
    static inline void shmtree_store_seqcst64(volatile uint64_t *p, uint64_t v) {
        __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
    }
    static inline uint64_t shmtree_load_seqcst64(const volatile uint64_t *p) {
        return __atomic_load_n(p, __ATOMIC_SEQ_CST);
    }
    """
    int shmtree_cas64(uint64_t *p, uint64_t expected, uint64_t desired) nogil
    void shmtree_store_seqcst64(uint64_t *p, uint64_t v) nogil
    uint64_t shmtree_load_seqcst64(const uint64_t *p) nogil


cdef char *_sv_at(Segment seg, uint64_t off, uint64_t n, uint64_t align) except NULL:
    """The address of n bytes at `off` in the segment, checked (mapped, in bounds, aligned)."""
    if seg.base == NULL:
        raise ValueError("shmtree: the group's segment is closed")
    if off % align or off > seg.size or n > seg.size - off:
        raise ValueError(f"shmtree: no word at offset {off} of a segment of {seg.size} bytes")
    return seg.base + off


def sv_load(Segment seg, uint64_t off):
    """The 64-bit word at `off` (sequentially consistent)."""
    return shmtree_load_seqcst64(<uint64_t *>_sv_at(seg, off, 8, 8))


def sv_store(Segment seg, uint64_t off, uint64_t value):
    """Write the 64-bit word at `off` (sequentially consistent)."""
    shmtree_store_seqcst64(<uint64_t *>_sv_at(seg, off, 8, 8), value)


def sv_cas(Segment seg, uint64_t off, uint64_t expected, uint64_t desired):
    """Compare-and-swap the 64-bit word at `off`: True if it held `expected` (now `desired`)."""
    return bool(shmtree_cas64(<uint64_t *>_sv_at(seg, off, 8, 8), expected, desired))


def sv_read(Segment seg, uint64_t off, uint64_t n):
    """n bytes at `off`, as bytes (a fence first: read after an acquire of the word that
    publishes them)."""
    cdef char *p = _sv_at(seg, off, n, 1)
    shm_fence()
    return p[:n]


def sv_write(Segment seg, uint64_t off, bytes data):
    """Write bytes at `off` (a fence after: publish them with a later store of a word)."""
    cdef uint64_t n = len(data)
    cdef char *p = _sv_at(seg, off, n, 1)
    memcpy(p, <char *>data, n)
    shm_fence()


def sv_bell(Segment seg, uint64_t off):
    """The 32-bit futex word at `off` (a bell: its value changes at every ring)."""
    return shm_load_seqcst32(<uint32_t *>_sv_at(seg, off, 4, 4))


def sv_ring(Segment seg, uint64_t off):
    """Ring the bell at `off`: bump it and wake every process that sleeps on it."""
    cdef uint32_t *p = <uint32_t *>_sv_at(seg, off, 4, 4)
    shm_fetch_add32(p, 1)
    shm_futex_wake_all(p)


def sv_sleep(Segment seg, uint64_t off, uint32_t seen, int64_t timeout_ns):
    """Sleep (without the GIL) while the bell at `off` still reads `seen`, at most timeout_ns:
    True when it rang (or had rung already), False when the time ran out."""
    cdef uint32_t *p = <uint32_t *>_sv_at(seg, off, 4, 4)
    cdef int timed_out
    with nogil:
        timed_out = shm_futex_wait(p, seen, timeout_ns)
    return not timed_out
