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

#include <immintrin.h>
#include <string.h>

#define PANEL 32
#if defined(__AVX512F__)
#define WIDTH 16  // floats a vector register holds
#define GROUP 8   // rows a pass keeps in registers: 8 x 2 accumulators, 16 of the 32 zmm
#else
#define WIDTH 8
// 3 x 4 accumulators and the panel's 4 vectors: one more than the 16 ymm, yet faster than 2 or 4
// rows a pass (the AVX2 build on an AMX Xeon, 576 -> 1536 at 8 rows: 11.1 / 11.8 / 12.0 ms for 3 / 2 / 4).
#define GROUP 3
#endif
#define LANES (PANEL / WIDTH)

// Software prefetch this many k steps (128 bytes each) ahead: the hardware prefetcher alone kept
// too few lines in flight once the rows' FMAs shared the core (SmolLM2's 576 -> 1536 projections,
// 8 rows, 2 threads: 12.5 ms without, 8.5 ms at 32 or more). Past a panel's end it fetches the
// next panel, which this thread reads next; past the last, x86 prefetches are hints that never fault.
#define AHEAD 64

typedef float vec __attribute__((vector_size(WIDTH * 4), aligned(4)));

template <int ROWS>
static inline void panel_rows(const float* __restrict x, long K, const float* __restrict panel,
                              float* __restrict y, long N, long n0) {
    vec acc[ROWS][LANES];
    for (int m = 0; m < ROWS; m++)
        for (int l = 0; l < LANES; l++) acc[m][l] = (vec){};
    for (long k = 0; k < K; k++) {
        __builtin_prefetch(panel + (k + AHEAD) * PANEL, 0, 3);
        __builtin_prefetch(panel + (k + AHEAD) * PANEL + 16, 0, 3);
        vec w[LANES];
        for (int l = 0; l < LANES; l++) w[l] = *(const vec*)(panel + k * PANEL + l * WIDTH);
        for (int m = 0; m < ROWS; m++) {
            float xk = x[m * K + k];
            for (int l = 0; l < LANES; l++) acc[m][l] += w[l] * xk;
        }
    }
    long valid = N - n0 < PANEL ? N - n0 : PANEL;
    for (int m = 0; m < ROWS; m++) {
        float out[PANEL];
        memcpy(out, acc[m], sizeof(out));
        memcpy(y + m * N + n0, out, valid * sizeof(float));
    }
}

typedef void (*rows_fn)(const float*, long, const float*, float*, long, long);

static const rows_fn BY_ROWS[9] = {
    0, panel_rows<1>, panel_rows<2>, panel_rows<3>, panel_rows<4>,
    panel_rows<5>, panel_rows<6>, panel_rows<7>, panel_rows<8>,
};

extern "C" int panels_group(void) { return GROUP; }

// The same product on a compact copy of W, for weights that are exactly a 4-bit block
// dequantization (GGUF's Q4_1: w = d * q + m, q in 0..15, one d and m per 32 consecutive inputs of
// an output; specdec/models/panels.py finds them and checks every weight). The panel then streams
// 0.75 bytes a weight instead of 4: nibbles [K][16] (byte j: output j low, output j + 16 high) and
// d, m as float32 [K / 32][32]. w is rebuilt as q * d + m, whose product is exact (11 x 4 bits), so
// it rounds once and equals the float32 weight bit for bit; the sums then run as panel_rows's, and
// every result equals the float32 panels' result exactly.
typedef int ints __attribute__((vector_size(WIDTH * 4)));

// WIDTH bytes zero- or sign-extended to WIDTH ints (GCC's generic conversion inserts them one by one).
static inline ints widen(const unsigned char* from) {
#if defined(__AVX512F__)
    return (ints)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)from));
#else
    return (ints)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)from));
#endif
}

static inline ints widen_signed(const signed char* from) {
#if defined(__AVX512F__)
    return (ints)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)from));
#else
    return (ints)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)from));
#endif
}

template <int ROWS>
static inline void panel_rows_q4(const float* __restrict x, long K, const unsigned char* __restrict nibbles,
                                 const float* __restrict scale, const float* __restrict offset,
                                 float* __restrict y, long N, long n0) {
    vec acc[ROWS][LANES];
    for (int m = 0; m < ROWS; m++)
        for (int l = 0; l < LANES; l++) acc[m][l] = (vec){};
    for (long block = 0; block < K / 32; block++) {
        vec d[LANES], o[LANES];
        for (int l = 0; l < LANES; l++) {
            d[l] = *(const vec*)(scale + block * PANEL + l * WIDTH);
            o[l] = *(const vec*)(offset + block * PANEL + l * WIDTH);
        }
        for (long k = block * 32; k < block * 32 + 32; k++) {
            __builtin_prefetch(nibbles + (k + 2 * AHEAD) * 16, 0, 3);
            vec w[LANES];
            for (int l = 0; l < LANES; l++) {
                ints q = (widen(nibbles + k * 16 + (l * WIDTH) % 16) >> (l * WIDTH >= 16 ? 4 : 0)) & 15;
                w[l] = __builtin_convertvector(q, vec) * d[l] + o[l];
            }
            for (int m = 0; m < ROWS; m++) {
                float xk = x[m * K + k];
                for (int l = 0; l < LANES; l++) acc[m][l] += w[l] * xk;
            }
        }
    }
    long valid = N - n0 < PANEL ? N - n0 : PANEL;
    for (int m = 0; m < ROWS; m++) {
        float out[PANEL];
        memcpy(out, acc[m], sizeof(out));
        memcpy(y + m * N + n0, out, valid * sizeof(float));
    }
}

