/*
 * Fused CPU kernels for the hyper-connection stream operations and Sinkhorn-Knopp.
 *
 * Compiled at first use by lightning_pulse/nn/_cpu_kernels.py (plain C, no torch headers, so a build takes
 * about a second) and called through ctypes, which releases the GIL. This file is compiled twice, once with
 * SCALAR=float and once with SCALAR=double; SFX names the variant's symbols.
 *
 * Why these kernels exist: on a CPU the stream operations of an mHC layer are bound by memory traffic, not
 * arithmetic. With torch ops, the mixing backward reads the (P, n, C) streams and their gradient several times
 * (one batched matmul per product, then an in-place add), and Sinkhorn-Knopp on (P, 4, 4) matrices costs
 * hundreds of tiny dispatched ops per layer. Here every position's n x C block is read from memory once and
 * reused from the L1/L2 cache for every product of that position, and a Sinkhorn matrix stays in registers
 * for all of its iterations.
 *
 * Layouts (all contiguous, row-major): pre (P, n), res (P, n, n) with res[i][j] carrying stream j into
 * stream i, streams (P, n, C), branch input / branch gradient (P, C), Sinkhorn logits (N, n, n).
 *
 * Positions are split over `threads` POSIX threads (the caller passes torch's intra-op thread count).
 */
#define _POSIX_C_SOURCE 200112L /* posix_memalign */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef SCALAR
#define SCALAR float
#endif
#ifndef SFX
#define SFX _f32
#endif

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define NAME(base) CAT(base, SFX)

/* Independent partial sums: a fixed-width inner loop the compiler vectorises without reassociating a serial
 * reduction (which it may not do without -ffast-math). */
#define LANES 16

typedef void (*NAME(range_fn))(void *args, int64_t begin, int64_t end);

typedef struct {
    NAME(range_fn) fn;
    void *args;
    int64_t begin, end;
} NAME(chunk_t);

static void *NAME(run_chunk)(void *chunk) {
    NAME(chunk_t) *c = (NAME(chunk_t) *)chunk;
    c->fn(c->args, c->begin, c->end);
    return NULL;
}

/* Starting a thread costs tens of microseconds; a thread gets at least this much work (a few hundred
 * microseconds at width 512, measured on one core) so that the start-up stays a small share. */
#define MIN_POSITIONS_PER_THREAD 256
#define MIN_MATRICES_PER_THREAD 1024

/* Run fn over [0, total) in `threads` contiguous chunks; the calling thread takes the first one. */
static void NAME(parallel_range)(NAME(range_fn) fn, void *args, int64_t total, int threads, int64_t min_per_thread) {
    if (threads > 1 && min_per_thread > 0 && total / min_per_thread < threads) {
        threads = (int)(total / min_per_thread);
    }
    if (threads <= 1 || total < 2) {
        fn(args, 0, total);
        return;
    }
    if (threads > 64) threads = 64;
    NAME(chunk_t) chunks[64];
    pthread_t ids[64];
    int started[64] = {0};
    int64_t step = (total + threads - 1) / threads;
    for (int t = 0; t < threads; ++t) {
        chunks[t].fn = fn;
        chunks[t].args = args;
        chunks[t].begin = t * step < total ? t * step : total;
        chunks[t].end = (t + 1) * step < total ? (t + 1) * step : total;
    }
    for (int t = 1; t < threads; ++t) {
        started[t] = pthread_create(&ids[t], NULL, NAME(run_chunk), &chunks[t]) == 0;
        if (!started[t]) NAME(run_chunk)(&chunks[t]); /* no thread to spare: do the chunk here */
    }
    NAME(run_chunk)(&chunks[0]);
    for (int t = 1; t < threads; ++t) {
        if (started[t]) pthread_join(ids[t], NULL);
    }
}

/* ------------------------------------------------------------------ stream mixing, forward
 * branch_input[p] = sum_j pre[p][j] x[p][j]          (H_pre x)
 * mixed[p][i]     = sum_j res[p][i][j] x[p][j]       (H_res x)
 */
