# alltoall(counts=)'s call (Engine.call with ALLTOALL and counts): its first round carries
# every rank's counts (and the data when it fits the round's room), the byte matrix B is formed
# from the rows, and the exchange runs in the same call (xv_handover).  Included by _engine.pyx
# after msg.pxi.

def counts_in_round(Engine eng):
    """Can this group's alltoall(counts=) send its counts in the call's first round (its rows
    fit one chunk of channel 0: up to about 22 ranks at the default small_bytes)?  Else the
    caller sends them in a round of their own first (collectives.py)."""
    return xv_head(eng.e.nranks) <= eng.e.chans[0].payload


cdef int msg_alltoallv(Engine self, array, out, int kind, counts) except -2:
    """alltoall(counts=): array a C-contiguous, aligned ndarray without Python objects, of at
    least one dimension; counts a list or tuple of P ints >= 0 (or a 1-D int64, int32 or
    uint64 ndarray) that sum to array.shape[0]; out None or a writable C-contiguous, aligned
    ndarray of its dtype and dimensions after the first, clear of array, whose length the round
    checks (every rank's, on every rank).  The call's first round carries every rank's counts,
    claim and out= length, and its data when every rank's fits the room; xv_handover reads it
    (msg.pxi).  The descriptor: (the round's bytes,), kind as given (KIND_COUNTS + KIND_ROOT_STEP
    x KIND_ALLTOALL)."""
    cdef int P = self.e.nranks, me = self.e.rank, nd, i, rc
    cdef cnp.ndarray a, o, f, c
    cdef uint64_t head = xv_head(P), room, n0, total = 0, row, sent, v
    cdef uint64_t *w
    cdef int64_t dims[1]
    cdef long long iv
    cdef int overflow
    cdef cnp.npy_intp nbytes
    if type(array) is not _NDARRAY or head > self.e.chans[0].payload:
        return -1
    a = <cnp.ndarray>array
    nd = cnp.PyArray_NDIM(a)
    if (nd < 1 or not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISALIGNED(a)
            or cnp.PyDataType_FLAGS(<cnp.dtype>cnp.PyArray_DESCR(a)) & 1):
        return -1
    if out is not None:
        if type(out) is not _NDARRAY:
            return -1
        o = <cnp.ndarray>out
        if (cnp.PyArray_NDIM(o) != nd
                or memcmp(cnp.PyArray_DIMS(o) + 1, cnp.PyArray_DIMS(a) + 1,
                          (nd - 1) * sizeof(cnp.npy_intp))
                or not cnp.PyArray_IS_C_CONTIGUOUS(o) or not cnp.PyArray_ISALIGNED(o)
                or not cnp.PyArray_ISWRITEABLE(o)
                or not cnp.PyArray_EquivTypes(<cnp.dtype>cnp.PyArray_DESCR(a),
                                              <cnp.dtype>cnp.PyArray_DESCR(o))
                or (cnp.PyArray_NBYTES(a) and cnp.PyArray_NBYTES(o) and _ranges_overlap(a, o))):
            return -1
    row = cnp.PyArray_ITEMSIZE(a)
    for i in range(1, nd):
        row *= cnp.PyArray_DIMS(a)[i]
    n0 = cnp.PyArray_DIMS(a)[0]
    if not self.xv.ready:                 # (the group's first: every rank starts alike)
        self.xv.room = xv_next_room(0, xv_cap(self.e.chans[0].payload,
                                              self.sel_limit[COLL_ALLTOALL], P))
        self.xv.ready = 1
    room = self.xv.room
    nbytes = head + <uint64_t>P * room
    f = self.xv_buf
    if f is not None and cnp.PyArray_SIZE(f) == nbytes:
        memset(cnp.PyArray_DATA(f), 0, nbytes)
    else:
        f = cnp.PyArray_ZEROS(1, &nbytes, cnp.NPY_UINT8, 0)
    w = <uint64_t *>cnp.PyArray_DATA(f) + me * (P + 2)
    if type(counts) is list or type(counts) is tuple:
        if len(counts) != P:
            return -1
        for i in range(P):
            x = counts[i]
            if type(x) is not int:
                return -1
            iv = PyLong_AsLongLongAndOverflow(x, &overflow)
            if overflow or iv < 0 or <uint64_t>iv > n0:
                return -1
            w[2 + i] = <uint64_t>iv
            total += w[2 + i]
    elif type(counts) is _NDARRAY:
        c = <cnp.ndarray>counts
        if (cnp.PyArray_NDIM(c) != 1 or cnp.PyArray_DIMS(c)[0] != P
                or not cnp.PyArray_IS_C_CONTIGUOUS(c) or not cnp.PyArray_ISNOTSWAPPED(c)):
            return -1
        for i in range(P):
            if cnp.PyArray_TYPE(c) == cnp.NPY_INT64:
                if (<int64_t *>cnp.PyArray_DATA(c))[i] < 0:
                    return -1
                v = <uint64_t>(<int64_t *>cnp.PyArray_DATA(c))[i]
            elif cnp.PyArray_TYPE(c) == cnp.NPY_INT32:
                if (<int32_t *>cnp.PyArray_DATA(c))[i] < 0:
                    return -1
                v = <uint64_t>(<int32_t *>cnp.PyArray_DATA(c))[i]
            elif cnp.PyArray_TYPE(c) == cnp.NPY_UINT64:
                v = (<uint64_t *>cnp.PyArray_DATA(c))[i]
            else:
                return -1
            if v > n0:
                return -1
            w[2 + i] = v
            total += v
    else:
        return -1
    if total != n0:
        return -1                         # (the parse says what is wrong)
    w[0] = _claim_c(_key(<object>cnp.PyArray_DESCR(a))[0], nd - 1,
                    <const int64_t *>cnp.PyArray_DIMS(a) + 1)
    w[1] = 0 if out is None else <uint64_t>cnp.PyArray_DIMS(o)[0] + 1
    sent = total * row
    if sent and sent <= room:
        memcpy(<char *>cnp.PyArray_DATA(f) + head + me * room, cnp.PyArray_DATA(a), sent)
    rc = self.may_begin()
    if rc != RC_DONE:
        return rc
    self.xv_buf = f                       # (the next round's, once this call is over)
    dims[0] = nbytes
    self.begin_call(f, f, <const char *>cnp.PyArray_DATA(f), <char *>cnp.PyArray_DATA(f),
                    nbytes, 1, OP_BOR, DT_U1, kind, 1, dims, COLL_ALLREDUCE, ALG_INLINE)
    place(self, self.cur_seq, <const char *>cnp.PyArray_DATA(a), <char *>cnp.PyArray_DATA(a),
          sent, True)                     # (the single copy reads every rank's input)
    cma_offer(self, self.cur_seq, <const char *>cnp.PyArray_DATA(a) if sent else NULL, True)
    self.xv.pending = 1                   # (cross-memory attach: decided from B after the
                                          # round, in xv_handover)
    self.xv.row = row
    self.xv.used_room = room
    self.xv_a = a
    self.xv_out = out
    return RC_DONE


