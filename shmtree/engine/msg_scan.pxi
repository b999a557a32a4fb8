# scan and exscan's call (Engine.call with SCAN / EXSCAN): the C parse, the rule of the small
# path (scan_gathers) and the fold's entry for the transpose scheme; the fold itself is
# engine/scan.pxi.  Included by _engine.pyx after msg.pxi (the parser of the other calls).

cdef enum:
    SCAN_GATHER_LIMIT = 256 << 10   # scan_gathers: up to this many bytes in all (P x the input)
    SCAN_MAX_NDIM = 32              # a deeper input's descriptor carries its size, not its shape
SCAN_GATHER_BYTES = SCAN_GATHER_LIMIT


cdef inline bint _scan_gathers(uint64_t nbytes, uint64_t P, uint64_t small_bytes) noexcept:
    cdef uint64_t whole = nbytes * P
    return P == 1 or whole <= small_bytes or whole <= SCAN_GATHER_LIMIT


def scan_gathers(uint64_t nbytes, uint64_t P, uint64_t small_bytes):
    """Does a scan or exscan of nbytes per rank run as one allgather of the inputs, each rank
    folding the rows it needs (Engine.call's SCAN, EXSCAN; else the transpose scheme of two
    exchanges, Executors._scan)?  Up to SCAN_GATHER_BYTES in all (P x nbytes), or small_bytes
    where that is more: one round against two, and the P - 1 rows a rank receives cost less
    than the second round until then (beyond, the transpose scheme's 2(P-1)/P of the message
    per rank wins, P = 2 included: 2 MiB at P = 2, 0.29 ms against 0.42).  In a group of one,
    any size (the call is the copy, or exscan's identity: no round).  The one rule: the engine
    declines a larger scan with it, and the parsed call asks it."""
    return _scan_gathers(nbytes, P, small_bytes)


cdef uint64_t _scan_chain_from(Engine self) noexcept:
    """The least bytes per rank of a scan's chain here (_scan_chains), 0 where it never runs."""
    cdef int P = self.e.nranks, ch = self._ring_channel(), q
    if P < 2 or ch < 0:
        return 0
    for q in range(P):
        if self.e.dir.order[q] != q:
            return 0
    return <uint64_t>(P - 1) * self.e.chans[ch].payload


cdef bint _scan_chains(Engine self, uint64_t nbytes) noexcept:
    """Does a scan or exscan of nbytes per rank (past scan_gathers) run as the reduce's chain
    (alg_chain.pxi: CHAIN_SCAN, CHAIN_EXSCAN)?  When the ring order is the rank order (the
    chain's neighbours are ranks r - 1 and r + 1) and the message fills at least P - 1 chunks
    of the ring channel: then the chain's (m + P - 2) chunk steps, in which every rank receives
    and sends the message once (the least a scan can move), beat the transpose scheme's two
    exchanges of 2(P-1)/P of it each (Executors._scan).  The same answer on every rank (the
    plan's order and payload)."""
    cdef uint64_t least = _scan_chain_from(self)
    return least != 0 and nbytes >= least


cdef bint _scan_pairs(Engine self, uint64_t nbytes) noexcept:
    """Does an exscan of nbytes per rank run as the pair's exchange (_scan_pair_begin)?  Two
    ranks, past the inline round's size (P x nbytes over small_bytes): rank 1's result is
    rank 0's input, one message, where the allgather would move both inputs both ways."""
    return self.e.nranks == 2 and nbytes * 2 > self.sel_limit[COLL_ALLGATHER]


cdef bint _scan_takes(Engine self, uint64_t nbytes, bint exclusive) noexcept:
    """Engine.scan_takes."""
    return ((exclusive and _scan_pairs(self, nbytes))
            or _scan_gathers(nbytes, self.e.nranks, self.sel_limit[COLL_ALLGATHER])
            or _scan_chains(self, nbytes))