typedef struct {
    int64_t n, C;
    const SCALAR *pre, *res, *x;
    SCALAR *branch_input, *mixed;
} NAME(mix_fwd_args);

static void NAME(mix_forward_range)(void *raw, int64_t begin, int64_t end) {
    NAME(mix_fwd_args) *a = (NAME(mix_fwd_args) *)raw;
    const int64_t n = a->n, C = a->C;
    for (int64_t p = begin; p < end; ++p) {
        const SCALAR *x = a->x + p * n * C;
        const SCALAR *pre = a->pre + p * n;
        const SCALAR *res = a->res + p * n * n;
        SCALAR *bi = a->branch_input + p * C;
        SCALAR *out = a->mixed + p * n * C;
        if (n == 4) { /* the paper's n: every output row in one pass over the four input rows */
            const SCALAR *restrict x0 = x, *restrict x1 = x + C, *restrict x2 = x + 2 * C, *restrict x3 = x + 3 * C;
            for (int64_t c = 0; c < C; ++c) bi[c] = pre[0] * x0[c] + pre[1] * x1[c] + pre[2] * x2[c] + pre[3] * x3[c];
            for (int64_t i = 0; i < 4; ++i) {
                SCALAR *restrict oi = out + i * C;
                const SCALAR r0 = res[i * 4], r1 = res[i * 4 + 1], r2 = res[i * 4 + 2], r3 = res[i * 4 + 3];
                for (int64_t c = 0; c < C; ++c) oi[c] = r0 * x0[c] + r1 * x1[c] + r2 * x2[c] + r3 * x3[c];
            }
            continue;
        }
        for (int64_t c = 0; c < C; ++c) bi[c] = pre[0] * x[c];
        for (int64_t j = 1; j < n; ++j) {
            const SCALAR w = pre[j], *xj = x + j * C;
            for (int64_t c = 0; c < C; ++c) bi[c] += w * xj[c];
        }
        for (int64_t i = 0; i < n; ++i) {
            SCALAR *oi = out + i * C;
            const SCALAR *ri = res + i * n;
            for (int64_t c = 0; c < C; ++c) oi[c] = ri[0] * x[c];
            for (int64_t j = 1; j < n; ++j) {
                const SCALAR w = ri[j], *xj = x + j * C;
                for (int64_t c = 0; c < C; ++c) oi[c] += w * xj[c];
            }
        }
    }
}

void NAME(mix_forward)(int64_t P, int64_t n, int64_t C, const SCALAR *pre, const SCALAR *res, const SCALAR *x,
                       SCALAR *branch_input, SCALAR *mixed, int threads) {
    NAME(mix_fwd_args) a = {n, C, pre, res, x, branch_input, mixed};
    NAME(parallel_range)(NAME(mix_forward_range), &a, P, threads, MIN_POSITIONS_PER_THREAD);
}

/* ------------------------------------------------------------------ stream mixing, backward
 * With g = dL/d mixed (P, n, C) and b = dL/d branch_input (P, C):
 * grad_pre[p][j]    = <x[p][j], b[p]>
 * grad_res[p][i][j] = <g[p][i], x[p][j]>
 * grad_x[p][j]      = sum_i res[p][i][j] g[p][i] + pre[p][j] b[p]
 * One position's x, g and b (2n + 1 rows of C values) fit in the L1/L2 cache, so each is read from memory
 * once; the n + n^2 dot products and the grad_x rows then reread them from the cache.
 */
typedef struct {
    int64_t n, C;
    const SCALAR *pre, *res, *x, *grad_branch_input, *grad_mixed;
    SCALAR *grad_pre, *grad_res, *grad_x;
} NAME(mix_bwd_args);

static SCALAR NAME(dot)(const SCALAR *restrict u, const SCALAR *restrict v, int64_t C) {
    SCALAR acc[LANES] = {0};
    const int64_t full = C - C % LANES;
    for (int64_t c0 = 0; c0 < full; c0 += LANES)
        for (int k = 0; k < LANES; ++k) acc[k] += u[c0 + k] * v[c0 + k];
    SCALAR s = 0;
    for (int k = 0; k < LANES; ++k) s += acc[k];
    for (int64_t c = full; c < C; ++c) s += u[c] * v[c];
    return s;
}

