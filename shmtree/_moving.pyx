# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The byte layout of broadcast's first round (collectives.py; the engine's quick_broadcast
reads the claims and the description's first bytes too), built and read here in one C pass
each, because in Python its handful of small numpy operations cost several times the round
itself.  (allgather's inline round, the output with zeros outside each rank's row, is built in
the engine: Engine.quick_allgather.)

It travels as a bitwise-or of bytes (op bor on uint8) in which each rank writes only its own
part and zeros elsewhere, so the or of all contributions is every part, exactly, for any dtype.

Broadcast's first round (bcast_fill / bcast_read): F = 8P + META + room bytes, where room (the
data room) is what the group's previous broadcast needed (next_room), so that a loop of
broadcasts of one size sends each in one round of about its own size:
  [0, 8P)            rank r's claim at 8r: 8 bytes naming the (dtype, shape) it passed, the low
                     bit set; zero when it passed None
  [8P, 8P + META)    the root's description of its array:
                       +0 u8 1 (present)     +1 u8 long: the description follows in its own round
                       +2 u8 ndim            +3 u8 length of dtype.str
                       +4 u32 length of the pickled (dtype, shape) when long
                       +8 u64 the array's nbytes
                       +16 dtype.str (at most 16 bytes)   +32 at most 8 int64 dims
                     long when the dtype has fields or a subarray, its str names another
                     dtype (ml_dtypes' bfloat16 is '<V2'), or its str or ndim do not fit
  [8P + META, F)     the root's data, when it fits the room (and the description is not long)
A claim is FNV-1a (64-bit) over the dtype's key (dtype.str for plain dtypes; its pickle for
structured ones), then ndim and every dim; every rank checks every claim against the root's.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

import pickle

import numpy as np

cimport numpy as cnp

cnp.import_array()

cdef enum:
    CLAIM = 8
    META = 96
    MAX_STR = 16
    MAX_INLINE_DIMS = 8

CLAIM_BYTES = CLAIM
META_BYTES = META

cdef dict _KEYS = {}                  # dtype -> (key bytes, inline: plain with a short str)
cdef dict _DTYPES = {}                # dtype.str bytes -> dtype


cdef tuple _key(dt):
    got = _KEYS.get(dt)
    if got is None:
        if len(_KEYS) > 1024:
            _KEYS.clear()
        # (a dtype whose str names another one - ml_dtypes' bfloat16 is '<V2' - travels
        # pickled, as structured ones do)
        plain = dt.fields is None and dt.subdtype is None and np.dtype(dt.str) == dt
        if plain:
            s = dt.str.encode()
            got = (s, len(s) <= MAX_STR)
        else:
            got = (pickle.dumps(dt, protocol=4), False)
        _KEYS[dt] = got
    return got


cdef uint64_t _fnv(const uint8_t *p, Py_ssize_t n, uint64_t h) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        h = (h ^ p[i]) * 1099511628211ULL
    return h


cdef uint64_t _claim_c(bytes key, int ndim, const int64_t *dims):
    return _claim_raw(<const uint8_t *>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), ndim,
                      dims)


cdef uint64_t _claim_raw(const uint8_t *key, Py_ssize_t n, int ndim,
                         const int64_t *dims) noexcept nogil:
    cdef uint64_t h = _fnv(key, n, 1469598103934665603ULL)
    cdef int i
    h = (h ^ <uint64_t>ndim) * 1099511628211ULL
    for i in range(ndim):
        h = (h ^ <uint64_t>dims[i]) * 1099511628211ULL
    return h | 1


def claim(dtype, shape) -> int:
    """The 8-byte claim (as an int, low bit set) naming (dtype, shape)."""
    dt = np.dtype(dtype)
    cdef int64_t dims[64]
    cdef int i, nd = len(shape)
    if nd > 64:
        raise ValueError("shmtree: at most 64 dimensions")
    for i in range(nd):
        dims[i] = shape[i]
    return _claim_c(_key(dt)[0], nd, dims)


