# scatter's call (Engine.call with SCATTER), all of it in this file.  One engine call:
#
#   1. a first round laid out as broadcast's (bcast.pxi: claims, the root's description, and the
#      data when it fits the room), in which every rank that passed out= claims its block (the
#      dtype and shape of its out=), and every rank checks every claim against the block the
#      root's description gives that rank (axis=None: array[r]; axis=0: np.array_split's block
#      r).  So an out= that disagrees with the root's array is a mismatch seen alike by every
#      rank, in the round itself: no round of shapes before the data.
#   2. the data: inline when it fits the round's room (the next round's room follows the last
#      round's size, as broadcast's: a loop of small scatters of one size takes one round each),
#      else, in the same call, the exchange (alg_exchange.pxi) of the root's blocks, one to each
#      rank (scatter_handover).
# What the round says otherwise (a long description, a mismatch, no ring channel) ends the call
# with a tuple that the Python layer goes on from (collectives.py, Executors._scatter_rest).
# The descriptor of the round: (F, mode), kind KIND_SCATTER + KIND_ROOT_STEP * root, so that
# ranks with different axes or roots, or another collective, are a mismatch.

cdef enum:
    SC_ROWS = 1                       # axis=None: rank r gets array[r]
    SC_SPLIT = 2                      # axis=0: np.array_split(array, P, axis=0)[r]

SCATTER_ROWS = SC_ROWS
SCATTER_SPLIT = SC_SPLIT


cdef inline uint64_t sc_rows_of(int64_t n, int P, int r, uint64_t *lo) noexcept nogil:
    """np.array_split's block r of n rows into P: its rows, and (lo) its first row."""
    cdef int64_t q = n // P, rem = n % P
    lo[0] = <uint64_t>(r * q + (r if r < rem else rem))
    return <uint64_t>(q + (1 if r < rem else 0))


cdef int sc_block(int mode, int nd, const int64_t *dims, uint64_t nbytes, int P, int r,
                  int64_t *bdims, uint64_t *lo, uint64_t *n) noexcept nogil:
    """Rank r's block of the root's array (nd dims, nbytes): its shape into bdims (returns its
    ndim), its first byte (lo) and its bytes (n)."""
    cdef uint64_t row, first, rows
    cdef int i
    if mode == SC_ROWS:
        n[0] = nbytes // <uint64_t>P if P else 0
        lo[0] = <uint64_t>r * n[0]
        for i in range(1, nd):
            bdims[i - 1] = dims[i]
        return nd - 1
    rows = sc_rows_of(dims[0], P, r, &first)
    row = nbytes // <uint64_t>dims[0] if dims[0] > 0 else 0
    n[0] = rows * row
    lo[0] = first * row
    bdims[0] = <int64_t>rows
    for i in range(1, nd):
        bdims[i] = dims[i]
    return nd


cdef bint sc_claim_wrong(const uint8_t *p, int P, int r, int mode, const uint8_t *key,
                        Py_ssize_t klen, int nd, const int64_t *dims,
                        uint64_t nbytes) noexcept nogil:
    """Is rank r's claim in the round neither zero nor its block's?"""
    cdef uint64_t claim = (<const uint64_t *>p)[r]
    cdef int64_t bdims[MAX_NDIM]
    cdef uint64_t lo, n
    cdef int bnd
    if claim == 0:
        return False
    bnd = sc_block(mode, nd, dims, nbytes, P, r, bdims, &lo, &n)
    return claim != _claim_raw(key, klen, bnd, bdims)


cdef bint sc_wrong(const uint8_t *p, int P, int mode, const uint8_t *key, Py_ssize_t klen,
                   int nd, const int64_t *dims, uint64_t nbytes) noexcept nogil:
    """Is any rank's claim in the round neither zero nor its block's?"""
    cdef int r
    for r in range(P):
        if sc_claim_wrong(p, P, r, mode, key, klen, nd, dims, nbytes):
            return True
    return False


cdef object sc_new_block(cnp.ndarray a, int mode, int P, int r):
    """The root's new output: a C-contiguous array of its block's shape and a's dtype."""
    cdef int64_t bdims[MAX_NDIM]
    cdef cnp.npy_intp shape[MAX_NDIM]
    cdef uint64_t lo, n
    cdef int nd = cnp.PyArray_NDIM(a), i, bnd
    cdef int64_t dims[MAX_NDIM]
    for i in range(nd):
        dims[i] = cnp.PyArray_DIMS(a)[i]
    bnd = sc_block(mode, nd, dims, cnp.PyArray_NBYTES(a), P, r, bdims, &lo, &n)
    for i in range(bnd):
        shape[i] = bdims[i]
    num = cnp.PyArray_TYPE(a)
    if (num < cnp.NPY_OBJECT or num == cnp.NPY_FLOAT16) and cnp.PyArray_ISNOTSWAPPED(a):
        return cnp.PyArray_EMPTY(bnd, shape, num, 0)
    return np.empty(tuple([shape[i] for i in range(bnd)]), a.dtype)