cdef int msg_scan(Engine self, array, out, op, int kind, bint exclusive,
                  uint64_t digest) except -2:
    """scan (exclusive False) and exscan: array a plain C-contiguous aligned ndarray whose
    dtype and op have a kernel (op a name or ufunc, or the parse's (op code, dtype code)); out
    None (a new array) or an ndarray of its type and shape, C-contiguous, writable, aligned
    (it may be the input or overlap it: the input is read when the call begins, the output
    written when it ends); digest: the dtype's (calls.dtype_digest).  The call is an allgather
    of every rank's input into the engine's own stack (engine bytes, kept from call to call),
    with the descriptor of the parsed path's (Executors._scan: the input's shape - its size
    past SCAN_MAX_NDIM dimensions - then op code, item size, digest; kind KIND_SCAN or
    KIND_EXSCAN), so a rank on either path meets the others in one call; when it ends, rows
    0 .. rank (exscan: 0 .. rank - 1) are folded into the output (engine/scan.pxi).  In a
    group of one the call is whole at once (Engine.alone).  Past scan_gathers, the reduce's
    chain in rank order where _scan_chains says so (_scan_chain_begin); else declined (-1):
    the transpose scheme (Executors._scan) takes it."""
    cdef int P = self.e.nranks, me = self.e.rank, opc, dtc, nd, i, rc, q, alg
    cdef cnp.ndarray a, res, stack, bounds
    cdef uint64_t block, total
    cdef uint64_t *bp
    cdef int64_t given[SCAN_MAX_NDIM + 3]
    cdef char *base
    cdef bint chain, pair
    if type(array) is not _NDARRAY:
        return -1
    a = <cnp.ndarray>array
    if not _codes(a, op, &opc, &dtc) or not fold_supported(opc, dtc):
        return -1
    block = cnp.PyArray_NBYTES(a)
    chain = False
    pair = exclusive and _scan_pairs(self, block)
    if not pair and not _scan_gathers(block, P, self.sel_limit[COLL_ALLGATHER]):
        if not _scan_chains(self, block):
            return -1
        chain = True
    nd = cnp.PyArray_NDIM(a)
    if out is None:
        res = <cnp.ndarray>empty_like(a, -1)
    else:
        if type(out) is not _NDARRAY:
            return -1
        res = <cnp.ndarray>out
        if (cnp.PyArray_TYPE(res) != cnp.PyArray_TYPE(a) or cnp.PyArray_NDIM(res) != nd
                or memcmp(cnp.PyArray_DIMS(res), cnp.PyArray_DIMS(a),
                          nd * sizeof(cnp.npy_intp)) != 0
                or not cnp.PyArray_IS_C_CONTIGUOUS(res) or not cnp.PyArray_ISWRITEABLE(res)
                or not cnp.PyArray_ISALIGNED(res)
                or cnp.PyArray_ISNOTSWAPPED(res) != cnp.PyArray_ISNOTSWAPPED(a)):
            return -1
    if P == 1:                            # (one rank: the copy, or exscan's identity; no round)
        self.result = res
        rc = self.may_begin()
        if rc != RC_DONE:
            return rc
        if exclusive:
            fold_identity(opc, dtc, <char *>cnp.PyArray_DATA(res), cnp.PyArray_SIZE(a))
        elif block and cnp.PyArray_DATA(res) != cnp.PyArray_DATA(a):
            memmove(cnp.PyArray_DATA(res), cnp.PyArray_DATA(a), block)
        return self.alone(res, res)
    if nd > SCAN_MAX_NDIM:
        given[0] = cnp.PyArray_SIZE(a)
        nd = 1
    else:
        for i in range(nd):
            given[i] = cnp.PyArray_DIMS(a)[i]
    given[nd] = opc
    given[nd + 1] = cnp.PyArray_ITEMSIZE(a)
    given[nd + 2] = <int64_t>digest
    nd += 3
    if pair:
        return _scan_pair_begin(self, a, res, opc, dtc, kind, nd, given)
    if chain:
        return _scan_chain_begin(self, a, res, opc, dtc, kind, exclusive, nd, given)
    total = block * P
    alg = select(self, COLL_ALLGATHER, total)
    # (what the call uses is made before it begins: an allocation may let another thread in)
    if self.scan_stack is None or <uint64_t>cnp.PyArray_NBYTES(self.scan_stack) < total:
        self.scan_stack = np.empty(max(total, <uint64_t>4096), np.uint8)
    stack = <cnp.ndarray>self.scan_stack
    if alg == ALG_RING and (self.scan_bounds is None or self.scan_bounds_block != block):
        bounds = np.empty(2 * P, np.uint64)       # (equal blocks: rank r's at r * block)
        bp = <uint64_t *>cnp.PyArray_DATA(bounds)
        for q in range(P):
            bp[2 * q] = <uint64_t>self.e.dir.order[q] * block
            bp[2 * q + 1] = bp[2 * q] + block
        self.scan_bounds = bounds
        self.scan_bounds_block = block
    self.result = res
    rc = self.may_begin()
    if rc != RC_DONE:
        return rc
    base = <char *>cnp.PyArray_DATA(stack)
    memcpy(base + me * block, cnp.PyArray_DATA(a), block)   # (the input is read here only)
    if alg != ALG_RING:                   # (inline, or the allreduce of the zero-padded stack)
        memset(base, 0, me * block)
        memset(base + (me + 1) * block, 0, total - (me + 1) * block)
        self.begin_call(stack, stack, base, base, total, 1, OP_BOR, DT_U1, kind, nd, given,
                        COLL_ALLREDUCE,
                        select(self, COLL_ALLREDUCE, total) if total else ALG_INLINE)
    else:                                 # (the blocks algorithm, this rank's block in place)
        self.offs_ref = self.scan_bounds
        self.e.call.offs = <uint64_t *>cnp.PyArray_DATA(<cnp.ndarray>self.scan_bounds)
        self.e.call.root = 0
        self.begin_call(stack, stack, NULL, base, total, 1, OP_BOR, DT_U1, kind, nd, given,
                        COLL_ALLGATHER, ALG_RING)
    self.scan_out = res
    self.scan.rows = base
    self.scan.out = <char *>cnp.PyArray_DATA(res)
    self.scan.stride = block
    self.scan.n = cnp.PyArray_SIZE(a)
    self.scan.upto = me if exclusive else me + 1
    self.scan.op = opc
    self.scan.dtype = dtc
    return RC_DONE


