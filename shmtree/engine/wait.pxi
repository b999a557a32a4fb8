# Waiting: what a rank does when no step of its algorithm can run (spin, then yield, then sleep on
# its bell), the abort word, and the end of the time slice.  (The publishing side of the wake-up
# protocol is prims.pxi's generic_op and wake.)

cdef struct Idle:
    int64_t since                 # when the rank became idle (0: it is not)
    int spins
    bint spinning


cdef inline bint aborted(Eng *e) noexcept nogil:
    return shm_load_acquire32(e.abort_word) != 0


cdef inline bint now_past_slice(Eng *e, int64_t now) noexcept nogil:
    """Is `now` past the end of the slice?  The slice is timed from the first look at the
    clock (at most 8 steps or one idle turn after its start)."""
    if e.slice_end == 0:
        e.slice_end = now + e.slice_ns
    return now >= e.slice_end


cdef inline bint slice_over(Eng *e, int *steps) noexcept nogil:
    """After a step: has the time slice ended?  (The clock is read every 8th step.)"""
    steps[0] += 1
    return (steps[0] & 7) == 0 and now_past_slice(e, shm_now_ns())


DEF BUSY_YIELD_NS = 50000          # a sched_yield that took this long: another thread ran
DEF BUSY_FOR_NS = 200000000        # and for this long, waits sleep without yielding


cdef int idle(Eng *e, Idle *w, const Alg *alg, Chan *c, Call *k) noexcept nogil:
    """Nothing was ready: spin (pause), then yield, then sleep on the bell.  RC_DONE means
    'look again'; RC_STALLED or RC_ABORTED end the slice."""
    cdef shm_rank_block *me = rank_block(e.base, e.rank)
    cdef int64_t spent, now
    cdef uint32_t seen
    if aborted(e):
        return RC_ABORTED
    if w.since == 0:
        w.since = shm_now_ns()
        w.spinning = e.spin_ns > 0
        w.spins = 0
    w.spins += 1
    if w.spinning and (w.spins & 31):
        shm_cpu_relax()
        return RC_DONE
    now = shm_now_ns()
    if now_past_slice(e, now):
        return RC_STALLED
    spent = now - w.since
    if spent < e.spin_ns:
        shm_cpu_relax()
    elif spent < e.spin_ns + e.yield_ns and now >= e.busy_until:
        w.spinning = False
        e.n_yields += 1
        sched_yield()
        if shm_now_ns() - now > BUSY_YIELD_NS:
            # another thread had this CPU: a yield gives it the CPU for the rest of its time
            # slice (nobody wakes a rank that yields: it runs again only when that slice
            # ends), while a rank asleep on its bell is woken by its peer's ring, and the
            # scheduler lets a woken thread preempt a busy one: this wait and the waits of
            # the next BUSY_FOR_NS sleep after their spin, without yielding
            e.busy_until = shm_now_ns() + BUSY_FOR_NS
    else:
        w.spinning = False
        shm_store_seqcst32(&me.sleepers, 1)
        shm_fence()                 # pairs with the publisher's fence before it reads the flag
        seen = shm_load_seqcst32(&me.bell)
        if not (alg.ready(e, c, k) or aborted(e)):
            e.n_sleeps += 1
            e.n_timeouts += shm_futex_wait(&me.bell, seen, min(e.sleep_ns, e.slice_end - now))
        shm_store_seqcst32(&me.sleepers, 0)
    return RC_DONE
