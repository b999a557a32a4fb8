# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Mappings of memfds (Mapping, address) and the futex words of the launcher's mailbox
(word_load, word_store, word_wait: shmtree.mailbox).  (Broadcast's first round, which lived
here, is the engine's: engine/bcast.pxi.)"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

import pickle

import numpy as np

cimport numpy as cnp

cnp.import_array()

cdef extern from "<errno.h>" nogil:
    int errno


cdef extern from "<sys/mman.h>" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int PROT_READ, PROT_WRITE, MAP_SHARED, MAP_POPULATE
    void *MAP_FAILED


cdef class Mapping:
    """A shared mapping of a whole memfd (shared.py), as a writable buffer; unlike mmap.mmap it
    keeps no descriptor (the caller closes its own at once), and unmaps when it goes."""
    cdef char *base
    cdef readonly Py_ssize_t size
    cdef Py_ssize_t shape[1]
    cdef int exports
    cdef object __weakref__

    def __cinit__(self, int fd, Py_ssize_t size, bint touch=False):
        """touch: fault every page in now (the owner, pinned, places its array on its own NUMA
        node: first touch), else pages are placed by whoever touches them first."""
        if size <= 0:
            raise ValueError("shmtree: a mapping needs a positive size")
        cdef void *p
        with nogil:                   # (MAP_POPULATE: the kernel faults every page in at once)
            p = mmap(NULL, size, PROT_READ | PROT_WRITE,
                     MAP_SHARED | (MAP_POPULATE if touch else 0), fd, 0)
        if p == MAP_FAILED:
            raise OSError(errno, f"shmtree: mmap of {size} bytes failed")
        self.base = <char *>p
        self.size = size
        self.shape[0] = size

    def __dealloc__(self):
        if self.base != NULL:
            munmap(self.base, self.size)

    @property
    def address(self):
        return <size_t>self.base

    def __getbuffer__(self, Py_buffer *view, int flags):
        view.buf = self.base
        view.obj = self
        view.len = self.size
        view.readonly = 0
        view.itemsize = 1
        view.format = "B"
        view.ndim = 1
        view.shape = self.shape
        view.strides = NULL
        view.suboffsets = NULL
        view.internal = NULL
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self.exports -= 1


def address(cnp.ndarray a):
    """The address of a's first byte (shared.py looks arrays up by it)."""
    return <size_t>cnp.PyArray_DATA(a)


cdef object _ASCONTIGUOUS = np.ascontiguousarray


def bytes_of(cnp.ndarray a):
    """A C-contiguous, aligned uint8 view of a's bytes (a copy when a is not laid out so), as
    writable as a; an empty array's: a new empty one (calls.bytes_of)."""
    cdef cnp.ndarray v
    cdef cnp.npy_intp n
    if not (cnp.PyArray_IS_C_CONTIGUOUS(a) and cnp.PyArray_ISALIGNED(a)):
        a = _ASCONTIGUOUS(a)
    n = cnp.PyArray_NBYTES(a)
    if n == 0:
        return np.empty(0, np.uint8)
    v = cnp.PyArray_SimpleNewFromData(1, &n, cnp.NPY_UINT8, cnp.PyArray_DATA(a))
    if not cnp.PyArray_ISWRITEABLE(a):
        cnp.PyArray_CLEARFLAGS(v, cnp.NPY_ARRAY_WRITEABLE)
    cnp.set_array_base(v, a)
    return v


# ---------------------------------------------------------------------------------------------
# words of a Mapping shared between processes: the mailbox of a node's proxy (mailbox.py)

cdef extern from "sched.h" nogil:
    int sched_yield()

cdef extern from "_csrc/shm_sync.h" nogil:
    uint32_t shm_load_seqcst32(const volatile uint32_t *p)
    void shm_store_seqcst32(volatile uint32_t *p, uint32_t v)
    void shm_cpu_relax()
    int64_t shm_now_ns()
    int shm_futex_wait(volatile uint32_t *addr, uint32_t expected, int64_t timeout_ns)
    void shm_futex_wake_all(volatile uint32_t *addr)


cdef volatile uint32_t *_word(Mapping m, Py_ssize_t off) except NULL:
    if off < 0 or off + 4 > m.size or off % 4:
        raise ValueError(f"shmtree: word offset {off} outside the mapping or unaligned")
    return <volatile uint32_t *>(m.base + off)


def word_load(Mapping m, Py_ssize_t off):
    """The 32-bit word at byte `off` (sequentially consistent load)."""
    return shm_load_seqcst32(_word(m, off))


def word_store(Mapping m, Py_ssize_t off, uint32_t value):
    """Store the word (sequentially consistent: everything written before is visible first)
    and wake every process sleeping on it."""
    cdef volatile uint32_t *w = _word(m, off)
    shm_store_seqcst32(w, value)
    shm_futex_wake_all(w)


def word_wait(Mapping m, Py_ssize_t off, uint32_t expected, double timeout_s,
              int64_t spin_ns=50000):
    """Wait, with the GIL released, while the word equals `expected`: spin for spin_ns, then
    yield the CPU a few times, then sleep on a futex; at most timeout_s.  Returns the word."""
    cdef volatile uint32_t *w = _word(m, off)
    cdef int64_t start, now, limit
    cdef uint32_t v
    cdef int yields = 0
    with nogil:
        start = shm_now_ns()
        limit = start + <int64_t>(timeout_s * 1e9)
        while True:
            v = shm_load_seqcst32(w)
            if v != expected:
                break
            now = shm_now_ns()
            if now >= limit:
                break
            if now - start < spin_ns:
                shm_cpu_relax()
            elif yields < 16:
                yields += 1
                sched_yield()
            else:
                shm_futex_wait(w, expected, min(limit - now, <int64_t>5000000))
    return v
