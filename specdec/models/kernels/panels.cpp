// y[M, N] = x[M, K] @ W[N, K]^T for the few rows of a decode step or a Verify, on a copy of W
// repacked once into panels of 32 outputs: panel p holds outputs 32p .. 32p + 31 (zero past N).
// Built and loaded by specdec/models/panels.py.
//
// Why: MKL's float32 kernels read W once for 1-3 rows but switch at 4 rows to one that costs ~35%
// more (SmolLM2's linears on an AMX Xeon, 2 threads: 3 rows 38, 4 rows 51 ms a forward), while a
// forward streams every weight from memory once and these rows' products are cheap beside it.
// Here each panel streams from memory once for all rows (groups of GROUP rows, the next group
// reading it from cache), and every output is one accumulator lane summed over k in order 0..K-1:
// a row's result does not depend on how many rows share the call nor on the thread count (each
// panel runs on one thread), so a Verify's rows equal their one-row decodes in these products.
//
// A panel holds W in one of three forms, each a Source below that yields row k of the panel (the
// 32 outputs' weights at input k) as float32:
// - F32: [K][32] float32.
// - Q4: weights that are exactly 4-bit blocks (GGUF's Q4_1: w = d * q + m, q in 0..15, one d and
//   m per 32 consecutive inputs of an output): nibbles [K][16] (byte j: output j in the low 4 bits,
//   output j + 16 in the high) and d, m as float32 [K / 32][32]; 0.75 bytes a weight.
// - Q8: exactly 8-bit blocks (GGUF's Q8_0: w = d * q, q in -128..127): q [K][32] int8 and d as
//   float32 [K / 32][32]; 1.125 bytes a weight.
// q * d is exact (11 x 4 or 8 bits), so q * d + m rounds once, as the dequantizer's sum did: each
// form yields the float32 weight bit for bit, and all three give the same products.

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
#define BLOCK 32  // inputs per quantization block

// Software prefetch this many k steps ahead: the hardware prefetcher alone kept too few lines in
// flight once the rows' FMAs shared the core (SmolLM2's 576 -> 1536 projections, float32, 8 rows,
// 2 threads: 12.5 ms without, 8.5 ms at 32 or more). Past a panel's end it fetches the next panel,
// which this thread reads next; past the last, x86 prefetches are hints that never fault.
#define AHEAD 64

typedef float vec __attribute__((vector_size(WIDTH * 4), aligned(4)));
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

struct F32 {
    const float* panel;
    F32(const float* panels, long p, long K) : panel(panels + p * K * PANEL) {}
    inline void block(long) {}
    inline void row(long k, vec* w) const {
        __builtin_prefetch(panel + (k + AHEAD) * PANEL, 0, 3);
        __builtin_prefetch(panel + (k + AHEAD) * PANEL + 16, 0, 3);
        for (int l = 0; l < LANES; l++) w[l] = *(const vec*)(panel + k * PANEL + l * WIDTH);
    }
};

struct Q4 {
    const unsigned char* nibbles;
    const float *scale, *offset;
    vec d[LANES], m[LANES];
    Q4(const unsigned char* n, const float* s, const float* o, long p, long K)
        : nibbles(n + p * K * 16), scale(s + p * K), offset(o + p * K) {}
    inline void block(long b) {
        for (int l = 0; l < LANES; l++) {
            d[l] = *(const vec*)(scale + b * PANEL + l * WIDTH);
            m[l] = *(const vec*)(offset + b * PANEL + l * WIDTH);
        }
    }
    inline void row(long k, vec* w) const {
        __builtin_prefetch(nibbles + (k + 2 * AHEAD) * 16, 0, 3);
#if defined(__AVX512F__)
        // A level's float by table lookup: vpermps reads only an index's low 4 bits, so neither
        // nibble needs masking nor converting (6 vector ops a row of 32 weights instead of 8; the
        // same floats, so the same bits).
        const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i both = (__m512i)widen(nibbles + k * 16);
        w[0] = (vec)_mm512_permutexvar_ps(both, levels) * d[0] + m[0];
        w[1] = (vec)_mm512_permutexvar_ps(_mm512_srli_epi32(both, 4), levels) * d[1] + m[1];
#else
        for (int l = 0; l < LANES; l++) {
            ints q = (widen(nibbles + k * 16 + (l * WIDTH) % 16) >> (l * WIDTH >= 16 ? 4 : 0)) & 15;
            w[l] = __builtin_convertvector(q, vec) * d[l] + m[l];
        }
#endif
    }
};