static void NAME(mix_backward_range)(void *raw, int64_t begin, int64_t end) {
    NAME(mix_bwd_args) *a = (NAME(mix_bwd_args) *)raw;
    const int64_t n = a->n, C = a->C;
    for (int64_t p = begin; p < end; ++p) {
        const SCALAR *restrict x = a->x + p * n * C;
        const SCALAR *restrict g = a->grad_mixed + p * n * C;
        const SCALAR *restrict b = a->grad_branch_input + p * C;
        const SCALAR *pre = a->pre + p * n;
        const SCALAR *res = a->res + p * n * n;
        if (n == 4 && C % LANES == 0) {
            /* five independent accumulators per stream row j: x_j is loaded once for its five dot products,
             * and the multiply-adds do not wait on each other */
            const SCALAR *restrict g0 = g, *restrict g1 = g + C, *restrict g2 = g + 2 * C, *restrict g3 = g + 3 * C;
            for (int64_t j = 0; j < 4; ++j) {
                const SCALAR *restrict xj = x + j * C;
                SCALAR ap[LANES] = {0}, a0[LANES] = {0}, a1[LANES] = {0}, a2[LANES] = {0}, a3[LANES] = {0};
                for (int64_t c0 = 0; c0 < C; c0 += LANES)
                    for (int k = 0; k < LANES; ++k) {
                        const SCALAR v = xj[c0 + k];
                        ap[k] += v * b[c0 + k];
                        a0[k] += g0[c0 + k] * v;
                        a1[k] += g1[c0 + k] * v;
                        a2[k] += g2[c0 + k] * v;
                        a3[k] += g3[c0 + k] * v;
                    }
                SCALAR sp = 0, s0 = 0, s1 = 0, s2 = 0, s3 = 0;
                for (int k = 0; k < LANES; ++k) {
                    sp += ap[k];
                    s0 += a0[k];
                    s1 += a1[k];
                    s2 += a2[k];
                    s3 += a3[k];
                }
                SCALAR *gr = a->grad_res + p * 16;
                a->grad_pre[p * 4 + j] = sp;
                gr[j] = s0;
                gr[4 + j] = s1;
                gr[8 + j] = s2;
                gr[12 + j] = s3;
            }
        } else {
            for (int64_t j = 0; j < n; ++j) a->grad_pre[p * n + j] = NAME(dot)(x + j * C, b, C);
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < n; ++j)
                    a->grad_res[p * n * n + i * n + j] = NAME(dot)(g + i * C, x + j * C, C);
        }
        SCALAR *restrict gx = a->grad_x + p * n * C;
        if (n == 4) {
            const SCALAR *restrict g0 = g, *restrict g1 = g + C, *restrict g2 = g + 2 * C, *restrict g3 = g + 3 * C;
            for (int64_t j = 0; j < 4; ++j) {
                SCALAR *restrict gxj = gx + j * C;
                const SCALAR w = pre[j], r0 = res[j], r1 = res[4 + j], r2 = res[8 + j], r3 = res[12 + j];
                for (int64_t c = 0; c < C; ++c) gxj[c] = w * b[c] + r0 * g0[c] + r1 * g1[c] + r2 * g2[c] + r3 * g3[c];
            }
            continue;
        }
        for (int64_t j = 0; j < n; ++j) {
            SCALAR *restrict gxj = gx + j * C;
            const SCALAR w = pre[j];
            for (int64_t c = 0; c < C; ++c) gxj[c] = w * b[c];
            for (int64_t i = 0; i < n; ++i) {
                const SCALAR r = res[i * n + j];
                const SCALAR *restrict gi = g + i * C;
                for (int64_t c = 0; c < C; ++c) gxj[c] += r * gi[c];
            }
        }
    }
}