typedef void (*q4_rows_fn)(const float*, long, const unsigned char*, const float*, const float*, float*, long, long);

static const q4_rows_fn Q4_BY_ROWS[9] = {
    0, panel_rows_q4<1>, panel_rows_q4<2>, panel_rows_q4<3>, panel_rows_q4<4>,
    panel_rows_q4<5>, panel_rows_q4<6>, panel_rows_q4<7>, panel_rows_q4<8>,
};

// x: [M, K] contiguous, K a multiple of 32; nibbles: [ceil(N / 32), K, 16]; scale, offset:
// [ceil(N / 32), K / 32, 32]; y: [M, N] contiguous.
extern "C" void panels_q4_product(const float* x, long M, long K, const unsigned char* nibbles, const float* scale,
                                  const float* offset, long N, float* y) {
    long count = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < count; p++) {
        for (long m = 0; m < M; m += GROUP) {
            long rows = M - m < GROUP ? M - m : GROUP;
            Q4_BY_ROWS[rows](x + m * K, K, nibbles + p * K * 16, scale + p * K, offset + p * K, y + m * N, N, p * PANEL);
        }
    }
}

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


// The same again for weights that are exactly 8-bit blocks (GGUF's Q8_0: w = d * q, q in
// -128..127, one d per 32 inputs; the packaged target's embedding, which its head shares):
// q as [K][32] int8 and d as float32 [K / 32][32], 1.125 bytes a weight. d * q is exact (11 x 8
// bits): the float32 weight again.
template <int ROWS>
static inline void panel_rows_q8(const float* __restrict x, long K, const signed char* __restrict levels,
                                 const float* __restrict scale, float* __restrict y, long N, long n0) {
    vec acc[ROWS][LANES];
    for (int m = 0; m < ROWS; m++)
        for (int l = 0; l < LANES; l++) acc[m][l] = (vec){};
    for (long block = 0; block < K / 32; block++) {
        vec d[LANES];
        for (int l = 0; l < LANES; l++) d[l] = *(const vec*)(scale + block * PANEL + l * WIDTH);
        for (long k = block * 32; k < block * 32 + 32; k++) {
            __builtin_prefetch(levels + (k + AHEAD) * PANEL, 0, 3);
            vec w[LANES];
            for (int l = 0; l < LANES; l++)
                w[l] = __builtin_convertvector(widen_signed(levels + k * PANEL + l * WIDTH), vec) * d[l];
            for (int m = 0; m < ROWS; m++) {
                float xk = x[m * K + k];
                for (int l = 0; l < LANES; l++) acc[m][l] += w[l] * xk;
            }
        }
    }
    long valid = N - n0 < PANEL ? N - n0 : PANEL;
    for (int m = 0; m < ROWS; m++) {
        float out[PANEL];
        memcpy(out, acc[m], sizeof(out));
        memcpy(y + m * N + n0, out, valid * sizeof(float));
    }
}

typedef void (*q8_rows_fn)(const float*, long, const signed char*, const float*, float*, long, long);

static const q8_rows_fn Q8_BY_ROWS[9] = {
    0, panel_rows_q8<1>, panel_rows_q8<2>, panel_rows_q8<3>, panel_rows_q8<4>,
    panel_rows_q8<5>, panel_rows_q8<6>, panel_rows_q8<7>, panel_rows_q8<8>,
};

// x: [M, K] contiguous, K a multiple of 32; levels: [ceil(N / 32), K, 32]; scale:
// [ceil(N / 32), K / 32, 32]; y: [M, N] contiguous.
extern "C" void panels_q8_product(const float* x, long M, long K, const signed char* levels, const float* scale,
                                  long N, float* y) {
    long count = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < count; p++) {
        for (long m = 0; m < M; m += GROUP) {
            long rows = M - m < GROUP ? M - m : GROUP;
            Q8_BY_ROWS[rows](x + m * K, K, levels + p * K * PANEL, scale + p * K, y + m * N, N, p * PANEL);
        }
    }
}
