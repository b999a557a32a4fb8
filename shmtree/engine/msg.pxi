# The engine's parser (the C twin of calls.py) and the selection: one function per collective
# that takes a call's arguments as they are - a plain ndarray of a supported dtype, out= None
# or such an ndarray - checks them, makes its output, picks the algorithm and begins the call
# (Engine.call).  -1: the call cannot be taken as it is (foreign, strided, overlapping,
# misaligned, swapped, an op or dtype without a kernel): the Python layer normalises it
# (collectives.py) and calls again, never a different implementation.  Included by _engine.pyx
# after the Engine class.


cdef int select(Engine self, int coll, uint64_t nbytes) noexcept:
    """The algorithm a call of `coll` over nbytes runs (the Plan's table, Plan.selection, given
    to the engine once): ALG_INLINE (in the channel-0 round), ALG_RING (the collective's own
    algorithm on the ring channel: chain, blocks), or ALG_TREE (the allreduce's bandwidth
    channel, whatever its schedule: the allreduce; for the other collectives the allreduce of
    the message, which they then read their part of).  ALG_DIRECT (single copy) is chosen at
    run time, when every rank's buffers lie in shared arrays."""
    if nbytes <= self.sel_limit[coll]:
        return ALG_INLINE
    return self.sel_alg[coll]


cdef object empty_like(cnp.ndarray a, cnp.npy_intp lead):
    """A new C-contiguous array of a's dtype and shape, with a first dimension `lead` put in
    front when lead >= 0: made in C for numpy's plain numeric types (the hot path), by
    np.empty for any other dtype."""
    cdef int nd = cnp.PyArray_NDIM(a), num = cnp.PyArray_TYPE(a)
    cdef cnp.npy_intp dims[MAX_NDIM + 1]
    cdef int first = 1 if lead >= 0 else 0
    if nd + first > MAX_NDIM:
        raise ValueError(f"shmtree: at most {MAX_NDIM} dimensions")
    dims[0] = lead
    memcpy(dims + first, cnp.PyArray_DIMS(a), nd * sizeof(cnp.npy_intp))
    if (num < cnp.NPY_OBJECT or num == cnp.NPY_FLOAT16) and cnp.PyArray_ISNOTSWAPPED(a):
        return cnp.PyArray_EMPTY(nd + first, dims, num, 0)
    return np.empty(tuple([dims[i] for i in range(nd + first)]), a.dtype)


cdef inline bint _codes(cnp.ndarray a, op, int *opc, int *dtc):
    """The op and dtype codes of a reduction of `a` (op: a name or ufunc, parsed here, or the
    parse's (op code, dtype code)); False when it has no kernel or a is not laid out so that
    the kernels take it (C-contiguous, aligned; native byte order unless the codes are the
    parse's)."""
    if type(op) is tuple:
        opc[0] = op[0]
        dtc[0] = op[1]
        return (get_kernel(opc[0], dtc[0]) != NULL and cnp.PyArray_IS_C_CONTIGUOUS(a)
                and cnp.PyArray_ISALIGNED(a))
    return _reducible(a, op, opc, dtc)


cdef int msg_allreduce(Engine self, array, out, op, int kind, dims) except -2:
    """allreduce (and a barrier: array None; the byte rounds of the other collectives: a
    bitwise or of uint8 in place): out None (a new array), or an ndarray of the input's type
    and shape, C-contiguous, writable, aligned, that is the input itself or clear of it.
    dims: the descriptor's shape when it is not the array's."""
    cdef int opc, dtc, nd, i, rc
    cdef int64_t given[MAX_NDIM]
    cdef int64_t *dp
    cdef cnp.ndarray a, res
    if array is None:
        if type(op) is tuple:
            opc, dtc = op
        else:
            opc, dtc = OP_MAX, DT_U1
        rc = self.may_begin()
        if rc == RC_DONE:
            self.begin_call(None, None, NULL, NULL, 0, 1, opc, dtc, kind, 0, given,
                            COLL_ALLREDUCE, ALG_INLINE)
        return rc
    if type(array) is not _NDARRAY:
        return -1
    a = <cnp.ndarray>array
    if not _codes(a, op, &opc, &dtc):
        return -1
    nd = cnp.PyArray_NDIM(a)
    got = _output(a, out, nd, cnp.PyArray_DIMS(a), cnp.PyArray_TYPE(a), True)
    if got is None:
        return -1
    res = <cnp.ndarray>got
    dp = <int64_t *>cnp.PyArray_DIMS(a)
    if dims is not None:
        if len(dims) > MAX_NDIM:
            return -1
        nd = len(dims)
        for i in range(nd):
            given[i] = dims[i]
        dp = given
    self.result = res
    rc = self.may_begin()
    if rc == RC_DONE:
        if self.e.nranks == 1:            # (one rank: the copy, the call numbered; no round)
            return self.alone(a, res)
        self._begin_reduction(a, res, opc, dtc, kind, nd, dp, COLL_ALLREDUCE)
    return rc