void NAME(mix_backward)(int64_t P, int64_t n, int64_t C, const SCALAR *pre, const SCALAR *res, const SCALAR *x,
                        const SCALAR *grad_branch_input, const SCALAR *grad_mixed, SCALAR *grad_pre,
                        SCALAR *grad_res, SCALAR *grad_x, int threads) {
    NAME(mix_bwd_args) a = {n, C, pre, res, x, grad_branch_input, grad_mixed, grad_pre, grad_res, grad_x};
    NAME(parallel_range)(NAME(mix_backward_range), &a, P, threads, MIN_POSITIONS_PER_THREAD);
}

/* ------------------------------------------------------------------ adding the branch, backward
 * out[p][i] = mixed[p][i] + post[p][i] F[p]; with g = dL/d out (P, n, C):
 * grad_post[p][i] = <g[p][i], F[p]>,   grad_F[p] = sum_i post[p][i] g[p][i]
 * (the gradient of `mixed` is g itself, passed through by the caller). One read of g for both.
 */
typedef struct {
    int64_t n, C;
    const SCALAR *post, *branch_output, *grad;
    SCALAR *grad_post, *grad_branch_output;
} NAME(add_bwd_args);

static void NAME(add_branch_backward_range)(void *raw, int64_t begin, int64_t end) {
    NAME(add_bwd_args) *a = (NAME(add_bwd_args) *)raw;
    const int64_t n = a->n, C = a->C;
    for (int64_t p = begin; p < end; ++p) {
        const SCALAR *restrict g = a->grad + p * n * C;
        const SCALAR *restrict f = a->branch_output + p * C;
        const SCALAR *post = a->post + p * n;
        SCALAR *restrict gf = a->grad_branch_output + p * C;
        if (n == 4 && C % LANES == 0) {
            const SCALAR *restrict g0 = g, *restrict g1 = g + C, *restrict g2 = g + 2 * C, *restrict g3 = g + 3 * C;
            const SCALAR w0 = post[0], w1 = post[1], w2 = post[2], w3 = post[3];
            SCALAR a0[LANES] = {0}, a1[LANES] = {0}, a2[LANES] = {0}, a3[LANES] = {0};
            for (int64_t c0 = 0; c0 < C; c0 += LANES)
                for (int k = 0; k < LANES; ++k) {
                    const int64_t c = c0 + k;
                    const SCALAR v = f[c];
                    a0[k] += g0[c] * v;
                    a1[k] += g1[c] * v;
                    a2[k] += g2[c] * v;
                    a3[k] += g3[c] * v;
                    gf[c] = w0 * g0[c] + w1 * g1[c] + w2 * g2[c] + w3 * g3[c];
                }
            SCALAR s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            for (int k = 0; k < LANES; ++k) {
                s0 += a0[k];
                s1 += a1[k];
                s2 += a2[k];
                s3 += a3[k];
            }
            SCALAR *gp = a->grad_post + p * 4;
            gp[0] = s0;
            gp[1] = s1;
            gp[2] = s2;
            gp[3] = s3;
            continue;
        }
        for (int64_t i = 0; i < n; ++i) a->grad_post[p * n + i] = NAME(dot)(g + i * C, f, C);
        for (int64_t c = 0; c < C; ++c) gf[c] = post[0] * g[c];
        for (int64_t i = 1; i < n; ++i) {
            const SCALAR w = post[i];
            const SCALAR *restrict gi = g + i * C;
            for (int64_t c = 0; c < C; ++c) gf[c] += w * gi[c];
        }
    }
}

void NAME(add_branch_backward)(int64_t P, int64_t n, int64_t C, const SCALAR *post, const SCALAR *branch_output,
                               const SCALAR *grad, SCALAR *grad_post, SCALAR *grad_branch_output, int threads) {
    NAME(add_bwd_args) a = {n, C, post, branch_output, grad, grad_post, grad_branch_output};
    NAME(parallel_range)(NAME(add_branch_backward_range), &a, P, threads, MIN_POSITIONS_PER_THREAD);
}

