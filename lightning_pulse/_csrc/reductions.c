/*
 * Reductions over a list of tensors in one native call, for StabilityGuard's per-step gradient-norm read.
 *
 * Built at first use together with mhc_kernels.c by lightning_pulse/_native.py and called through ctypes.
 * With torch ops, the 2-norm of k gradient tensors is one fused norm call plus k reads of 0-d results; on a
 * small model's few-millisecond CPU step those dispatches, not the arithmetic, are the cost. Here it is one
 * call that returns the sum of squares.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

/* Independent partial sums: a fixed-width inner loop the compiler vectorises without reassociating a serial
 * reduction (which it may not do without -ffast-math). */
#define LANES 16

/* Sum of squares of fp32 tensors, accumulated in double as torch's CPU norm does: no square of a finite fp32
 * value overflows it (the largest is about 1e77), and a NaN or infinite entry makes the result non-finite.
 * torch returns each tensor's norm in fp32, where a norm above FLT_MAX is infinite; so is the result here
 * whenever one tensor's sum of squares exceeds FLT_MAX^2, and the two ways of reading agree. */
double sum_of_squares_f32(int64_t count, const float *const *tensors, const int64_t *sizes) {
    const double limit = (double)FLT_MAX * (double)FLT_MAX;
    double total = 0;
    for (int64_t t = 0; t < count; ++t) {
        const float *restrict v = tensors[t];
        const int64_t n = sizes[t], full = n - n % LANES;
        double acc[LANES] = {0};
        for (int64_t i = 0; i < full; i += LANES)
            for (int k = 0; k < LANES; ++k) acc[k] += (double)v[i + k] * (double)v[i + k];
        double sum = 0;
        for (int k = 0; k < LANES; ++k) sum += acc[k];
        for (int64_t i = full; i < n; ++i) sum += (double)v[i] * (double)v[i];
        total += sum > limit ? INFINITY : sum;
    }
    return total;
}

/* One optimizer step's reads for StabilityGuard. `entries` holds `count` (address, size) pairs of fp32
 * tensors; the result is their sum of squares, as sum_of_squares_f32 computes it. The fp32 loss at `loss` (if
 * any) is written to `*loss_out`. Reading the 0-d loss here spares its own dispatch: right after the backward
 * pass, with the interpreter's and torch's code cold, that read costs microseconds. One array of pairs, not
 * two arrays, because building each array is itself a cost at that moment. */
double step_reads_f32(int64_t count, const int64_t *entries, const float *loss, double *loss_out) {
    double total = 0;
    for (int64_t t = 0; t < count; ++t) {
        const float *tensor = (const float *)(intptr_t)entries[2 * t];
        total += sum_of_squares_f32(1, &tensor, &entries[2 * t + 1]);
    }
    if (loss) *loss_out = (double)*loss;
    return total;
}