cdef int msg_reduce(Engine self, array, out, op, int root, int kind) except -2:
    """reduce: array as for allreduce; on the root out as allreduce's (elsewhere ignored, the
    result None).  Selection: the chain to the root's ring position, or the allreduce (whose
    result only the root keeps)."""
    cdef int opc, dtc, nd
    cdef cnp.ndarray a
    if type(array) is not _NDARRAY or not 0 <= root < self.e.nranks:
        return -1
    a = <cnp.ndarray>array
    mine = out if root == self.e.rank else None
    if select(self, COLL_REDUCE, cnp.PyArray_NBYTES(a)) != ALG_RING:
        rc = msg_allreduce(self, a, mine, op, kind, None)
        if root != self.e.rank:
            self.result = None
        return rc
    if not _codes(a, op, &opc, &dtc):
        return -1
    nd = cnp.PyArray_NDIM(a)
    if nd > MAX_NDIM:
        return -1
    res = None
    if root == self.e.rank:
        res = _output(a, mine, nd, cnp.PyArray_DIMS(a), cnp.PyArray_TYPE(a), True)
        if res is None:
            return -1
    self.result = res
    rc = self.may_begin()
    if rc == RC_DONE:
        self.e.call.root = ring_pos(self, root)
        self.e.call.coll_kind = CHAIN_REDUCE
        self._begin_reduction(a, res, opc, dtc, kind, nd, <int64_t *>cnp.PyArray_DIMS(a),
                              COLL_REDUCE)
    return rc


cdef int msg_reduce_scatter(Engine self, array, out, op, int kind) except -2:
    """reduce_scatter: array of at least one dimension; out None or an ndarray of this rank's
    block (np.array_split's rows: block_lo), C-contiguous, writable, aligned, clear of array.
    Selection: the blocks algorithm's reduce-scatter, or the allreduce of the whole array into
    a scratch array whose block is copied out when the call ends."""
    cdef int opc, dtc, nd, q, r, P = self.e.nranks, me = self.e.rank
    cdef cnp.ndarray a, res, full, offs
    cdef uint64_t *o
    cdef uint64_t nbytes, row
    cdef int64_t n, rlo, rhi
    cdef cnp.npy_intp dims[MAX_NDIM]
    if type(array) is not _NDARRAY:
        return -1
    a = <cnp.ndarray>array
    nd = cnp.PyArray_NDIM(a)
    if nd < 1 or nd > MAX_NDIM or not _codes(a, op, &opc, &dtc):
        return -1
    nbytes = cnp.PyArray_NBYTES(a)
    n = cnp.PyArray_DIMS(a)[0]
    row = nbytes // n if n else 0
    rlo = block_lo(n, P, me)
    rhi = block_lo(n, P, me + 1)
    memcpy(dims, cnp.PyArray_DIMS(a), nd * sizeof(cnp.npy_intp))
    dims[0] = rhi - rlo
    got = _output(a, out, nd, dims, cnp.PyArray_TYPE(a), False)
    if got is None:
        return -1
    res = <cnp.ndarray>got
    self.result = res
    if n == 0 or select(self, COLL_REDUCE_SCATTER, nbytes) != ALG_RING:
        full = cnp.PyArray_EMPTY(nd, cnp.PyArray_DIMS(a), cnp.PyArray_TYPE(a), 0)
        rc = self.may_begin()
        if rc == RC_DONE:
            self._begin_reduction(a, full, opc, dtc, kind, nd, <int64_t *>cnp.PyArray_DIMS(a),
                                  COLL_ALLREDUCE)
            self.fin_ref = res            # (the block is copied out when the call ends)
            self.fin_from = <char *>cnp.PyArray_DATA(full) + rlo * row
            self.fin_to = <char *>cnp.PyArray_DATA(res)
            self.fin_n = (rhi - rlo) * row
        return rc
    offs = np.empty(2 * P, np.uint64)
    o = <uint64_t *>cnp.PyArray_DATA(offs)
    for q in range(P):
        r = self.e.dir.order[q]
        o[2 * q] = block_lo(n, P, r) * row
        o[2 * q + 1] = block_lo(n, P, r + 1) * row
    rc = self.may_begin()
    if rc == RC_DONE:
        self.offs_ref = offs
        self.e.call.offs = o
        self.e.call.root = 0
        self.e.call.coll_kind = CHAIN_REDUCE
        self._begin_reduction(a, res, opc, dtc, kind, nd, <int64_t *>cnp.PyArray_DIMS(a),
                              COLL_REDUCE_SCATTER)
    return rc