def round_bytes(int P, Py_ssize_t room):
    """F: the size of broadcast's first round for P ranks with `room` bytes of data room."""
    return CLAIM * P + META + room


cpdef object bcast_fill(object a, bint is_root, int rank, int P, Py_ssize_t room):
    """This rank's contribution to broadcast's first round: a new uint8 array of F bytes.  a:
    None, or an ndarray of a dtype without Python objects (on the root: C-contiguous and
    aligned); None when a is not so (broadcast's fast path leaves the call to the general
    path, which makes it so or says why not)."""
    cdef cnp.ndarray arr
    if a is not None:
        if not isinstance(a, np.ndarray):
            return None
        arr = <cnp.ndarray>a
        if (cnp.PyDataType_FLAGS(<cnp.dtype>cnp.PyArray_DESCR(arr)) & 1   # (Python objects)
                or (is_root and not (cnp.PyArray_IS_C_CONTIGUOUS(arr)
                                     and cnp.PyArray_ISALIGNED(arr)))):
            return None
    cdef cnp.npy_intp n = CLAIM * P + META + room
    cdef cnp.ndarray buf = cnp.PyArray_ZEROS(1, &n, cnp.NPY_UINT8, 0)
    cdef uint8_t *p = <uint8_t *>cnp.PyArray_DATA(buf)
    cdef uint8_t *m = p + CLAIM * P
    cdef int nd, i
    cdef uint64_t c, nbytes
    cdef bytes key, blob
    if a is None:
        return buf
    nd = cnp.PyArray_NDIM(arr)
    key, short = _key(arr.dtype)
    c = _claim_c(key, nd, <const int64_t *>cnp.PyArray_DIMS(arr))
    memcpy(p + CLAIM * rank, &c, CLAIM)
    if not is_root:
        return buf
    nbytes = cnp.PyArray_NBYTES(arr)
    m[0] = 1
    memcpy(m + 8, &nbytes, 8)
    if not short or nd > MAX_INLINE_DIMS:
        blob = pickle.dumps((arr.dtype, tuple(a.shape)), protocol=4)
        m[1] = 1
        (<uint32_t *>(m + 4))[0] = <uint32_t>len(blob)
        return buf
    m[2] = nd
    m[3] = PyBytes_GET_SIZE(key)
    memcpy(m + 16, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))
    for i in range(nd):
        (<int64_t *>(m + 32))[i] = cnp.PyArray_DIMS(arr)[i]
    if nbytes <= <uint64_t>room and nbytes:
        memcpy(m + META, cnp.PyArray_DATA(arr), nbytes)
    return buf


cpdef Py_ssize_t next_room(cnp.ndarray buf, int P, Py_ssize_t cap) except -1:
    """The data room of the group's next first round: the size of the broadcast this round
    began (which every rank read from it), in whole 64-byte lines, at least 64; 64 when it
    was larger than cap (its data could not have come inline anyway).  So repeated broadcasts
    of one size take one round, and every rank agrees on the room."""
    cdef uint64_t nbytes
    memcpy(&nbytes, <uint8_t *>cnp.PyArray_DATA(buf) + CLAIM * P + 8, 8)
    nbytes = (nbytes + 63) // 64 * 64
    if nbytes < 64 or nbytes > <uint64_t>cap:
        nbytes = 64
    return <Py_ssize_t>nbytes


def long_meta(a):
    """The root's pickled (dtype, shape), for the round that follows a long description."""
    return pickle.dumps((a.dtype, tuple(a.shape)), protocol=4)


def wrong_claims(cnp.ndarray buf, int P, uint64_t want):
    """The ranks whose claim in the first round is neither zero nor `want`."""
    cdef const uint64_t *c = <const uint64_t *>cnp.PyArray_DATA(buf)
    cdef int r
    return [r for r in range(P) if c[r] != 0 and c[r] != want]