/* ------------------------------------------------------------------ Sinkhorn-Knopp
 * Same arithmetic as the torch path in sinkhorn.py: shift each matrix by its max, floor the shifted logits at
 * min_shifted, exp, then `iters` rounds of "divide each column by its sum, then each row by its sum".
 * Matrices are processed BLOCK at a time, transposed so that the block is the innermost axis: every sum and
 * division then runs over BLOCK independent lanes (vector instructions), where one 4 x 4 matrix alone would
 * leave them idle. The backward recomputes a block's iterates (a few tens of KB, cache-resident) instead of
 * storing them for the whole batch, then walks back through every normalisation: for y = m / s with s the
 * sum over an axis, dm = (dy - sum(dy * y)) / s over that axis; finally d logits = dm * exp-matrix (the shift
 * and the floor get no gradient, as in the torch path).
 */
#define BLOCK 16
/* BLOCK lanes as one GCC/Clang generic vector: the arithmetic below is explicitly lane-wise, so it compiles
 * to vector instructions without relying on the auto-vectoriser (which gives up on these short loop nests) */
typedef SCALAR NAME(lanes_t) __attribute__((vector_size(BLOCK * sizeof(SCALAR))));
#define LANES_T NAME(lanes_t)

typedef struct {
    int64_t n, iters;
    SCALAR min_shifted;
    const SCALAR *logits, *grad_out;
    SCALAR *out;
} NAME(sinkhorn_args);

static LANES_T *NAME(alloc_lanes)(int64_t count) {
    void *memory = NULL;
    return posix_memalign(&memory, 64, sizeof(LANES_T) * (size_t)count) == 0 ? (LANES_T *)memory : NULL;
}

/* block-transposed load: dst[e][l] = src[l * nn + e]; idle lanes get ones (harmless, never stored) */
static void NAME(load_block)(int64_t nn, int64_t count, const SCALAR *src, LANES_T *dst) {
    for (int64_t e = 0; e < nn; ++e)
        for (int64_t l = 0; l < BLOCK; ++l) dst[e][l] = l < count ? src[l * nn + e] : (SCALAR)1;
}

static void NAME(store_block)(int64_t nn, int64_t count, const LANES_T *src, SCALAR *dst) {
    for (int64_t e = 0; e < nn; ++e)
        for (int64_t l = 0; l < count; ++l) dst[l * nn + e] = src[e][l];
}

static void NAME(start_block)(int64_t nn, SCALAR min_shifted, LANES_T *m) {
    LANES_T top = m[0];
    for (int64_t e = 1; e < nn; ++e)
        for (int l = 0; l < BLOCK; ++l) top[l] = m[e][l] > top[l] ? m[e][l] : top[l];
    for (int64_t e = 0; e < nn; ++e) {
        LANES_T shifted = m[e] - top;
        for (int l = 0; l < BLOCK; ++l) /* a NaN logit stays NaN, as clamp_min keeps it in the torch path */
            m[e][l] = exp(shifted[l] < min_shifted ? min_shifted : shifted[l]);
    }
}

/* element (t, k) of the axis: axis 0 walks column k (t = row), axis 1 walks row k (t = column) */
#define AXIS_INDEX(axis, n, t, k) ((axis) == 0 ? (t) * (n) + (k) : (k) * (n) + (t))

/* one normalisation: axis 0 divides every column by its sum, axis 1 every row; sums receives the n sums */
static void NAME(normalise_block)(int64_t n, int axis, const LANES_T *in, LANES_T *out, LANES_T *sums) {
    for (int64_t k = 0; k < n; ++k) {
        LANES_T sum = in[AXIS_INDEX(axis, n, 0, k)];
        for (int64_t t = 1; t < n; ++t) sum += in[AXIS_INDEX(axis, n, t, k)];
        for (int64_t t = 0; t < n; ++t) out[AXIS_INDEX(axis, n, t, k)] = in[AXIS_INDEX(axis, n, t, k)] / sum;
        sums[k] = sum;
    }
}