cdef inline int64_t block_lo(int64_t n, int64_t parts, int64_t j) noexcept nogil:
    """Where piece j of np.array_split(n items, parts) starts (j = parts: n): the first
    n % parts pieces hold one item more.  The C twin of calls.split_bounds."""
    return j * (n // parts) + (j if j < n % parts else n % parts)


cdef int msg_allgather(Engine self, array, out, int kind, uint64_t digest, dims,
                       offs) except -2:
    """allgather.  offs None: array a C-contiguous, aligned ndarray without Python objects; out
    None (a new array) or a writable C-contiguous, aligned ndarray of its dtype and of shape
    (P, *array.shape), which array is row `rank` of or is clear of, or DISCARD (the result is
    not wanted: a small gather away from its root; into the engine's own bytes, kept from
    call to call, the result None); the descriptor's shape is
    array.shape + (itemsize, digest).  offs given (allgather(axis=0), blocks of their own
    sizes): array this rank's bytes (uint8), out the whole result's bytes (uint8), offs the
    block bounds by ring position, dims the descriptor's shape.  Selection: inline (a bitwise
    or of out with zeros outside this rank's block), the blocks algorithm (this rank's block
    copied into its place when it starts), or the single copy (every rank writes its block
    into every out)."""
    cdef int P = self.e.nranks, me = self.e.rank, q, i, nd, rc
    cdef cnp.ndarray a = None, o
    cdef cnp.ndarray bounds = None
    cdef uint64_t block, nbytes, lo, hi
    cdef uint64_t *op
    cdef int64_t given[MAX_NDIM]
    cdef bint discard = out is _DISCARD
    if type(array) is not _NDARRAY or (out is not None and type(out) is not _NDARRAY
                                       and not discard):
        return -1
    a = <cnp.ndarray>array
    if (not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISALIGNED(a)
            or cnp.PyDataType_FLAGS(<cnp.dtype>cnp.PyArray_DESCR(a)) & 1):
        return -1
    if discard and offs is not None:
        return -1
    if offs is None:
        nd = cnp.PyArray_NDIM(a)
        if nd + 2 > MAX_NDIM:
            return -1
        block = cnp.PyArray_NBYTES(a)
        nbytes = block * P
        if discard:                       # (into the engine's own bytes, kept: no result)
            if self.ag_buf is None or <uint64_t>cnp.PyArray_NBYTES(self.ag_buf) < nbytes:
                self.ag_buf = np.empty(max(nbytes, <uint64_t>4096), np.uint8)
            out = None
            o = <cnp.ndarray>self.ag_buf
        elif out is None:
            out = empty_like(a, P)
        if not discard:
            o = <cnp.ndarray>out
        if not discard and (cnp.PyArray_NDIM(o) != nd + 1 or cnp.PyArray_DIMS(o)[0] != P
                or memcmp(cnp.PyArray_DIMS(o) + 1, cnp.PyArray_DIMS(a),
                          nd * sizeof(cnp.npy_intp)) != 0
                or not cnp.PyArray_IS_C_CONTIGUOUS(o) or not cnp.PyArray_ISALIGNED(o)
                or not cnp.PyArray_ISWRITEABLE(o)
                or not cnp.PyArray_EquivTypes(<cnp.dtype>cnp.PyArray_DESCR(a),
                                              <cnp.dtype>cnp.PyArray_DESCR(o))):
            return -1
        for i in range(nd):
            given[i] = cnp.PyArray_DIMS(a)[i]
        given[nd] = cnp.PyArray_ITEMSIZE(a)
        given[nd + 1] = digest
        nd += 2
        lo = <uint64_t>me * block
        hi = lo + block
        bounds = None                     # (made below, for the blocks algorithm only)
    else:
        o = out
        bounds = offs
        if (cnp.PyArray_TYPE(bounds) != cnp.NPY_UINT64 or cnp.PyArray_SIZE(bounds) != 2 * P
                or not cnp.PyArray_IS_C_CONTIGUOUS(bounds) or len(dims) > MAX_NDIM
                or not cnp.PyArray_IS_C_CONTIGUOUS(o) or not cnp.PyArray_ISWRITEABLE(o)):
            return -1
        op = <uint64_t *>cnp.PyArray_DATA(bounds)
        nd = len(dims)
        for i in range(nd):
            given[i] = dims[i]
        nbytes = cnp.PyArray_NBYTES(o)
        block = cnp.PyArray_NBYTES(a)
        lo = op[2 * self.e.dir.pos]
        hi = op[2 * self.e.dir.pos + 1]
    if hi - lo != block or hi > <uint64_t>cnp.PyArray_NBYTES(o):
        return -1
    cdef char *own = <char *>cnp.PyArray_DATA(o) + lo
    cdef const char *mine = <const char *>cnp.PyArray_DATA(a)
    if mine != own and block and _ranges_overlap(a, o):
        return -1                         # (the overlap rule: the caller copies the input)
    cdef int alg = ALG_INLINE if P == 1 else select(self, COLL_ALLGATHER, nbytes)
    self.result = out
    rc = self.may_begin()
    if rc != RC_DONE:
        return rc
    if alg != ALG_RING:                   # (inline; one rank: the allreduce, any size)
        if mine != own:
            memset(cnp.PyArray_DATA(o), 0, nbytes)
            memcpy(own, mine, block)
        else:                             # (in place: zeros around this rank's block)
            memset(cnp.PyArray_DATA(o), 0, lo)
            memset(own + block, 0, nbytes - hi)
        self.begin_call(o, o, <const char *>cnp.PyArray_DATA(o), <char *>cnp.PyArray_DATA(o),
                        nbytes, 1, OP_BOR, DT_U1, kind, nd, given, COLL_ALLREDUCE,
                        select(self, COLL_ALLREDUCE, nbytes) if nbytes else ALG_INLINE)
        return RC_DONE
    if bounds is None:                    # (equal blocks: rank r's at r * block)
        bounds = np.empty(2 * P, np.uint64)
        op = <uint64_t *>cnp.PyArray_DATA(bounds)
        for q in range(P):
            op[2 * q] = <uint64_t>self.e.dir.order[q] * block
            op[2 * q + 1] = op[2 * q] + block
    self.offs_ref = bounds
    self.e.call.offs = op
    self.e.call.root = 0
    self.begin_call(a, o, NULL if mine == own else mine, <char *>cnp.PyArray_DATA(o), nbytes, 1,
                    OP_BOR, DT_U1, kind, nd, given, COLL_ALLGATHER, ALG_RING)
    return RC_DONE


# ---- scan and exscan: one allgather of the inputs, the fold of the rows this rank needs ----

cdef int msg_error(Engine self, int kind, bytes text) except -2:
    """A call that tells the other ranks this rank raised a local error in its collective of
    descriptor kind `kind` (DESIGN section 6: an error only the root can see must not leave the
    others behind): its descriptor has op and dtype ERR_CODE, no data, and the error's text (at
    most ERROR_TEXT bytes) as its dims.  It differs from the descriptor of every rank that made
    the call, so every rank's call ends in MISMATCH (DONE where every rank said the same
    error)."""
    cdef int64_t dims[SHM_MAX_DIMS]
    cdef int rc = self.may_begin()
    if rc == RC_DONE:
        memset(dims, 0, sizeof(dims))
        memcpy(dims, <char *>text, min(len(text), <Py_ssize_t>sizeof(dims)))
        self.begin_call(None, None, NULL, NULL, 0, 1, ERR_CODE, ERR_CODE, kind, SHM_MAX_DIMS,
                        dims, COLL_ALLREDUCE, ALG_INLINE)
    return rc


cdef void write_desc(Engine self, uint64_t seq, uint64_t nbytes, int kind, int op, int dtype,
                     int ndim, int64_t *dims) noexcept:
    """This rank's call descriptor, in its rank block (read by others to explain a mismatch)
    and in the call state (stamped on every slot of the call)."""
    cdef shm_desc *d = &self.seg.block(self.e.rank).desc[seq & 1]
    cdef int i
    cdef int nkept = ndim if ndim < SHM_MAX_DIMS else SHM_MAX_DIMS
    cdef uint64_t h = 1469598103934665603ULL        # FNV-1a over all the dims
    for i in range(ndim):
        h = (h ^ <uint64_t>dims[i]) * 1099511628211ULL
    h = (h ^ <uint64_t>ndim) * 1099511628211ULL
    memset(d, 0, sizeof(shm_desc))
    d.head.seq = seq
    d.head.nbytes = nbytes
    d.head.shape = h
    d.head.kind = kind
    d.head.op = op
    d.head.dtype = dtype
    d.head.ndim = ndim
    for i in range(nkept):
        d.dims[i] = dims[i]
    self.e.call.desc = d.head


cdef int msg_alltoall(Engine self, array, out, int kind, uint64_t digest, dims,
                      offs) except -2:
    """alltoall, and every exchange of blocks between ranks (alg_exchange.pxi).
    offs None: equal blocks - array a C-contiguous, aligned ndarray without Python objects whose
    first dimension is the group's size (block q goes to rank q); out None (a new array) or a
    writable C-contiguous, aligned ndarray of its dtype and shape; the descriptor's shape is
    array.shape + (itemsize, digest).  offs given: the byte matrix B (P*P uint64, B[p*P + q]:
    bytes rank p sends rank q, the same on every rank), array this rank's sends back to back in
    destination order, out a writable C-contiguous ndarray for its receives back to back in
    source order, dims the descriptor's shape (the same on every rank).  array and out share no
    memory (an in-place call is copied first by the caller).  Selection: inline (one bitwise-or
    round of every rank's sends; the blocks are taken out at the end), the exchange, or the
    single copy when every rank's input lies in a shared array.  offs given without dims:
    alltoall(counts=), offs the counts (msg_alltoallv)."""
    cdef int P = self.e.nranks, me = self.e.rank, i, p, nd, rc, alg
    cdef cnp.ndarray a, o, bmat
    cdef uint64_t *bp
    cdef uint64_t total = 0, sent = 0, got = 0, row = 0, block
    cdef int64_t given[MAX_NDIM]
    if offs is not None and dims is None:
        return msg_alltoallv(self, array, out, kind, offs)
    if type(array) is not _NDARRAY or (out is not None and type(out) is not _NDARRAY):
        return -1
    a = <cnp.ndarray>array
    if (not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISALIGNED(a)
            or cnp.PyDataType_FLAGS(<cnp.dtype>cnp.PyArray_DESCR(a)) & 1):
        return -1
    if offs is None:
        nd = cnp.PyArray_NDIM(a)
        if nd < 1 or nd + 2 > MAX_NDIM or cnp.PyArray_DIMS(a)[0] != P:
            return -1
        if out is None:
            out = empty_like(a, -1)
        o = <cnp.ndarray>out
        if (cnp.PyArray_NDIM(o) != nd
                or memcmp(cnp.PyArray_DIMS(o), cnp.PyArray_DIMS(a), nd * sizeof(cnp.npy_intp))
                or not cnp.PyArray_IS_C_CONTIGUOUS(o) or not cnp.PyArray_ISALIGNED(o)
                or not cnp.PyArray_ISWRITEABLE(o)
                or not cnp.PyArray_EquivTypes(<cnp.dtype>cnp.PyArray_DESCR(a),
                                              <cnp.dtype>cnp.PyArray_DESCR(o))):
            return -1
        block = cnp.PyArray_NBYTES(a) // P
        if self.x_B is None or self.x_block != block:     # (kept: the same blocks next call)
            self.x_B = np.full(P * P, block, np.uint64)
            self.x_block = block
        bmat = <cnp.ndarray>self.x_B
        for i in range(nd):
            given[i] = cnp.PyArray_DIMS(a)[i]
        given[nd] = cnp.PyArray_ITEMSIZE(a)
        given[nd + 1] = digest
        nd += 2
    else:
        if (type(offs) is not _NDARRAY or out is None or type(dims) is not list
                or len(dims) > MAX_NDIM):
            return -1
        bmat = <cnp.ndarray>offs
        o = <cnp.ndarray>out
        if (cnp.PyArray_TYPE(bmat) != cnp.NPY_UINT64 or cnp.PyArray_SIZE(bmat) != P * P
                or not cnp.PyArray_IS_C_CONTIGUOUS(bmat) or not cnp.PyArray_IS_C_CONTIGUOUS(o)
                or not cnp.PyArray_ISWRITEABLE(o)):
            return -1
        nd = len(dims)
        for i in range(nd):
            given[i] = dims[i]
    bp = <uint64_t *>cnp.PyArray_DATA(bmat)
    for p in range(P):
        for i in range(P):
            total += bp[p * P + i]
            if p == me:
                sent += bp[p * P + i]
            if i == me:
                got += bp[p * P + i]
    if sent != <uint64_t>cnp.PyArray_NBYTES(a) or got != <uint64_t>cnp.PyArray_NBYTES(o):
        return -1
    if sent and got and _ranges_overlap(a, o):
        return -1                         # (the caller copies the input first)
    alg = ALG_INLINE if P == 1 else select(self, COLL_ALLTOALL, total)
    self.result = o
    rc = self.may_begin()
    if rc != RC_DONE:
        return rc
    self.offs_ref = bmat
    self.e.x.m = xchg_tables(&self.e, bp)
    if alg == ALG_INLINE:                 # every rank's sends in one bitwise-or round
        if self.x_buf is None or <uint64_t>cnp.PyArray_NBYTES(self.x_buf) < total:
            self.x_buf = np.empty(max(total, <uint64_t>4096), np.uint8)   # (kept: reused)
        full = self.x_buf
        for p in range(me):
            for i in range(P):
                row += bp[p * P + i]
        memset(cnp.PyArray_DATA(full), 0, total)
        if sent:
            memcpy(<char *>cnp.PyArray_DATA(full) + row, cnp.PyArray_DATA(a), sent)
        self.x_full = full
        self.x_out = o
        self.begin_call(full, full, <const char *>cnp.PyArray_DATA(full),
                        <char *>cnp.PyArray_DATA(full), total, 1, OP_BOR, DT_U1, kind, nd, given,
                        COLL_ALLREDUCE, ALG_INLINE)
        return RC_DONE
    self.x_src_n = sent
    self.begin_call(a, o, <const char *>cnp.PyArray_DATA(a) if sent else NULL,
                    <char *>cnp.PyArray_DATA(o) if got else NULL, total, 1, OP_BOR, DT_U1, kind,
                    nd, given, COLL_ALLTOALL, ALG_RING)
    return RC_DONE


# ---- alltoall(counts=): one call, the counts in its first round (alg_exchange.pxi) ----

from cpython.long cimport PyLong_AsLongLongAndOverflow