cdef bint sc_plain_out(cnp.ndarray o) noexcept:
    return (cnp.PyArray_IS_C_CONTIGUOUS(o) and cnp.PyArray_ISALIGNED(o)
            and cnp.PyArray_ISWRITEABLE(o)
            and not cnp.PyDataType_FLAGS(<cnp.dtype>cnp.PyArray_DESCR(o)) & 1)


cdef int msg_scatter(Engine self, array, out, int root, int kind, uint64_t mode) except -2:
    """scatter: the root passes a C-contiguous, aligned ndarray without Python objects (axis
    None: of shape (P, ...)), the others None (what they pass is not read); out= None or a
    C-contiguous, aligned, writable ndarray without Python objects (the root's: of its block's
    shape and the array's dtype, clear of the array).  mode: SC_ROWS (axis=None) or SC_SPLIT
    (axis=0)."""
    cdef int me = self.e.rank, P = self.e.nranks, rc, nd, i, bnd
    cdef bint is_root = me == root
    cdef cnp.ndarray a = None, o = None, f
    cdef int64_t dims[MAX_NDIM]
    cdef int64_t bdims[MAX_NDIM]
    cdef int64_t ddims[2]
    cdef uint64_t lo, n, nbytes, c
    cdef Py_ssize_t room = self.bc.room
    cdef cnp.npy_intp F = CLAIM * P + META + room
    cdef uint8_t *p
    cdef uint8_t *m
    if not 0 <= root < P or (mode != SC_ROWS and mode != SC_SPLIT):
        return -1
    if out is not None:
        if type(out) is not _NDARRAY or not sc_plain_out(<cnp.ndarray>out):
            return -1
        o = <cnp.ndarray>out
    if is_root:
        if type(array) is not _NDARRAY:
            return -1
        a = <cnp.ndarray>array
        nd = cnp.PyArray_NDIM(a)
        if (not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISALIGNED(a)
                or cnp.PyDataType_FLAGS(<cnp.dtype>cnp.PyArray_DESCR(a)) & 1
                or nd < 1 or nd > MAX_NDIM or (mode == SC_ROWS and cnp.PyArray_DIMS(a)[0] != P)):
            return -1
        for i in range(nd):
            dims[i] = cnp.PyArray_DIMS(a)[i]
        if o is not None:
            bnd = sc_block(mode, nd, dims, cnp.PyArray_NBYTES(a), P, me, bdims, &lo, &n)
            if (cnp.PyArray_NDIM(o) != bnd
                    or not cnp.PyArray_EquivTypes(<cnp.dtype>cnp.PyArray_DESCR(a),
                                                  <cnp.dtype>cnp.PyArray_DESCR(o))):
                return -1
            for i in range(bnd):
                if cnp.PyArray_DIMS(o)[i] != bdims[i]:
                    return -1
            if n and _ranges_overlap(a, o):
                return -1                 # (the caller copies the input first)
        else:
            o = <cnp.ndarray>sc_new_block(a, mode, P, me)
    if self.sc_B is None or cnp.PyArray_SIZE(<cnp.ndarray>self.sc_B) != P * P:
        self.sc_B = np.zeros(P * P, np.uint64)
    reuse = self.bc_buf
    if reuse is not None and cnp.PyArray_NBYTES(<cnp.ndarray>reuse) == F:
        f = <cnp.ndarray>reuse
        memset(cnp.PyArray_DATA(f), 0, F)
    else:
        f = cnp.PyArray_ZEROS(1, &F, cnp.NPY_UINT8, 0)
    p = <uint8_t *>cnp.PyArray_DATA(f)
    m = p + CLAIM * P
    if is_root:
        key, short = _key(a.dtype)
        nbytes = cnp.PyArray_NBYTES(a)
        m[0] = 1
        memcpy(m + 8, &nbytes, 8)
        if not short or nd > MAX_INLINE_DIMS:
            blob = pickle.dumps((a.dtype, tuple((<object>a).shape)), protocol=4)
            m[1] = 1
            (<uint32_t *>(m + 4))[0] = <uint32_t>len(blob)
        else:
            m[2] = nd
            m[3] = PyBytes_GET_SIZE(key)
            memcpy(m + 16, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))
            memcpy(m + 32, dims, nd * sizeof(int64_t))
            if nbytes <= <uint64_t>room and nbytes:
                memcpy(m + META, cnp.PyArray_DATA(a), nbytes)
    elif o is not None:
        key, short = _key(o.dtype)
        c = _claim_c(key, cnp.PyArray_NDIM(o), <const int64_t *>cnp.PyArray_DIMS(o))
        memcpy(p + CLAIM * me, &c, CLAIM)
    rc = self.may_begin()
    if rc != RC_DONE:
        return rc
    self.bc_buf = f
    ddims[0] = F
    ddims[1] = <int64_t>mode
    self.begin_call(f, f, <const char *>p, <char *>p, F, 1, OP_BOR, DT_U1, kind, 2, ddims,
                    COLL_ALLREDUCE, ALG_INLINE)
    self.bc.pending = 1
    self.bc.root = -1                     # (no broadcast: bcast_ended is not for it)
    self.bc.used_room = room
    self.sc_mode = <int>mode
    self.sc_root = root
    self.sc_src = a
    self.sc_out = o
    self.sc_src_p = <const char *>cnp.PyArray_DATA(a) if a is not None else NULL
    self.sc_dst_p = <char *>cnp.PyArray_DATA(o) if o is not None else NULL
    self.sc_Bp = <uint64_t *>cnp.PyArray_DATA(<cnp.ndarray>self.sc_B)
    cma_offer(self, self.cur_seq, self.sc_src_p, True)   # (alg_cma.pxi: decided from B after
    return RC_DONE                                       # the round, in scatter_handover)