cdef object rows_like(cnp.ndarray a, cnp.npy_intp n):
    """A new C-contiguous array of a's dtype and dimensions after the first, of n rows: made in
    C for numpy's plain numeric types, by np.empty for any other dtype."""
    cdef int nd = cnp.PyArray_NDIM(a), num = cnp.PyArray_TYPE(a)
    cdef cnp.npy_intp dims[MAX_NDIM]
    memcpy(dims, cnp.PyArray_DIMS(a), nd * sizeof(cnp.npy_intp))
    dims[0] = n
    if (num < cnp.NPY_OBJECT or num == cnp.NPY_FLOAT16) and cnp.PyArray_ISNOTSWAPPED(a):
        return cnp.PyArray_EMPTY(nd, dims, num, 0)
    return np.empty((n,) + tuple((<object>a).shape[1:]), a.dtype)


cdef int xv_handover(Engine self) except -1:
    """alltoall(counts=) after its first round (msg_alltoallv): every rank reads the same
    round.  A claim or an out= that disagrees: the call ends, its result ("mismatch", the
    round) for the caller to say (collectives.py, every rank alike).  Else B from the counts,
    this rank's output (out=, or made here), and the data: taken out of the round when every
    rank's came in it, else the exchange (or the single copy) on B in the same call.  The
    room of the next round follows (every rank agrees)."""
    cdef int P = self.e.nranks, me = self.e.rank, ch, alg, rc, p
    cdef cnp.ndarray f = self.xv_buf, a = self.xv_a, o, bm
    cdef const uint64_t *rows = <const uint64_t *>cnp.PyArray_DATA(f)
    cdef uint64_t head = xv_head(P), most, total = 0, n = 0
    cdef uint64_t *B
    self.xv.pending = 0
    if not xv_agreed(rows, P):
        self.result = ("mismatch", f.copy())
        return RC_DONE
    bm = self.xv_B
    if bm is None:
        bm = self.xv_B = np.empty(P * P, np.uint64)
    B = <uint64_t *>cnp.PyArray_DATA(bm)
    most = xv_matrix(rows, P, self.xv.row, B)
    self.xv.room = xv_next_room(most, xv_cap(self.e.chans[0].payload,
                                             self.sel_limit[COLL_ALLTOALL], P))
    for p in range(P):
        n += rows[p * (P + 2) + 2 + me]
        total += B[p * P + me]
    out = self.xv_out
    if out is None:
        out = self.xv_out = rows_like(a, n)
    o = <cnp.ndarray>out
    self.result = out
    self.offs_ref = bm
    self.e.x.m = xchg_tables(&self.e, B)
    if P == 1 or most <= self.xv.used_room:     # (the data came in the round)
        xv_inline_finish(&self.e, <const char *>rows + head, self.xv.used_room,
                         <const char *>cnp.PyArray_DATA(a), <char *>cnp.PyArray_DATA(o))
        return RC_DONE
    total = 0
    for p in range(P * P):
        total += B[p]
    self.coll = COLL_ALLTOALL
    self.phase = 1
    self.msg_nbytes = total
    self.src_p = <const char *>cnp.PyArray_DATA(a) if cnp.PyArray_NBYTES(a) else NULL
    self.dst_p = <char *>cnp.PyArray_DATA(o) if cnp.PyArray_NBYTES(o) else NULL
    self.direct = direct_agreed(self)
    self.e.dir.mode = COLL_ALLTOALL
    self.e.dir.pairwise = 0
    self.e.nt = not self.direct and self.nt_bytes > 0 and total >= self.nt_bytes
    self.cma = not self.direct and cma_big(self, B) and cma_agreed(self)
    alg = self._phase1(&ch)
    self._start_phase(ch, alg, self.src_p, self.dst_p, total)
    with nogil:
        rc = drive(&self.e, self._alg())
        if rc != RC_STALLED and self.e.nt:
            shm_store_fence()
    return rc