static void NAME(sinkhorn_forward_range)(void *raw, int64_t begin, int64_t end) {
    NAME(sinkhorn_args) *a = (NAME(sinkhorn_args) *)raw;
    const int64_t n = a->n, nn = n * n;
    LANES_T *work = NAME(alloc_lanes)(2 * nn + n);
    if (work == NULL) return;
    LANES_T *sums = work + 2 * nn;
    for (int64_t b0 = begin; b0 < end; b0 += BLOCK) {
        const int64_t count = end - b0 < BLOCK ? end - b0 : BLOCK;
        LANES_T *m = work, *next = work + nn;
        NAME(load_block)(nn, count, a->logits + b0 * nn, m);
        NAME(start_block)(nn, a->min_shifted, m);
        for (int64_t step = 0; step < 2 * a->iters; ++step) {
            NAME(normalise_block)(n, (int)(step % 2), m, next, sums);
            LANES_T *t = m;
            m = next;
            next = t;
        }
        NAME(store_block)(nn, count, m, a->out + b0 * nn);
    }
    free(work);
}

void NAME(sinkhorn_forward)(int64_t N, int64_t n, int64_t iters, SCALAR min_shifted, const SCALAR *logits,
                            SCALAR *out, int threads) {
    NAME(sinkhorn_args) a = {n, iters, min_shifted, logits, NULL, out};
    NAME(parallel_range)(NAME(sinkhorn_forward_range), &a, N, threads, MIN_MATRICES_PER_THREAD);
}

static void NAME(sinkhorn_backward_range)(void *raw, int64_t begin, int64_t end) {
    NAME(sinkhorn_args) *a = (NAME(sinkhorn_args) *)raw;
    const int64_t n = a->n, nn = n * n, steps = 2 * a->iters;
    /* iterates[0] = exp-matrix, iterates[s + 1] = after normalisation s, sums[s] its n sums; all per block */
    LANES_T *iterates = NAME(alloc_lanes)((steps + 1) * nn + steps * n + nn);
    if (iterates == NULL) return;
    LANES_T *sums = iterates + (steps + 1) * nn;
    LANES_T *grad = sums + steps * n;
    for (int64_t b0 = begin; b0 < end; b0 += BLOCK) {
        const int64_t count = end - b0 < BLOCK ? end - b0 : BLOCK;
        NAME(load_block)(nn, count, a->logits + b0 * nn, iterates);
        NAME(start_block)(nn, a->min_shifted, iterates);
        for (int64_t s = 0; s < steps; ++s)
            NAME(normalise_block)(n, (int)(s % 2), iterates + s * nn, iterates + (s + 1) * nn, sums + s * n);
        NAME(load_block)(nn, count, a->grad_out + b0 * nn, grad);
        for (int64_t s = steps - 1; s >= 0; --s) {
            const int axis = (int)(s % 2);
            const LANES_T *y = iterates + (s + 1) * nn;
            for (int64_t k = 0; k < n; ++k) {
                LANES_T dot = grad[AXIS_INDEX(axis, n, 0, k)] * y[AXIS_INDEX(axis, n, 0, k)];
                for (int64_t t = 1; t < n; ++t) dot += grad[AXIS_INDEX(axis, n, t, k)] * y[AXIS_INDEX(axis, n, t, k)];
                const LANES_T inverse = 1 / sums[s * n + k];
                for (int64_t t = 0; t < n; ++t) {
                    LANES_T *g = grad + AXIS_INDEX(axis, n, t, k);
                    *g = (*g - dot) * inverse;
                }
            }
        }
        for (int64_t e = 0; e < nn; ++e) grad[e] *= iterates[e];
        NAME(store_block)(nn, count, grad, a->out + b0 * nn);
    }
    free(iterates);
}

void NAME(sinkhorn_backward)(int64_t N, int64_t n, int64_t iters, SCALAR min_shifted, const SCALAR *logits,
                             const SCALAR *grad_out, SCALAR *grad_logits, int threads) {
    NAME(sinkhorn_args) a = {n, iters, min_shifted, logits, grad_out, grad_logits};
    NAME(parallel_range)(NAME(sinkhorn_backward_range), &a, N, threads, MIN_MATRICES_PER_THREAD);
}
