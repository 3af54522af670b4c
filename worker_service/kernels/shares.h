/* Units of work split into one contiguous share per thread of an OpenMP team, where a
 * thread that finishes its own share takes the last units left in the others'.
 *
 * A static split (each thread its share, then the barrier) leaves every thread waiting
 * for the slowest: on a machine whose cores also run the scheduler and the front ends,
 * or whose threads compete for memory bandwidth, the slowest is a different thread each
 * time, and a perf profile of a decoding-heavy run put a quarter of the second thread's
 * samples in OpenMP's wait (docs/benchmarks.md, session 30). Dealing every unit
 * dynamically instead costs locality: a thread's own columns of a weight stay in its L2
 * from one 256-row chunk to the next (gate_up at 2048 rows ran 0.83x dealt). So each
 * thread runs its share front to back, as the static split does, and only the units no
 * one has reached yet move, from the back of another's share.
 *
 * A unit's result must not depend on which thread computes it (true of every caller:
 * each unit writes outputs of its own, computed in a fixed order).
 */
#ifndef SEQSERVE_SHARES_H
#define SEQSERVE_SHARES_H

#include <stdatomic.h>
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define SHARES_MAX_THREADS 64

/* One thread's share: the next unit it takes (low 32 bits) and the end of what is left
 * (high 32 bits), in one word so that the owner taking from the front and a thief taking
 * from the back agree on every unit with one compare-and-swap; a cache line each. */
struct share {
    _Atomic uint64_t left;
    char pad[56];
};

struct shares {
    struct share of[SHARES_MAX_THREADS];
    int64_t threads;
};

static inline uint64_t shares_pack(int64_t front, int64_t end) {
    return (uint64_t)front | ((uint64_t)end << 32);
}

/* Thread t's share is units [lo, hi) (the shares together must cover the units, each
 * once; units must fit 32 bits). Set every thread's before the parallel region. */
static inline void shares_set(struct shares *s, int64_t t, int64_t lo, int64_t hi) {
    atomic_store_explicit(&s->of[t].left, shares_pack(lo, hi), memory_order_relaxed);
}

/* Clamps a team size to what `struct shares` holds (a larger team's extra threads take
 * only others' units). */
static inline int64_t shares_threads(int64_t threads) {
    return threads < 1 ? 1 : threads > SHARES_MAX_THREADS ? SHARES_MAX_THREADS : threads;
}

/* Splits units [0, units) into `threads` contiguous shares, evenly by count. Call it
 * before the parallel region, with the team's size (shares_team). */
static inline void shares_init(struct shares *s, int64_t units, int64_t threads) {
    s->threads = threads = shares_threads(threads);
    for (int64_t t = 0; t < threads; t++)
        shares_set(s, t, units * t / threads, units * (t + 1) / threads);
}

/* The team size to give shares_init for a parallel region with this `if` clause. */
static inline int64_t shares_team(int parallel) {
#ifdef _OPENMP
    return parallel ? omp_get_max_threads() : 1;
#else
    (void)parallel;
    return 1;
#endif
}

/* The calling thread's next run of units, [*first, *first + return value): from the
 * front of its own share up to the next multiple of `align` (or the share's end), else
 * from the back of the first other share with units left, back to the previous multiple
 * of `align` (or that share's front); 0 when none are left. A run never crosses a
 * multiple of `align`, so a caller whose units come in aligned groups that are cheaper
 * together (the query heads of one KV head) keeps them together where it can. */
static inline int64_t shares_next_run(struct shares *s, int64_t align, int64_t *first) {
    int64_t me = 0;
#ifdef _OPENMP
    me = omp_get_thread_num();
#endif
    /* A team smaller than planned takes the missing threads' shares as others'; a larger
     * one's extra threads have none of their own. */
    uint64_t v = me < s->threads ? atomic_load_explicit(&s->of[me].left, memory_order_relaxed)
                                 : 0;
    for (;;) {
        const int64_t front = (int64_t)(v & 0xffffffffu), end = (int64_t)(v >> 32);
        if (front >= end)
            break;
        int64_t stop = (front / align + 1) * align;
        stop = stop < end ? stop : end;
        if (atomic_compare_exchange_weak_explicit(&s->of[me].left, &v, shares_pack(stop, end),
                                                  memory_order_relaxed, memory_order_relaxed)) {
            *first = front;
            return stop - front;
        }
    }
    for (int64_t i = 1; i <= s->threads; i++) {
        struct share *other = &s->of[(me + i) % s->threads];
        v = atomic_load_explicit(&other->left, memory_order_relaxed);
        for (;;) {
            const int64_t front = (int64_t)(v & 0xffffffffu), end = (int64_t)(v >> 32);
            if (front >= end)
                break;
            int64_t from = (end - 1) / align * align;
            from = from > front ? from : front;
            if (atomic_compare_exchange_weak_explicit(&other->left, &v,
                                                      shares_pack(front, from),
                                                      memory_order_relaxed,
                                                      memory_order_relaxed)) {
                *first = from;
                return end - from;
            }
        }
    }
    return 0;
}

/* Shares of contiguous ranges of blocks: thread t's are blocks [blocks t / threads,
 * blocks (t + 1) / threads), taken in groups of `step` blocks, each group `chunks` units
 * (its chunks of rows), numbered on from the previous thread's; first[t] is thread t's
 * first unit and first[threads] their count. Call it before the parallel region. */
static inline void shares_by_blocks(struct shares *s, int64_t first[SHARES_MAX_THREADS + 1],
                                    int64_t threads, int64_t blocks, int64_t step,
                                    int64_t chunks) {
    s->threads = threads = shares_threads(threads);
    first[0] = 0;
    for (int64_t t = 0; t < threads; t++) {
        const int64_t lo = blocks * t / threads, hi = blocks * (t + 1) / threads;
        first[t + 1] = first[t] + (hi - lo + step - 1) / step * chunks;
        shares_set(s, t, first[t], first[t + 1]);
    }
}

/* The thread whose share holds `unit`, where thread t's share is [first[t], first[t + 1]). */
static inline int64_t shares_owner(const int64_t *first, int64_t unit) {
    int64_t t = 0;
    while (unit >= first[t + 1])
        t++;
    return t;
}

/* The calling thread's next unit (a run of one); -1 when none are left. */
static inline int64_t shares_next(struct shares *s) {
    int64_t unit;
    return shares_next_run(s, 1, &unit) ? unit : -1;
}

#endif
