// y[M, N] = x[M, K] @ W[N, K]^T for the few rows of a decode step or a Verify, on a copy of W
// repacked once into panels of 32 outputs: panel p holds W[32p .. 32p + 31, :] as [K][32]
// (zero rows past N). Built and loaded by specdec/models/panels.py.
//
// Why: MKL's float32 kernels read W once for 1-3 rows but switch at 4 rows to one that costs ~35%
// more (SmolLM2's linears on an AMX Xeon, 2 threads: 3 rows 38, 4 rows 51 ms a forward), while a
// forward streams every weight from memory once and these rows' products are cheap beside it.
// Here each panel streams from memory once for all rows (groups of GROUP rows, the next group
// reading it from cache), and every output is one accumulator lane summed over k in order 0..K-1:
// a row's result does not depend on how many rows share the call nor on the thread count (each
// panel runs on one thread), so a Verify's rows equal their one-row decodes in these products.

#include <string.h>

#define PANEL 32
#if defined(__AVX512F__)
#define GROUP 8  // 2 x 8 accumulators of 16 floats: 16 of the 32 zmm registers
#else
#define GROUP 4  // a 16-float vector is 2 ymm registers: 16 of the 16 for accumulators
#endif

// Software prefetch this many k steps (128 bytes each) ahead: the hardware prefetcher alone kept
// too few lines in flight once the rows' FMAs shared the core (SmolLM2's 576 -> 1536 projections,
// 8 rows, 2 threads: 12.5 ms without, 8.5 ms at 32 or more). Past a panel's end it fetches the
// next panel, which this thread reads next; past the last, x86 prefetches are hints that never fault.
#define AHEAD 64

typedef float v16 __attribute__((vector_size(64), aligned(4)));

template <int ROWS>
static inline void panel_rows(const float* __restrict x, long K, const float* __restrict panel,
                              float* __restrict y, long N, long n0) {
    v16 low[ROWS], high[ROWS];
    for (int m = 0; m < ROWS; m++) {
        low[m] = (v16){};
        high[m] = (v16){};
    }
    for (long k = 0; k < K; k++) {
        __builtin_prefetch(panel + (k + AHEAD) * PANEL, 0, 3);
        __builtin_prefetch(panel + (k + AHEAD) * PANEL + 16, 0, 3);
        v16 w_low = *(const v16*)(panel + k * PANEL);
        v16 w_high = *(const v16*)(panel + k * PANEL + 16);
        for (int m = 0; m < ROWS; m++) {
            float xk = x[m * K + k];
            low[m] += w_low * xk;
            high[m] += w_high * xk;
        }
    }
    long valid = N - n0 < PANEL ? N - n0 : PANEL;
    for (int m = 0; m < ROWS; m++) {
        float out[PANEL];
        memcpy(out, &low[m], sizeof(v16));
        memcpy(out + 16, &high[m], sizeof(v16));
        memcpy(y + m * N + n0, out, valid * sizeof(float));
    }
}

typedef void (*rows_fn)(const float*, long, const float*, float*, long, long);

static const rows_fn BY_ROWS[GROUP + 1] = {
    0, panel_rows<1>, panel_rows<2>, panel_rows<3>, panel_rows<4>,
#if GROUP == 8
    panel_rows<5>, panel_rows<6>, panel_rows<7>, panel_rows<8>,
#endif
};

extern "C" int panels_group(void) { return GROUP; }

// x: [M, K] contiguous; panels: [ceil(N / 32), K, 32] contiguous; y: [M, N] contiguous.
extern "C" void panels_product(const float* x, long M, long K, const float* panels, long N, float* y) {
    long count = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < count; p++) {
        const float* panel = panels + p * K * PANEL;
        for (long m = 0; m < M; m += GROUP) {
            long rows = M - m < GROUP ? M - m : GROUP;
            BY_ROWS[rows](x + m * K, K, panel, y + m * N, N, p * PANEL);
        }
    }
}