struct Q8 {
    const signed char* levels;
    const float* scale;
    vec d[LANES];
    Q8(const signed char* q, const float* s, long p, long K) : levels(q + p * K * PANEL), scale(s + p * K) {}
    inline void block(long b) {
        for (int l = 0; l < LANES; l++) d[l] = *(const vec*)(scale + b * PANEL + l * WIDTH);
    }
    inline void row(long k, vec* w) const {
        __builtin_prefetch(levels + (k + AHEAD) * PANEL, 0, 3);
        for (int l = 0; l < LANES; l++) w[l] = __builtin_convertvector(widen_signed(levels + k * PANEL + l * WIDTH), vec) * d[l];
    }
};

// ROWS rows of x against one panel; y gets the panel's outputs (n0 .. n0 + 31, those below N).
template <int ROWS, class Source>
static inline void panel_rows(Source source, const float* __restrict x, long K, float* __restrict y, long N, long n0) {
    vec acc[ROWS][LANES];
    for (int m = 0; m < ROWS; m++)
        for (int l = 0; l < LANES; l++) acc[m][l] = (vec){};
    for (long k = 0; k < K; k++) {
        if (k % BLOCK == 0) source.block(k / BLOCK);
        vec w[LANES];
        source.row(k, w);
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

// Every panel (split over the threads), each against the rows GROUP at a time.
template <class MakeSource>
static void run(const float* x, long M, long K, long N, float* y, MakeSource make) {
    long count = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < count; p++) {
        for (long m = 0; m < M; m += GROUP) {
            const float* rows = x + m * K;
            float* out = y + m * N;
            switch (M - m < GROUP ? M - m : GROUP) {
                case 1: panel_rows<1>(make(p), rows, K, out, N, p * PANEL); break;
                case 2: panel_rows<2>(make(p), rows, K, out, N, p * PANEL); break;
                case 3: panel_rows<3>(make(p), rows, K, out, N, p * PANEL); break;
#if GROUP > 3
                case 4: panel_rows<4>(make(p), rows, K, out, N, p * PANEL); break;
                case 5: panel_rows<5>(make(p), rows, K, out, N, p * PANEL); break;
                case 6: panel_rows<6>(make(p), rows, K, out, N, p * PANEL); break;
                case 7: panel_rows<7>(make(p), rows, K, out, N, p * PANEL); break;
                case 8: panel_rows<8>(make(p), rows, K, out, N, p * PANEL); break;
#endif
            }
        }
    }
}

// x: [M, K] and y: [M, N] contiguous; the panels as above, ceil(N / 32) of them. The Q4 and Q8
// forms need K to be a multiple of 32.
extern "C" int panels_group(void) { return GROUP; }

extern "C" void panels_product(const float* x, long M, long K, const float* panels, long N, float* y) {
    run(x, M, K, N, y, [=](long p) { return F32(panels, p, K); });
}

extern "C" void panels_q4_product(const float* x, long M, long K, const unsigned char* nibbles, const float* scale,
                                  const float* offset, long N, float* y) {
    run(x, M, K, N, y, [=](long p) { return Q4(nibbles, scale, offset, p, K); });
}

extern "C" void panels_q8_product(const float* x, long M, long K, const signed char* levels, const float* scale,
                                  long N, float* y) {
    run(x, M, K, N, y, [=](long p) { return Q8(levels, scale, p, K); });
}