cdef int _scan_chain_begin(Engine self, cnp.ndarray a, cnp.ndarray res, int opc, int dtc,
                           int kind, bint exclusive, int nd, int64_t *given) except -2:
    """msg_scan's chain (_scan_chains): the reduce's chain from rank 0 to rank P - 1, each
    rank keeping its prefix (alg_chain.pxi).  Each chunk of the output is written as its
    chunk of the input is read, so an output that overlaps the input (other than being it,
    for a scan) reads a copy of the input; exscan's rank 0 holds the op's identity from the
    start.  No single copy (the shared arrays' path is an allreduce's: begin_call)."""
    cdef uint64_t block = cnp.PyArray_NBYTES(a)
    cdef int rc
    src = a
    if block and _ranges_overlap(a, res) and (exclusive or
                                               cnp.PyArray_DATA(a) != cnp.PyArray_DATA(res)):
        src = np.array(a, copy=True, order="C")
    self.result = res
    rc = self.may_begin()
    if rc != RC_DONE:
        return rc
    if exclusive and self.e.rank == 0:
        fold_identity(opc, dtc, <char *>cnp.PyArray_DATA(res), cnp.PyArray_SIZE(a))
    self.e.call.root = self.e.nranks - 1
    self.e.call.coll_kind = CHAIN_EXSCAN if exclusive else CHAIN_SCAN
    self.begin_call(src, res, <const char *>cnp.PyArray_DATA(<cnp.ndarray>src),
                    <char *>cnp.PyArray_DATA(res), block, cnp.PyArray_ITEMSIZE(a), opc, dtc,
                    kind, nd, given, COLL_REDUCE, ALG_RING)
    return RC_DONE


