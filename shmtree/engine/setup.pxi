# Setting an engine up (Engine.__init__, direct_order, __dealloc__): its channels' ring ends in the
# segment, the single copies' fold orders, and freeing it all.  Included by _engine.pyx after the
# Engine class.


cdef char *seg_ptr(Engine self, int64_t off, uint64_t need) except? NULL:
    if off < 0:
        return NULL
    if <uint64_t>off + need > self.seg.size:
        raise ValueError("shmtree: ring offset outside the segment")
    return self.seg.base + off


cdef conn_setup(Engine self, Conn *r, int64_t off, int ntails, uint64_t span):
    """A ring end at segment offset off (-1: none) with ntails consumers."""
    r.hdr = ring_hdr_bytes(ntails)
    r.ring = seg_ptr(self, off, r.hdr + span)
    r.ntails = ntails


cdef chan_setup(Engine self, Chan *c, spec):
    """One channel from its transport.ChannelSpec."""
    cdef int i
    cdef list children = list(spec.children)
    c.ring = 1 if spec.ring else 0
    c.ring_pos = spec.ring_pos
    c.parent = spec.parent
    c.index = spec.index
    c.nchild = len(children)
    c.nslots = spec.nslots
    c.stride = spec.stride
    c.payload = spec.payload
    if c.nslots < 1 or c.stride < c.payload + sizeof(shm_slot_hdr):
        raise ValueError("shmtree: bad ring geometry")
    cdef uint64_t span = c.nslots * c.stride
    c.children = <int *>calloc(c.nchild + 1, sizeof(int))
    c.cup = <Conn *>calloc(c.nchild + 1, sizeof(Conn))
    if c.children == NULL or c.cup == NULL:
        raise MemoryError()
    for i in range(c.nchild):
        c.children[i] = children[i]
    conn_setup(self, &c.up, spec.up, 1, span)
    c.up.peers = &c.parent                    # the parent (ring: the successor) consumes it
    conn_setup(self, &c.down, spec.down, c.nchild, span)
    c.down.peers = c.children
    conn_setup(self, &c.pdown, spec.parent_down, spec.parent_nchild, span)
    c.pdown.tail = c.index
    c.pdown.peer = c.parent
    for i in range(c.nchild):
        conn_setup(self, &c.cup[i], spec.child_up[i], 1, span)
        c.cup[i].tail = 0
        c.cup[i].peer = c.children[i]
    if c.ring:
        if (c.parent >= 0) != (c.up.ring != NULL) or c.nchild > 1 or c.down.ring != NULL:
            raise ValueError("shmtree: inconsistent ring schedule")
        return
    if (c.parent >= 0) != (c.up.ring != NULL) or (c.parent >= 0) != (c.pdown.ring != NULL):
        raise ValueError("shmtree: inconsistent parent rings")
    if (c.nchild > 0) != (c.down.ring != NULL):
        raise ValueError("shmtree: inconsistent child rings")


cdef scratch_setup(Engine self, int maxchild):
    """The scratch of the reductions and of the single copies."""
    cdef int i
    # the operands of one fused reduction: own input and every child's chunk (ring: 2)
    self.e.call.srcs = <const void **>calloc(maxchild + 2, sizeof(void *))
    cdef Direct *d = &self.e.dir
    d.order = <int *>calloc(self.e.nranks, sizeof(int))
    d.post = <int *>calloc(self.e.nranks, sizeof(int))
    d.kid_start = <int *>calloc(self.e.nranks + 1, sizeof(int))
    d.kids = <int *>calloc(self.e.nranks, sizeof(int))
    d.srcs = <const void **>calloc(self.e.nranks + 1, sizeof(void *))
    d.ins = <const char **>calloc(self.e.nranks, sizeof(char *))
    d.outs = <char **>calloc(self.e.nranks, sizeof(char *))
    d.tmp = <char *>malloc(DIRECT_PIECE)
    if (self.e.call.srcs == NULL or d.order == NULL or d.post == NULL or d.kid_start == NULL
            or d.kids == NULL or d.srcs == NULL or d.ins == NULL or d.outs == NULL
            or d.tmp == NULL):
        raise MemoryError()
    d.ring = 1
    for i in range(self.e.nranks):
        d.order[i] = i
    cdef Xchg *x = &self.e.x
    cdef int P = self.e.nranks
    x.to_at = <uint64_t *>calloc(P, sizeof(uint64_t))
    x.from_at = <uint64_t *>calloc(P, sizeof(uint64_t))
    x.dst_at = <uint64_t *>calloc(P + 1, sizeof(uint64_t))
    x.first = <uint64_t *>calloc(P, sizeof(uint64_t))
    x.got = <uint64_t *>calloc(P, sizeof(uint64_t))
    x.need = <uint64_t *>calloc(P, sizeof(uint64_t))
    x.box = <char **>calloc(P, sizeof(char *))
    if (x.to_at == NULL or x.from_at == NULL or x.dst_at == NULL or x.first == NULL
            or x.got == NULL or x.need == NULL or x.box == NULL):
        raise MemoryError()
    cdef Cma *m = &self.e.cma
    m.pids = <int *>calloc(P, sizeof(int))
    m.src = <uint64_t *>calloc(P, sizeof(uint64_t))
    if m.pids == NULL or m.src == NULL:
        raise MemoryError()