cdef int scatter_handover(Engine self) noexcept nogil:
    """After scatter's first round: when every claim agrees, the description is short and the
    data did not come in the round, run the exchange of the root's blocks in the same call
    (every rank read the same round, so every rank decides alike).  RC_NEED_OUT when this rank
    has no output yet (bcast_need_out gives it)."""
    cdef int P = self.e.nranks, me = self.e.rank, q, ch, nd, root = self.sc_root
    cdef const uint8_t *p = <const uint8_t *>self.dst_p
    cdef const uint8_t *m = p + CLAIM * P
    cdef const int64_t *dims = <const int64_t *>(m + 32)
    cdef int64_t bdims[MAX_NDIM]
    cdef uint64_t n, lo, b
    cdef uint64_t *B = self.sc_Bp
    self.bc.pending = 0
    ch = self._ring_channel()
    if ch < 0 or m[0] != 1 or m[1] != 0:
        return RC_DONE
    nd = m[2]
    memcpy(&n, m + 8, 8)
    if sc_wrong(p, P, self.sc_mode, m + 16, m[3], nd, dims, n):
        return RC_DONE                    # (a mismatch: the caller says it)
    if n <= <uint64_t>self.bc.used_room:
        return RC_DONE                    # (the data came in the round)
    memset(B, 0, <size_t>P * P * sizeof(uint64_t))
    for q in range(P):
        sc_block(self.sc_mode, nd, dims, n, P, q, bdims, &lo, &b)
        B[root * P + q] = b
    self.e.x.m = xchg_tables(&self.e, B)
    self.x_src_n = n if me == root else 0
    self.bc.ran = 1
    self.phase = 1
    self.direct = 0
    self.coll = COLL_ALLTOALL
    self.msg_nbytes = n
    self.src_p = self.sc_src_p if me == root else NULL
    self.e.dir.mode = COLL_ALLTOALL
    self.e.dir.pairwise = 0
    self.e.nt = self.nt_bytes > 0 and B[root * P + me] >= self.nt_bytes
    self.cma = cma_big(self, B) and cma_agreed(self)     # (every rank offered: alg_cma.pxi)
    if self.sc_dst_p == NULL:
        self.bc.need = 1
        return RC_NEED_OUT
    self.dst_p = self.sc_dst_p
    self._start_phase(ch, ALG_CMA if self.cma else ALG_RING, self.src_p, self.dst_p, n)
    return drive(&self.e, self._alg())


cdef object sc_dtype(const uint8_t *m):
    key = (<char *>(m + 16))[:m[3]]
    dt = _DTYPES.get(key)
    if dt is None:
        if len(_DTYPES) > 1024:
            _DTYPES.clear()
        dt = _DTYPES[key] = np.dtype(key.decode())
    return dt