cpdef object bcast_read(cnp.ndarray buf, object out, int P, Py_ssize_t room):
    """Read broadcast's first round (every rank's contributions or-ed together).  Returns the
    result array when the data came inline and `out` is None or a C-contiguous, aligned,
    writable array of the root's dtype and shape (then `out` itself).  Otherwise a tuple:
    ("long", length) - the description follows in a round of that many bytes;
    ("mismatch", dtype, shape, ranks) - those ranks passed another dtype or shape;
    ("inline", dtype, shape) - the data is in the round (at CLAIM * P + META), `out` needs care;
    ("data", dtype, shape) - the data follows."""
    cdef uint8_t *p = <uint8_t *>cnp.PyArray_DATA(buf)
    cdef uint8_t *m = p + CLAIM * P
    cdef uint64_t nbytes
    cdef int nd = m[2], slen = m[3]
    cdef cnp.ndarray res
    if m[0] != 1:
        raise RuntimeError("shmtree: broadcast: the root's description is missing from the "
                           "first round")
    if m[1]:
        return ("long", (<uint32_t *>(m + 4))[0])
    memcpy(&nbytes, m + 8, 8)
    cdef const int64_t *dims = <const int64_t *>(m + 32)
    cdef uint64_t want = _claim_raw(m + 16, slen, nd, dims)
    cdef const uint64_t *claims = <const uint64_t *>p
    cdef bint agreed = True
    cdef int r
    for r in range(P):
        agreed = agreed and (claims[r] == 0 or claims[r] == want)
    res = None
    if (agreed and nbytes <= <uint64_t>room and type(out) is np.ndarray
            and cnp.PyArray_NDIM(<cnp.ndarray>out) == nd
            and memcmp(cnp.PyArray_DIMS(<cnp.ndarray>out), dims, nd * sizeof(int64_t)) == 0
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>out)
            and cnp.PyArray_ISALIGNED(<cnp.ndarray>out)
            and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out)):
        key, short = _key((<cnp.ndarray>out).dtype)        # (the common case: out given; no
        if (short and PyBytes_GET_SIZE(key) == slen         # dtype or shape objects built)
                and memcmp(PyBytes_AS_STRING(key), m + 16, slen) == 0):
            res = <cnp.ndarray>out
    if res is None:
        key = (<char *>(m + 16))[:slen]
        dt = _DTYPES.get(key)
        if dt is None:
            if len(_DTYPES) > 1024:
                _DTYPES.clear()
            dt = _DTYPES[key] = np.dtype(key.decode())
        shape = tuple([dims[i] for i in range(nd)])
        if not agreed:
            return ("mismatch", dt, shape, wrong_claims(buf, P, want))
        if nbytes > <uint64_t>room:
            return ("data", dt, shape)
        if out is None:
            res = np.empty(shape, dt)
        elif (type(out) is np.ndarray and (<cnp.ndarray>out).dtype == dt and out.shape == shape
              and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>out)
              and cnp.PyArray_ISALIGNED(<cnp.ndarray>out)
              and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out)):
            res = <cnp.ndarray>out
        else:
            return ("inline", dt, shape)
    if nbytes:
        memcpy(cnp.PyArray_DATA(res), m + META, nbytes)
    return res


cpdef bint fits(object out, object a) except -1:
    """Is `out` an ndarray that can take `a`'s values in place: a's dtype and shape,
    C-contiguous, aligned and writable (the common out=, checked without building objects)?"""
    if not isinstance(out, np.ndarray):
        return False
    cdef cnp.ndarray o = <cnp.ndarray>out
    cdef cnp.ndarray x = <cnp.ndarray>a
    cdef int nd = cnp.PyArray_NDIM(o)
    return (nd == cnp.PyArray_NDIM(x)
            and memcmp(cnp.PyArray_DIMS(o), cnp.PyArray_DIMS(x), nd * sizeof(cnp.npy_intp)) == 0
            and cnp.PyArray_IS_C_CONTIGUOUS(o) and cnp.PyArray_ISALIGNED(o)
            and cnp.PyArray_ISWRITEABLE(o)
            and cnp.PyArray_EquivTypes(<cnp.dtype>cnp.PyArray_DESCR(o),
                                       <cnp.dtype>cnp.PyArray_DESCR(x)))


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