cdef int _scan_pair_begin(Engine self, cnp.ndarray a, cnp.ndarray res, int opc, int dtc,
                          int kind, int nd, int64_t *given) except -2:
    """msg_scan's exscan of two ranks past the inline round (_scan_pairs: the sizes alone
    decide, the same answer on both ranks): rank 1's result is rank 0's input, so rank 1
    receives it whole by the exchange (alg_exchange.pxi: inline, or through the outboxes;
    cross-memory attach from the single copy's sizes where both ranks' probes said yes,
    alg_cma.pxi: one copy, as MPI's) into its output; rank 0's is the op's identity.
    (Measured, P = 2, 16 MiB, on a loaded VM: 1.7 ms against the chain's 4.1; a scan the
    same way, its fold a pass of its own after the copy, took 4.9 against the chain's 3.8,
    so a scan keeps the chain.)  An input its own output overlaps is read from a copy (rank
    0's is read by rank 1 during the call)."""
    cdef uint64_t block = cnp.PyArray_NBYTES(a)
    cdef int me = self.e.rank, rc, i
    cdef cnp.ndarray B, src = a
    if me == 0 and _ranges_overlap(a, res):
        src = np.array(a, copy=True, order="C")
    B = np.zeros(4, np.uint64)
    B[1] = block                          # (B[p * 2 + q]: bytes from rank p to rank q)
    nothing = np.empty(0, np.uint8)
    dims = [given[i] for i in range(nd)]
    if me == 0:
        rc = msg_alltoall(self, src, nothing, kind, 0, dims, B)
    else:
        rc = msg_alltoall(self, nothing, res, kind, 0, dims, B)
    if rc != RC_DONE:
        return rc
    self.result = res
    if me == 0:
        self.scan_out = res               # (held to the end)
        fold_identity(opc, dtc, <char *>cnp.PyArray_DATA(res), cnp.PyArray_SIZE(a))
    return RC_DONE


def fold(rows, int opc, out, bint exclusive=False):
    """The prefixes of rows (axis 0) in rank order into out (engine/scan.pxi, numpy's
    accumulate bit for bit): inclusive (out[r] = rows[0] op ... op rows[r]; out may be rows
    itself) or exclusive (out[0] the op's identity, out[r] = rows[0] op ... op rows[r - 1]).
    rows and out: C-contiguous, aligned arrays of at least one dimension, of one dtype with a
    kernel for op (op code opc), of the same shape; out writable and, unless it is rows, clear
    of it.  The transpose scheme's fold (Executors._scan, nodes.py); returns out."""
    cdef cnp.ndarray r = rows, o = out
    cdef int dtc = _kernels.dtype_code(r.dtype)
    cdef int m
    cdef int64_t n
    cdef uint64_t stride
    if (cnp.PyArray_NDIM(r) < 1 or cnp.PyArray_NDIM(o) != cnp.PyArray_NDIM(r)
            or memcmp(cnp.PyArray_DIMS(o), cnp.PyArray_DIMS(r),
                      cnp.PyArray_NDIM(r) * sizeof(cnp.npy_intp)) != 0
            or not cnp.PyArray_EquivTypes(<cnp.dtype>cnp.PyArray_DESCR(r),
                                          <cnp.dtype>cnp.PyArray_DESCR(o))
            or not cnp.PyArray_IS_C_CONTIGUOUS(r) or not cnp.PyArray_IS_C_CONTIGUOUS(o)
            or not cnp.PyArray_ISALIGNED(r) or not cnp.PyArray_ISALIGNED(o)
            or not cnp.PyArray_ISWRITEABLE(o)):
        raise ValueError("shmtree: fold: rows and out must be C-contiguous aligned arrays of "
                         "one shape and dtype, out writable")
    if not fold_supported(opc, dtc):
        raise TypeError(f"shmtree: fold: no kernel for op {opc} and dtype {r.dtype}")
    if o is not r and cnp.PyArray_NBYTES(o) and _ranges_overlap(r, o):
        raise ValueError("shmtree: fold: out overlaps rows without being them")
    if exclusive and o is r and r.shape[0] > 1:
        raise ValueError("shmtree: fold: an exclusive fold cannot run in place")
    m = cnp.PyArray_DIMS(r)[0]
    n = cnp.PyArray_SIZE(r) // m if m else 0
    stride = n * cnp.PyArray_ITEMSIZE(r)
    with nogil:
        fold_rows(opc, dtc, <const char *>cnp.PyArray_DATA(r), stride, m,
                  <char *>cnp.PyArray_DATA(o), stride, n, exclusive)
    return o