cdef exchange_setup(Engine self, exchange):
    """The outboxes of the exchange (alg_exchange.pxi), from transport.Layout.exchange_spec():
    (every rank's outbox offset, nslots, stride, payload), or None in a group of one."""
    cdef Xchg *x = &self.e.x
    cdef int r
    if exchange is None:
        if self.e.nranks > 1:
            raise ValueError("shmtree: a group of several ranks needs the exchange's outboxes")
        return
    offsets, nslots, stride, payload = exchange
    if len(offsets) != self.e.nranks or nslots < 1 or stride < payload + sizeof(shm_slot_hdr) \
            or payload < 64:
        raise ValueError("shmtree: bad exchange geometry")
    x.nslots = nslots
    x.stride = stride
    x.payload = payload
    for r in range(self.e.nranks):
        x.box[r] = seg_ptr(self, offsets[r], <uint64_t>nslots * stride)
    x.last = <uint64_t *>calloc(nslots, sizeof(uint64_t))
    if x.last == NULL:
        raise MemoryError()


cdef void engine_free(Engine self) noexcept:
    """What Engine.__dealloc__ frees."""
    cdef int i
    for i in range(3):
        free(self.e.chans[i].children)
        free(self.e.chans[i].cup)
    free(self.e.call.srcs)
    cdef Direct *d = &self.e.dir
    free(d.order)
    free(d.post)
    free(d.kid_start)
    free(d.kids)
    free(d.scratch)
    free(d.tmp)
    free(d.srcs)
    free(d.ins)
    free(d.outs)
    free(self.share_id)
    free(self.share_start)
    free(self.share_len)
    free(self.share_bases)
    cdef Xchg *x = &self.e.x
    free(x.to_at)
    free(x.from_at)
    free(x.dst_at)
    free(x.first)
    free(x.got)
    free(x.need)
    free(x.box)
    free(x.last)
    free(self.e.cma.pids)
    free(self.e.cma.src)


cdef direct_order_set(Engine self, list ring, list children, int root):
    """The fold orders of the single copies: the ring order (the ranks by ring position:
    reduce_scatter's and reduce's, and allreduce's under the ring schedule, children None),
    or allreduce's pipelined tree (children[v]: v's children, left to right, under root).
    The same orders as the private paths', hence their bits."""
    cdef Direct *d = &self.e.dir
    cdef int P = self.e.nranks, i, j, n
    if sorted(ring) != list(range(P)):
        raise ValueError("shmtree: direct_order: ring must hold every rank once")
    for i in range(P):
        d.order[i] = ring[i]
        if ring[i] == self.e.rank:
            d.pos = i
    d.ring = children is None
    if d.ring:
        return
    if len(children) != P or sum(len(c) for c in children) != P - 1:
        raise ValueError("shmtree: direct_order: children must describe a tree of every rank")
    post = []

    def visit(v):
        for c in children[v]:
            visit(c)
        if children[v]:
            post.append(v)
    visit(root)
    if len(post) != sum(1 for c in children if c):
        raise ValueError("shmtree: direct_order: children must describe a tree under root")
    d.root = root
    n = 0
    for i in range(P):
        d.kid_start[i] = n
        for j in children[i]:
            d.kids[n] = j
            n += 1
    d.kid_start[P] = n
    d.npost = len(post)
    for i in range(d.npost):
        d.post[i] = post[i]
    free(d.scratch)
    d.scratch = <char *>malloc(<uint64_t>P * DIRECT_PIECE)
    if d.scratch == NULL:
        raise MemoryError()

