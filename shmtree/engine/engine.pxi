# (included by shmtree/_engine.pyx) The engine: one per group and thread of calls.  It owns the
# call in progress (Call, Chan: types.pxi) and drives the algorithms (alg_*.pxi) through drive();
# the collectives' first rounds (msg*.pxi, bcast.pxi, scatter.pxi) are module functions of
# their own files that take the Engine.

cdef class Engine:
    """One rank's state: its channels (the rings of its tree edges) and the call in progress."""
    cdef Segment seg
    cdef Eng e                        # all the nogil code sees (types.pxi)
    cdef int nchan
    cdef int busy
    # the call in progress (call): what both phases read, and what it holds until it ends here
    cdef object src_ref, dst_ref, offs_ref, fin_ref
    cdef object result                # the output, for the caller (call, take_result)
    cdef const char *src_p
    cdef char *dst_p
    cdef char *fin_from               # copied to fin_to (fin_n bytes) when the call ends
    cdef char *fin_to
    cdef uint64_t fin_n
    cdef uint64_t msg_nbytes
    cdef int msg_itemsize, msg_op, msg_dtype, phase, coll, alg
    cdef uint64_t ncalls
    cdef uint64_t next_seq            # seq of the next call (the engine numbers the calls)
    cdef uint64_t cur_seq             # seq of the call begun last
    cdef unsigned long owner          # the thread that began the call in progress
    cdef public uint64_t nt_bytes     # messages of at least this size write their output with
                                      # streaming stores (e.nt: for the call in progress)
    cdef int64_t slice_ns             # a call's time slice (the caller's checks come between)
    # the selection (Plan.selection, given once): by collective, the largest message that
    # travels inline, and the algorithm of a larger one
    cdef uint64_t sel_limit[N_COLL]
    cdef int sel_alg[N_COLL]
    # shared arrays (shared.py registers them): per allocation its id, this rank's own stretch
    # [start, start + nbytes) and every rank's mapping of it
    cdef uint64_t *share_id
    cdef uint64_t *share_start
    cdef uint64_t *share_len
    cdef char **share_bases           # [nshares * nranks]
    cdef int nshares, share_cap
    cdef list share_keep              # [nshares]: what holds the peers' mappings (shared.py's)
    cdef object place_keep, place_keep_out    # those of the allocations (input, output) the
                                      # call in progress may use single-copy: its raw pointers
                                      # (Direct.ins, outs) stay valid until the call has ended
                                      # here, whatever another thread unshares or drops
                                      # meanwhile (Communicator.close, an array's finalizer,
                                      # interpreter exit)
    cdef int direct                   # the call in progress runs ALG_DIRECT in phase 1
    cdef int cma                      # ... or ALG_CMA (alg_cma.pxi)
    cdef public uint64_t cma_bytes    # a call offers ALG_CMA when its largest block is this
    cdef public uint64_t cma_total    # large and its bytes in all this many (alg_cma.pxi:
                                      # CMA_BYTES, CMA_TOTAL)
    cdef Bcast bc                     # a broadcast's call (engine/bcast.pxi)
    cdef object bc_buf                # the last first round (reused by the next)
    cdef object bc_result, bc_out     # its output (given before the round, or made after it)
                                      # and the caller's out=
    cdef object x_full, x_out         # an exchange that travels inline: every rank's blocks,
                                      # and its output (filled from them when the call ends:
                                      # xchg_inline_finish)
    cdef uint64_t x_src_n             # an exchange's input bytes (place: the single copy)
    cdef object x_B, x_buf            # alltoall's byte matrix of equal blocks (x_block each)
    cdef uint64_t x_block             # and its inline round's bytes, kept for the next call
    cdef object ag_buf                # an allgather's output that nobody wants (DISCARD), kept
    cdef Xv xv                        # alltoall(counts=): its first round carries the counts
    cdef object xv_buf, xv_a, xv_out, xv_B    # (engine/msg.pxi, msg_alltoallv): the round
                                      # (reused), the input, the output, the byte matrix B
    cdef ScanFold scan                # a scan's fold, run when the call ends (msg_scan)
    cdef object scan_out              # its output (held to the end)
    cdef object scan_stack            # the scans' stack of every rank's row (uint8), kept from
                                      # call to call (no fresh pages each call)
    cdef object scan_bounds           # their blocks by ring position (the blocks algorithm),
    cdef uint64_t scan_bounds_block   # for blocks of this many bytes
    # a scatter's call (engine/scatter.pxi): its mode (0: the call is no scatter), root, the
    # root's array, this rank's output (None: made once the round has said its shape), the
    # byte matrix of its exchange
    cdef int sc_mode, sc_root
    cdef object sc_src, sc_out, sc_B
    cdef const char *sc_src_p
    cdef char *sc_dst_p
    cdef uint64_t *sc_Bp

    def __cinit__(self):
        memset(&self.e, 0, sizeof(Eng))
        memset(&self.bc, 0, sizeof(Bcast))
        memset(&self.xv, 0, sizeof(Xv))
        self.bc.root = -1
        self.bc.room = 64
        self.scan.upto = -1
        self.share_keep = []

    def __init__(self, Segment seg, int rank, list channels, dict selection, int64_t spin_ns=20000,
                 int64_t yield_ns=200000, int64_t sleep_ns=20000000, uint64_t nt_bytes=0,
                 int64_t slice_ns=20000000, exchange=None):
        """channels: per channel a transport.ChannelSpec (parent, index, children, up, down,
        child_up, parent_down: segment offsets, -1 for none; nslots, stride, payload; ring,
        ring_pos).  selection: Plan.selection(), by collective (inline limit, algorithm).
        exchange: transport.Layout.exchange_spec() (the outboxes; None in a group of one)."""
        self.seg = seg
        self.e.base = seg.base
        self.e.rank = rank
        self.e.nranks = seg.nranks
        self.nchan = len(channels)
        if self.nchan < 1 or self.nchan > 3:
            raise ValueError("shmtree: an engine has one to three channels")
        self.e.abort_word = &seg.hdr().abort_reason
        self.e.spin_ns = spin_ns
        self.e.yield_ns = yield_ns
        self.e.sleep_ns = sleep_ns
        self.nt_bytes = nt_bytes
        self.slice_ns = slice_ns
        maxchild = 0
        for i, spec in enumerate(channels):
            chan_setup(self, &self.e.chans[i], spec)
            maxchild = max(maxchild, len(spec.children))
        self.e.chans[0].pair = self.e.nranks == 2 and not self.e.chans[0].ring
        self._select(selection)
        scratch_setup(self, maxchild)
        exchange_setup(self, exchange)
        # the single copy of private buffers (alg_cma.pxi): probed once, as the first call
        # begins or after its round; SHMTREE_CMA=0 switches it off (read once, here)
        self.cma_bytes = CMA_BYTES
        self.cma_total = CMA_TOTAL
        cma_publish_probe(&self.e)
        self.e.cma.state = (CMA_OFF if os.environ.get("SHMTREE_CMA", "1").strip() == "0"
                            else CMA_NO if self.e.nranks == 1 else CMA_UNKNOWN)

    # the waiting policy (wait.pxi), in ns
    @property
    def spin_ns(self):
        return self.e.spin_ns

    @spin_ns.setter
    def spin_ns(self, int64_t v):
        self.e.spin_ns = v

    @property
    def yield_ns(self):
        return self.e.yield_ns

    @yield_ns.setter
    def yield_ns(self, int64_t v):
        self.e.yield_ns = v

    @property
    def sleep_ns(self):
        return self.e.sleep_ns

    @sleep_ns.setter
    def sleep_ns(self, int64_t v):
        self.e.sleep_ns = v

    def __dealloc__(self):
        engine_free(self)

    # ---- shared arrays: the single-copy collectives (alg_direct.pxi, engine/shares.pxi) ----

    def direct_order(self, list ring, list children=None, int root=0):
        """The fold orders of the single copies: the ring order (the ranks by ring position:
        reduce_scatter's and reduce's, and allreduce's under the ring schedule, children None),
        or allreduce's pipelined tree (children[v]: v's children, left to right, under root).
        The same orders as the private paths', hence their bits."""
        direct_order_set(self, ring, children, root)

    def share(self, uint64_t ident, uint64_t start, uint64_t nbytes, bases, keep=None):
        """Register a shared allocation: this rank's own stretch of it, and every rank's mapping
        (bases: their addresses, by rank).  keep: what holds the peers' mappings; the engine
        holds it while registered, and a call that may run single-copy on the allocation holds
        it to its end (unshare does not end that).  This rank's own stretch is held by the
        call's own arrays (which lie in it)."""
        share_add(self, ident, start, nbytes, bases, keep)

    def unshare(self, uint64_t ident):
        """Forget an allocation: later calls do not find it.  A call in progress that may use
        it single-copy keeps its mappings (place_keep) until it has ended."""
        share_remove(self, ident)


    # ---- the call: one entry (Engine.call), then progress, give_output, cancel ----

    def call(self, int coll, array, out, op, int root, int kind, timeout, uint64_t tag=0,
             dims=None, offs=None):
        """Start a collective and run its first time slice; the one way into a call.

        coll: ALLREDUCE (array None: a barrier), REDUCE, REDUCE_SCATTER, ALLGATHER, BROADCAST,
        ALLTOALL, SCAN, EXSCAN or ERROR; root: the root's rank (broadcast, reduce); kind: the descriptor's (KIND_* +
        KIND_ROOT_STEP * root, which every rank compares); timeout: the first slice's limit
        (None or seconds, a float or int >= 0: the slice is the engine's slice_ns or less).
        array, out, op: the call's, as the collective takes them (engine/msg.pxi): a plain
        ndarray call of a supported dtype is taken as it is (the hot path: one C call);
        op is an op name or ufunc, or (op code, dtype code) already checked by the parse;
        tag: ALLGATHER's, ALLTOALL's, SCAN's and EXSCAN's dtype digest, BROADCAST's
        BC_DATA_ONLY; dims: the descriptor's
        shape when it is not the array's; offs: ALLGATHER's block bounds by ring position
        (bytes, 2P uint64) when the blocks differ; ALLTOALL's byte matrix B (with dims), or
        its counts (without dims: alltoall(counts=), engine/msg.pxi's msg_alltoallv).  Which
        algorithm runs is the selection's
        (engine/msg.pxi, select).  Returns (rc, result) - rc as progress's, result the output
        array when it is known from the start (None: take_result() once the call is DONE) - or
        None when the call cannot be taken as it is (the caller normalises it first:
        collectives.py) or another call is in progress (nothing has run then)."""
        cdef int64_t budget = _budget(self.slice_ns, timeout)
        cdef int rc
        if self.busy or budget < 0:
            return None
        self.result = None
        self.e.call.rank_order = coll == COLL_ALLREDUCE and tag == RANK_ORDER_TAG and \
            self.e.nranks == 2
        if coll == COLL_ALLREDUCE or coll == COLL_BARRIER:
            rc = msg_allreduce(self, array, out, op, kind, dims)
        elif coll == COLL_REDUCE:
            rc = msg_reduce(self, array, out, op, root, kind)
        elif coll == COLL_REDUCE_SCATTER:
            rc = msg_reduce_scatter(self, array, out, op, kind)
        elif coll == COLL_ALLGATHER:
            rc = msg_allgather(self, array, out, kind, tag, dims, offs)
        elif coll == COLL_BROADCAST:
            rc = msg_broadcast(self, array, out, root, kind, tag)
        elif coll == COLL_ALLTOALL:
            rc = msg_alltoall(self, array, out, kind, tag, dims, offs)
        elif coll == COLL_SCAN or coll == COLL_EXSCAN:
            rc = msg_scan(self, array, out, op, kind, coll == COLL_EXSCAN, tag)
        elif coll == COLL_SCATTER:
            rc = msg_scatter(self, array, out, root, kind, tag)
        elif coll == COLL_ERROR:
            rc = msg_error(self, kind, array)
        else:
            raise ValueError(f"shmtree: Engine.call: no collective {coll}")
        if rc < 0:
            self.result = None
            return None
        if rc == RC_ALONE:                # (one rank: the call is whole already)
            got = self.result
            self.result = None
            return RC_DONE, got
        if rc == RC_DONE:
            rc = self._progress(budget)
            if rc == RC_NEED_OUT:
                return rc, None           # (what the round said: take_result)
        got = self.result                 # (the output known from the start, or the result of
        self.result = None                # a broadcast done in this slice; else take_result)
        return rc, got

    def began(self):
        """When the last call or slice began, in time.monotonic()'s seconds (CLOCK_MONOTONIC):
        the first look at the clock of its slice (at most 8 steps or one idle turn after its
        start), or now where the slice has not looked yet.  A quick path's deadline is this
        plus its timeout, computed only when the call outlasts its first slice: a clock read
        less on every call that does not (a deadline later than the call's start by those few
        steps at most)."""
        if self.e.slice_end == 0:
            return shm_now_ns() / 1e9
        return (self.e.slice_end - self.e.slice_ns) / 1e9

    def scan_takes(self, uint64_t nbytes, bint exclusive=False):
        """Does call take a scan (exclusive: an exscan) of nbytes per rank whole?  Else the
        transpose scheme (Executors._scan).  The one rule (msg_scan.pxi's _scan_takes)."""
        return _scan_takes(self, nbytes, exclusive)

    def scan_chain_from(self):
        """The least bytes per rank of a scan on the reduce's chain; 0: never here."""
        return _scan_chain_from(self)

    def take_result(self):
        """The result of the call that ended last, when call() could not give it (a broadcast
        whose shape comes from the root): the output array, or a tuple saying what the caller
        must do next (engine/bcast.pxi, bcast_read)."""
        got = self.result
        self.result = None
        return got

    @property
    def seq(self):
        """The seq of the call begun last (calls are numbered 0, 1, ... by the engine)."""
        return self.cur_seq

    cdef int may_begin(self) except -2:
        """Just before a call begins (its arguments are parsed): -1 when another thread began
        a call meanwhile (a collector run by an allocation may have let it in: the caller's
        call is declined), RC_ABORTED when the group is aborted (nothing begins), else
        RC_DONE."""
        if self.busy:
            return -1
        if aborted(&self.e):
            return RC_ABORTED
        return RC_DONE

    cdef int alone(self, cnp.ndarray a, cnp.ndarray res) noexcept:
        """An allreduce in a group of one rank, whole (its arguments checked): the input
        copied to the output, the call numbered and counted as one that ran its round, and
        RC_ALONE (Engine.call: done, no progress to run)."""
        cdef uint64_t seq = self.next_seq
        cdef shm_rank_block *me = self.seg.block(self.e.rank)
        cdef uint64_t n = cnp.PyArray_NBYTES(a)
        self.next_seq = seq + 1
        self.cur_seq = seq
        self.e.idle_since = 0
        if n and cnp.PyArray_DATA(a) != cnp.PyArray_DATA(res):
            memcpy(cnp.PyArray_DATA(res), cnp.PyArray_DATA(a), n)
        self.ncalls += 1
        shm_store_release64(&me.done, seq + 1)
        return RC_ALONE

    cdef void begin_call(self, src, dst, const char *src_p, char *dst_p, uint64_t nbytes,
                         int itemsize, int op, int dtype, int kind, int ndim, int64_t *dims,
                         int coll, int alg) noexcept:
        """Set up a call (its arguments checked): it takes the next seq, and says so in the
        rank block (call) for peers that explain a stall; the call holds src and dst (and
        whatever msg_* made it hold) until it ends here.  alg: the selection's (ALG_INLINE:
        the message travels in the channel-0 round; else it runs on a channel of its own
        after that round, which then carries the descriptor alone)."""
        cdef uint64_t seq = self.next_seq
        self.next_seq = seq + 1
        self.cur_seq = seq
        self.e.idle_since = 0
        self.owner = PyThread_get_thread_ident()
        shm_store_release64(&self.seg.block(self.e.rank).call, seq + 1)
        self.src_p = src_p
        self.dst_p = dst_p
        self.src_ref = src
        self.dst_ref = dst
        self.msg_nbytes = nbytes
        self.e.nt = self.nt_bytes > 0 and nbytes >= self.nt_bytes
        self.msg_itemsize = itemsize if itemsize > 0 else 1
        self.msg_op = op
        self.msg_dtype = dtype
        self.coll = coll
        self.alg = alg
        write_desc(self, seq, nbytes, kind, op, dtype, ndim, dims)
        self.direct = 0
        self.cma = 0
        if self.e.cma.state == CMA_UNKNOWN:
            self.e.cma.state = cma_probe(&self.e, True)   # (where every peer has started)
        cma_place(self, seq, coll, alg, src_p, dst_p)
        if coll == COLL_ALLREDUCE:           # (rank_order: the private paths' fold alone)
            place(self, seq, src_p, dst_p, nbytes, alg != ALG_INLINE and not self.e.call.rank_order)
        elif coll == COLL_BROADCAST or coll == COLL_ALLGATHER:
            place(self, seq, dst_p, dst_p, nbytes, True)     # (every rank's output alone)
        elif coll == COLL_ALLTOALL:
            place(self, seq, src_p, src_p, self.x_src_n, True)    # (every rank's input alone:
                                                                  # each reads its peers')
        elif coll == COLL_REDUCE and self.e.call.coll_kind >= CHAIN_SCAN:
            place(self, seq, src_p, dst_p, nbytes, False)    # (a scan's chain: no single copy)
        elif coll == COLL_REDUCE_SCATTER or dst_p == NULL:
            place(self, seq, src_p, src_p, nbytes, True)     # (every rank's input alone; reduce
        else:                                                # away from the root)
            place(self, seq, src_p, dst_p, nbytes, True)     # (reduce: the root's output must
                                                             # lie in the inputs' allocation)
        self.phase = 0
        if alg == ALG_INLINE:
            self._start_phase(0, ALG_INLINE, self.src_p, self.dst_p, nbytes)
        else:
            self._start_phase(0, ALG_INLINE, NULL, NULL, 0)
        self.busy = 1

    cdef void _begin_reduction(self, cnp.ndarray a, cnp.ndarray res, int opc, int dtc, int kind,
                               int nd, int64_t *dims, int coll) noexcept:
        """begin_call for a reduction whose arguments msg_* checked (res None: reduce away from
        the root); the overlap rule: the fast paths declined a clashing out=."""
        cdef uint64_t nbytes = cnp.PyArray_NBYTES(a)
        self.begin_call(a, res, <const char *>cnp.PyArray_DATA(a) if nbytes else NULL,
                        NULL if res is None or not nbytes else <char *>cnp.PyArray_DATA(res),
                        nbytes, cnp.PyArray_ITEMSIZE(a), opc, dtc, kind, nd, dims, coll,
                        select(self, coll, nbytes) if coll == COLL_ALLREDUCE else ALG_RING)

    cdef _select(self, dict selection):
        """Take the Plan's selection: {collective number: (inline limit, algorithm name)}."""
        cdef int coll
        names = {"tree": ALG_TREE, "ring": ALG_TREE, "chain": ALG_RING, "blocks": ALG_RING,
                 "copy": ALG_TREE, "exchange": ALG_RING}
        for coll in range(N_COLL):
            limit, alg = selection[coll]
            self.sel_limit[coll] = limit
            self.sel_alg[coll] = names[alg]
            if self.sel_alg[coll] == ALG_RING and self._ring_channel() < 0:
                raise ValueError("shmtree: the selection names a ring algorithm, and no "
                                 "channel runs the ring schedule")

    cdef void _start_phase(self, int ch, int alg, const char *src, char *dst,
                           uint64_t nbytes) noexcept nogil:
        """Set up the call state for one channel and algorithm over nbytes of src into dst."""
        cdef Chan *c = &self.e.chans[ch]
        cdef Call *k = &self.e.call
        cdef int i
        if self.coll == COLL_REDUCE and k.coll_kind >= CHAIN_SCAN:
            k.fn = fold_kernel(self.msg_op, self.msg_dtype)     # (a scan's chain: msg_scan)
        else:
            k.fn = get_kernel(self.msg_op, self.msg_dtype)
        k.ch = ch
        k.src = src
        k.dst = dst
        k.nbytes = nbytes
        k.itemsize = self.msg_itemsize
        k.j_up = 0
        k.j_down = 0
        k.mismatch = 0
        k.check_desc = 0
        # bases: each counter is written only by this rank, so its own last value is current
        c.up.base = shm_load_relaxed64(ring_head(c.up.ring)) if c.up.ring != NULL else 0
        c.down.base = shm_load_relaxed64(ring_head(c.down.ring)) if c.down.ring != NULL else 0
        c.pdown.base = (shm_load_relaxed64(ring_tail(c.pdown.ring, c.pdown.tail))
                        if c.pdown.ring != NULL else 0)
        for i in range(c.nchild):
            c.cup[i].base = shm_load_relaxed64(ring_tail(c.cup[i].ring, 0))
        _ALGS[self.coll][alg].setup(&self.e, c, k)

    cdef int _ring_channel(self) noexcept nogil:
        """The channel that runs the ring schedule with more than one rank: the bandwidth
        channel, or the ring laid around it when it is a tree; -1 if there is none."""
        cdef int ch
        for ch in range(1, self.nchan):
            if self.e.chans[ch].ring and self.e.chans[ch].parent >= 0:
                return ch
        return -1

    cdef inline int _phase1(self, int *ch) noexcept nogil:
        """Channel and algorithm of the call's phase 1: an allreduce runs on the bandwidth
        channel (its tree or ring schedule, or the single copy), the other collectives on the
        ring channel."""
        if self.direct:
            ch[0] = 1
            return ALG_DIRECT
        if self.cma:
            ch[0] = 1
            return ALG_CMA
        if self.coll == COLL_ALLREDUCE:
            ch[0] = 1
            return ALG_RING if self.e.chans[1].ring and self.e.chans[1].parent >= 0 else ALG_TREE
        ch[0] = self._ring_channel()
        return ALG_RING

    cdef inline const Alg *_alg(self) noexcept nogil:
        """The algorithm of the running phase."""
        cdef int ch
        if self.phase == 0:
            return &_ALGS[self.coll][ALG_INLINE]
        return &_ALGS[self.coll][self._phase1(&ch)]

    cdef int _run_call(self) noexcept nogil:
        """Run the phases of the call in progress (see call)."""
        cdef int rc = drive(&self.e, self._alg())
        cdef int ch, alg
        cdef const char *src
        cdef uint64_t lo
        if rc == RC_DONE and self.phase == 0 and self.e.cma.state == CMA_UNKNOWN:
            self.e.cma.state = cma_probe(&self.e, False)  # (once: every peer has started)
        if rc == RC_DONE and self.phase == 0 and self.bc.pending:
            return scatter_handover(self) if self.sc_mode else bcast_handover(self)
        if rc == RC_DONE and self.phase == 0 and self.xv.pending:
            return RC_XV_ROUND        # (alltoall(counts=): _progress reads the round)
        if rc == RC_DONE and self.phase == 0 and self.alg != ALG_INLINE:
            self.phase = 1
            self.direct = direct_agreed(self)
            self.cma = (not self.direct and (self.coll == COLL_ALLGATHER or self.coll == COLL_ALLTOALL)
                        and cma_agreed(self))   # (only they offer: cma_place)
            self.e.dir.mode = self.coll
            if self.direct:
                self.e.nt = False     # (measured: streaming stores slow the single copy down,
                                      # 64 MiB at P=2 1.3x the plain stores' time)
            self.e.dir.pairwise = self.msg_dtype == DT_F2 or self.msg_dtype == DT_BF16
            alg = self._phase1(&ch)
            src = self.src_p
            if self.coll == COLL_ALLGATHER and src != NULL and not self.direct:
                lo = self.e.call.offs[2 * self.e.dir.pos]     # (the blocks algorithm sends this
                memcpy(self.dst_p + lo, src,                  # rank's block from its output)
                       self.e.call.offs[2 * self.e.dir.pos + 1] - lo)
                src = NULL
            self._start_phase(ch, alg, src, self.dst_p, self.msg_nbytes)
            rc = drive(&self.e, self._alg())
        return rc

    def progress(self, int64_t budget_ns):
        """Run the call until DONE, ABORTED, MISMATCH or CORRUPT, or STALLED when the time slice
        of budget_ns ends first (whether or not steps were taken: the caller checks its deadline,
        signals and peers between slices).  Releases the GIL."""
        if not self.busy:
            raise RuntimeError("shmtree: no call in progress")
        return self._progress(budget_ns)

    cdef int _progress(self, int64_t budget_ns) except -1:
        cdef int rc
        cdef shm_rank_block *me = self.seg.block(self.e.rank)
        if self.bc.need:
            return RC_NEED_OUT
        with nogil:
            self.e.slice_end = 0
            self.e.slice_ns = budget_ns
            rc = self._run_call()
            if rc != RC_STALLED and rc != RC_NEED_OUT and rc != RC_XV_ROUND and self.e.nt:
                shm_store_fence()             # the output's streaming stores are complete
            if rc == RC_DONE and self.scan.upto >= 0:       # (a scan: its fold, in C)
                fold_prefix(self.scan.op, self.scan.dtype, self.scan.rows, self.scan.stride,
                            self.scan.upto, self.scan.out, self.scan.n)
        if rc == RC_XV_ROUND:                 # (the counts are in: the data, inline or not)
            rc = xv_handover(self)
        if rc == RC_NEED_OUT:                 # (a broadcast's data follows: give_output)
            if self.sc_mode:
                self.result = sc_said(self, <const uint8_t *>cnp.PyArray_DATA(
                    <cnp.ndarray>self.src_ref) + CLAIM * self.e.nranks, True)
            else:
                self.result = bcast_read(self.src_ref, None, self.e.nranks, self.bc.used_room)
            return rc
        if rc != RC_STALLED:
            if rc == RC_DONE:
                self.ncalls += 1
                if self.fin_n:
                    memcpy(self.fin_to, self.fin_from, self.fin_n)
                if self.x_full is not None:
                    xchg_inline_finish(&self.e, <const char *>cnp.PyArray_DATA(self.x_full),
                                       <char *>cnp.PyArray_DATA(self.x_out))
                if self.bc.root >= 0:
                    self.result = bcast_ended(self)
                elif self.sc_mode:
                    self.result = scatter_ended(self)
            self._end_call()
            if rc == RC_DONE or rc == RC_MISMATCH:      # either way every rank is through it
                shm_store_release64(&me.done, self.cur_seq + 1)
            shm_store_release64(&me.call, 0)
        return rc

    cdef void _end_call(self) noexcept:
        """The call has ended here (or is forgotten): it lets go of what it held, the peers'
        mappings included."""
        # (a field that holds something is let go; the others are only looked at: a store of
        # None is an incref and a decref, and 17 of them made an 8 B allreduce 40 ns slower)
        self.busy = 0
        self.src_ref = self.dst_ref = None
        if self.offs_ref is not None:
            self.offs_ref = None
        if self.fin_ref is not None:
            self.fin_ref = None
        if self.bc_result is not None or self.bc_out is not None:
            self.bc_result = self.bc_out = None
        if self.x_full is not None or self.x_out is not None:
            self.x_full = self.x_out = None
        if self.xv_a is not None or self.xv_out is not None:
            self.xv_a = self.xv_out = None
        self.xv.pending = 0
        if self.scan_out is not None:
            self.scan_out = None
        self.scan.upto = -1
        if self.place_keep is not None or self.place_keep_out is not None:
            self.place_keep = self.place_keep_out = None
        self.fin_n = 0
        self.bc.root = -1
        self.bc.pending = self.bc.need = self.bc.ran = 0
        self.sc_mode = 0
        if self.sc_src is not None or self.sc_out is not None:
            self.sc_src = self.sc_out = None
        self.sc_src_p = self.sc_dst_p = NULL

    def give_output(self, dst):
        """Give the broadcast that stopped with NEED_OUT this rank's output: a C-contiguous
        writable array of the root's dtype and shape (take_result() said them: ("data", dtype,
        shape)); progress() then runs the data."""
        bcast_need_out(self, dst)

    def cancel(self):
        """Forget the call in progress (after an abort: the rings are not reused)."""
        self._end_call()
        self.result = None
        shm_store_release64(&self.seg.block(self.e.rank).call, 0)

    def stats(self):
        """Counters of this rank since it joined: calls completed, sched_yield calls, futex
        sleeps, sleeps that ran out their time (nobody woke the rank), and payload bytes sent
        (published into rings for other ranks)."""
        return {"calls": self.ncalls, "yields": self.e.n_yields, "sleeps": self.e.n_sleeps,
                "sleep_timeouts": self.e.n_timeouts, "bytes_sent": self.e.n_sent}

    def cma_counts(self):
        """The single copy by cross-memory attach (alg_cma.pxi) since this rank joined: calls
        that ran it, and the bytes this rank read out of its peers' buffers."""
        return {"calls": self.e.cma.n_calls, "bytes": self.e.cma.n_bytes}

    @property
    def cma_state(self):
        """The single copy of private buffers (alg_cma.pxi) in this group, as this rank found
        it: "unknown" (not probed yet: after the first call's round), "yes", "no" (the kernel
        does not let this rank read every peer's memory), or "off" (SHMTREE_CMA=0)."""
        return ("unknown", "yes", "no", "off")[self.e.cma.state]

    @property
    def cma_chunk(self):
        """Bytes the single copy by cross-memory attach reads at a time (alg_cma.pxi)."""
        return self.e.cma.chunk

    @cma_chunk.setter
    def cma_chunk(self, uint64_t n):
        if n < 1:
            raise ValueError("shmtree: cma_chunk must be at least 1 byte")
        self.e.cma.chunk = n

    @property
    def in_call(self):
        return bool(self.busy)

    def owns_call(self):
        """Is a call in progress that the calling thread began?  (Only that thread may cancel
        it: another thread's call must not be torn down by a concurrency error.)"""
        return bool(self.busy) and self.owner == PyThread_get_thread_ident()
