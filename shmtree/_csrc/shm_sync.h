/* shm_sync.h: the few lock-free and kernel primitives the engine needs, for memory shared between
 * processes.
 *
 * - 64-bit counters published with release stores and observed with acquire loads (C11 __atomic
 *   builtins): ring heads and tails only ever grow, and the data they guard is visible to whoever
 *   observes the new value.
 * - A full fence for the Dekker-style "I am going to sleep" / "did anyone go to sleep" handshake.
 * - futex wait/wake on a 32-bit word in shared memory (not FUTEX_PRIVATE: the word is shared between
 *   processes), with a relative timeout so that a sleeper wakes up to check its peers.
 * - cpu_relax(): the pause instruction of spin loops; now_ns(): a monotonic clock.
 */
#ifndef SHMTREE_SHM_SYNC_H
#define SHMTREE_SHM_SYNC_H

#include <stdint.h>
#include <errno.h>
#include <time.h>
#include <sched.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>

static inline uint64_t shm_load_acquire64(const volatile uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline uint64_t shm_load_relaxed64(const volatile uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_RELAXED);
}
static inline void shm_store_release64(volatile uint64_t *p, uint64_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
static inline uint32_t shm_load_acquire32(const volatile uint32_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline void shm_store_seqcst32(volatile uint32_t *p, uint32_t v) {
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
}
static inline uint32_t shm_load_seqcst32(const volatile uint32_t *p) {
    return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}
static inline uint32_t shm_fetch_add32(volatile uint32_t *p, uint32_t v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
/* Compare-and-swap; returns 1 when *p held expected and now holds desired. */
static inline int shm_cas32(volatile uint32_t *p, uint32_t expected, uint32_t desired) {
    return __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
static inline void shm_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

static inline void shm_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

static inline int64_t shm_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Sleep while *addr == expected, at most timeout_ns.  Spurious wake-ups are fine: callers re-check.
 * Returns 1 when the sleep ran out its time (nobody woke us), else 0. */
static inline int shm_futex_wait(volatile uint32_t *addr, uint32_t expected, int64_t timeout_ns) {
    struct timespec ts;
    if (timeout_ns < 0) timeout_ns = 0;
    ts.tv_sec = timeout_ns / 1000000000LL;
    ts.tv_nsec = timeout_ns % 1000000000LL;
    long rc = syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, expected, &ts, NULL, 0);
    return rc != 0 && errno == ETIMEDOUT;
}

static inline void shm_futex_wake_all(volatile uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

#endif

/* Copy with non-temporal (streaming) stores: for outputs of large messages, which the caller will
 * not read back soon; it saves the read-for-ownership of every destination line (a third of a
 * large copy's memory traffic).  Callers issue shm_store_fence() before relying on the data from
 * another core (the stores are weakly ordered). */
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <string.h>

static inline void shm_copy_nt(void *dst, const void *src, size_t n) {
#if defined(__SSE2__)
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (n < 256) {
        memcpy(d, s, n);
        return;
    }
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    for (; n >= 64; d += 64, s += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
#else
    memcpy(dst, src, n);
#endif
}

static inline void shm_store_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}