cdef object sc_said(Engine self, const uint8_t *m, bint block):
    """("data", dtype, shape) from the round's short description: the root's array's shape,
    or (block) this rank's block's."""
    cdef int nd = m[2], bnd, i
    cdef const int64_t *dims = <const int64_t *>(m + 32)
    cdef int64_t bdims[MAX_NDIM]
    cdef uint64_t lo, n, nbytes
    memcpy(&nbytes, m + 8, 8)
    if not block:
        return ("data", sc_dtype(m), tuple([dims[i] for i in range(nd)]))
    bnd = sc_block(self.sc_mode, nd, dims, nbytes, self.e.nranks, self.e.rank, bdims, &lo, &n)
    return ("data", sc_dtype(m), tuple([bdims[i] for i in range(bnd)]))


cdef object scatter_ended(Engine self):
    """scatter's call has ended (DONE): this rank's block, when the data came (in the round,
    or by the exchange that followed it), else (what the round said, the round, its room) for
    the Python layer to go on: ("long", length), ("mismatch", dtype, shape, ranks) or
    ("data", dtype, shape) - the root's array's dtype and shape."""
    cdef int P = self.e.nranks, me = self.e.rank, nd, count, i
    cdef cnp.ndarray first = <cnp.ndarray>self.src_ref
    cdef const uint8_t *p = <const uint8_t *>cnp.PyArray_DATA(first)
    cdef const uint8_t *m = p + CLAIM * P
    cdef const int64_t *dims = <const int64_t *>(m + 32)
    cdef int64_t bdims[MAX_NDIM]
    cdef uint64_t nbytes, lo, n
    cdef cnp.ndarray o
    room = self.bc.used_room
    self.bc.room = next_room(first, P, self.sel_limit[COLL_BROADCAST])
    if self.bc.ran:
        return self.sc_out
    if m[0] != 1:
        raise RuntimeError("shmtree: scatter: the root's description is missing from the "
                           "first round")
    if m[1]:
        return ("long", (<uint32_t *>(m + 4))[0]), first, room
    nd = m[2]
    memcpy(&nbytes, m + 8, 8)
    if sc_wrong(p, P, self.sc_mode, m + 16, m[3], nd, dims, nbytes):
        said = sc_said(self, m, False)
        wrong = [i for i in range(P) if sc_claim_wrong(p, P, i, self.sc_mode, m + 16, m[3], nd,
                                                       dims, nbytes)]
        return ("mismatch", said[1], said[2], wrong), first, room
    if nbytes > <uint64_t>room and P > 1:
        return sc_said(self, m, False), first, room      # (no ring channel: the caller's)
    sc_block(self.sc_mode, nd, dims, nbytes, P, me, bdims, &lo, &n)
    if self.sc_out is None:
        self.sc_out = np.empty(sc_said(self, m, True)[2], sc_dtype(m))
    o = <cnp.ndarray>self.sc_out
    if n:
        if me == self.sc_root:
            memcpy(cnp.PyArray_DATA(o), self.sc_src_p + lo, n)
        else:
            memcpy(cnp.PyArray_DATA(o), m + META + lo, n)
    return o


def scatter_claims_wrong(cnp.ndarray first, int P, int mode, dtype, shape, uint64_t nbytes):
    """The ranks whose claim in scatter's first round is neither zero nor their block of the
    root's array (dtype, shape): after a long description, which came in a round of its own."""
    cdef int64_t dims[MAX_NDIM]
    cdef int nd = len(shape), i
    cdef bytes key = _key(np.dtype(dtype))[0]
    if nd > MAX_NDIM:
        raise ValueError("shmtree: at most 64 dimensions")
    for i in range(nd):
        dims[i] = shape[i]
    return [i for i in range(P)
            if sc_claim_wrong(<const uint8_t *>cnp.PyArray_DATA(first), P, i, mode,
                              <const uint8_t *>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key),
                              nd, dims, nbytes)]


def scatter_block(int mode, shape, uint64_t nbytes, int P, int r):
    """Rank r's block of a root's array of `shape` (nbytes): (its shape, its first byte, its
    bytes) - np.array_split's rule for axis=0, array[r] for axis=None."""
    cdef int64_t dims[MAX_NDIM]
    cdef int64_t bdims[MAX_NDIM]
    cdef uint64_t lo, n
    cdef int nd = len(shape), i, bnd
    if nd > MAX_NDIM:
        raise ValueError("shmtree: at most 64 dimensions")
    for i in range(nd):
        dims[i] = shape[i]
    bnd = sc_block(mode, nd, dims, nbytes, P, r, bdims, &lo, &n)
    return tuple([bdims[i] for i in range(bnd)]), lo, n
