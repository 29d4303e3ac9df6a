// x @ W^T for panels.cpp's 4- and 8-bit weights with x rounded to 8-bit blocks, the products in
// integers (AVX-512 VNNI): llama.cpp's arithmetic for GGUF's Q4_1 and Q8_0 weights (a Q8 row of x
// against each). Called by specdec/models/panels.py (`product` of an int8 form) and by layers.cpp,
// for every row a linear with such weights computes in a model whose `matmul_dtype` is int8
// (specdec/models/cpu_layout.py): decodes, Verify rows, prompts and the head alike.
//
// Why: a float32 product of rows spends one FMA per weight and row (16 a cycle at best); VPDPBUSD
// sums 4 byte products into each of 16 int32 lanes per instruction (64). SmolLM2's 576 -> 1536
// projection on an AVX-512 EPYC, 2 threads: 1 / 5 / 8 / 64 rows 25 / 58 / 83 / 650 us from the
// 4-bit copy in float32 (panels.cpp) against 7 / 19 / 31 / 209 here.
//
// What a row computes. Each block of 32 inputs of x becomes dx = max|x| / 127 and levels
// qx = round(x / dx) in -127..127 (sx = dx * sum(qx)); an output then adds, block by block in
// order, d * (dx * S) + m * sx, S the exact integer sum of q * qx over the block (4-bit q, w =
// d * q + m; for 8-bit q, m = 0). Only the rounding of x departs from the float32 product
// (measured ~4e-3 of the largest output on random inputs): a different model's arithmetic, which
// is why a model runs every row this way or none. Each row is rounded and summed alone and each
// panel runs on one thread, so a row's result does not depend on the rows or threads beside it: a
// Verify's rows equal their one-row decodes, a batched row its solo self.
//
// Weights: 4-bit, [P][K / 4][64] bytes, byte 4j + i of group g holds q[4g + i] of output j (low
// 4 bits) and of output j + 16 (high); 8-bit, [P][K / 4][128] bytes, byte 4j + i of each half of
// 64 holds q[4g + i] + 128 of output j of that half: VPDPBUSD multiplies unsigned by signed bytes,
// so the sum of an 8-bit block also holds 128 * sum(qx), which the row's block sum takes back off.
// Scales (and offsets) [P][K / 32][32], float32 or float16 (`half`).

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 32
#define BLOCK 32
// Rows a pass: 6 x 2 integer and 6 x 2 float sums, 24 of the 32 zmm (8 rows a pass: 8 rows of
// 576 -> 1536 took 38 against 31 us).
#define GROUP 6
// A thread's panels are consecutive (a static schedule): while it multiplies one, it asks for the
// panel AHEAD on into L2 (prefetcht1). Why: with a Verify's few rows a panel's sums take about as
// long as reading it from memory, and the hardware's own prefetching barely overlapped the two: 8
// products of 576 -> 1536 (4.4 MB, read from memory), 2 threads, 1 / 5 / 8 rows took 169 / 272 /
// 383 us without the hint, 139 / 195 / 322 with it (into L1 instead: less); SmolLM2's 5-row Verify
// and 8-decode steps at 550 cached tokens, 5.5% less. A hint changes no bits.
#define AHEAD 2
#define LINE 64  // bytes of a cache line

extern "C" int int8_built(void) { return 1; }

// One row x [K] -> levels q [K], dx and sx [K / 32], and each block's sum of levels qs [K / 32].
static void quantize(const float* x, long K, int8_t* q, float* dx, float* sx, int32_t* qs) {
    for (long b = 0; b < K / BLOCK; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * BLOCK), v1 = _mm512_loadu_ps(x + b * BLOCK + 16);
        const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inverse = _mm512_set1_ps(top > 0 ? 127.0f / top : 0.0f);
        const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, inverse), round);
        const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, inverse), round);
        _mm_storeu_si128((__m128i*)(q + b * BLOCK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(q + b * BLOCK + 16), _mm512_cvtepi32_epi8(q1));
        qs[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        dx[b] = top / 127.0f;
        sx[b] = dx[b] * (float)qs[b];
    }
}

// 16 of a block's scales or offsets as float32: stored as float32, or as float16 where every one
// is a float16 exactly (GGUF stores them so; a sixth fewer bytes for the 4-bit weights).
template <bool HALF>
static inline __m512 sixteen(const void* at, long i) {
    if (HALF) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)at + i)));
    return _mm512_loadu_ps((const float*)at + i);
}

// Both forms give each lane 4 unsigned bytes of weight levels against 4 signed bytes of qx.
struct Q4 {
    const uint8_t* packed;  // this panel's [K / 4][64]
    const void *scale, *offset;  // this panel's [K / 32][32]
    static constexpr int SHIFT = 0, GROUP_BYTES = 64;  // (of a group of 4 inputs)
    inline void group(long g, __m512i* w) const {  // inputs 4g .. 4g + 3 of outputs 0-15, 16-31
        const __m512i low = _mm512_set1_epi8(15), both = _mm512_loadu_si512(packed + g * GROUP_BYTES);
        w[0] = _mm512_and_si512(both, low);
        w[1] = _mm512_and_si512(_mm512_srli_epi16(both, 4), low);
    }
};

// 8-bit levels are stored as q + 128 (unsigned): the sums then hold 128 * sum(qx) too, which the
// row's block sums take back off (SHIFT: log2 128).
struct Q8 {
    const uint8_t* packed;  // this panel's [K / 4][128]
    const void* scale;  // this panel's [K / 32][32]
    const void* offset = nullptr;
    static constexpr int SHIFT = 7, GROUP_BYTES = 128;
    inline void group(long g, __m512i* w) const {
        w[0] = _mm512_loadu_si512(packed + g * GROUP_BYTES);
        w[1] = _mm512_loadu_si512(packed + g * GROUP_BYTES + 64);
    }
};

// The panel to prefetch (AHEAD): its levels, scales and offsets (levels and scales null: none; offsets
// null for 8-bit levels).
struct Next {
    const char *levels, *scale, *offset;
};

// Block b's scales and offsets of the panel `next` into L2.
template <bool HALF> static inline void prefetch_scales(const Next& next, long b) {
    if (next.scale == nullptr) return;
    const long bytes = PANEL * (HALF ? 2 : 4);
    for (long i = 0; i < bytes; i += LINE) {
        __builtin_prefetch(next.scale + b * bytes + i, 0, 2);
        if (next.offset) __builtin_prefetch(next.offset + b * bytes + i, 0, 2);
    }
}

// Group g's levels of the panel `next` into L2: spread over the groups, which keeps a one-row
// product's reads flowing (the block's lines at once gained nothing there).
template <class Form> static inline void prefetch_group(const Next& next, long g) {
    if (next.levels == nullptr) return;
    const char* at = next.levels + g * Form::GROUP_BYTES;
    for (long i = 0; i < Form::GROUP_BYTES; i += LINE) __builtin_prefetch(at + i, 0, 2);
}

template <int ROWS, bool HALF, class Form>
static inline void panel_rows(const Form& w, const Next& next, const int8_t* qx, const float* dx, const float* sx,
                              const int32_t* qs, long K, float* y, long N, long n0) {
    const long blocks = K / BLOCK;
    __m512 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        prefetch_scales<HALF>(next, b);
        __m512i sum[ROWS][2];
        for (int r = 0; r < ROWS; r++) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
        for (int g = 0; g < BLOCK / 4; g++) {
            __m512i lanes[2];
            w.group(b * (BLOCK / 4) + g, lanes);
            prefetch_group<Form>(next, b * (BLOCK / 4) + g);
            for (int r = 0; r < ROWS; r++) {
                const __m512i xs = _mm512_set1_epi32(*(const int32_t*)(qx + r * K + b * BLOCK + g * 4));
                sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], lanes[0], xs);
                sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], lanes[1], xs);
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m512 d = sixteen<HALF>(w.scale, b * PANEL + h * 16);
            for (int r = 0; r < ROWS; r++) {
                __m512i exact = sum[r][h];
                if (Form::SHIFT) exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(qs[r * blocks + b] << Form::SHIFT));
                const __m512 s = _mm512_cvtepi32_ps(exact);
                acc[r][h] = _mm512_fmadd_ps(d, _mm512_mul_ps(s, _mm512_set1_ps(dx[r * blocks + b])), acc[r][h]);
                if (w.offset)
                    acc[r][h] = _mm512_fmadd_ps(sixteen<HALF>(w.offset, b * PANEL + h * 16),
                                                _mm512_set1_ps(sx[r * blocks + b]), acc[r][h]);
            }
        }
    }
    const long valid = N - n0 < PANEL ? N - n0 : PANEL;
    for (int r = 0; r < ROWS; r++) {
        float out[PANEL];
        _mm512_storeu_ps(out, acc[r][0]);
        _mm512_storeu_ps(out + 16, acc[r][1]);
        memcpy(y + r * N + n0, out, valid * sizeof(float));
    }
}

// Every row of x (levels qx, dx, sx, qs as `quantize` left them) against one panel of w, GROUP rows
// a pass (the first prefetching `next`): out = y + the panel's first output n0, rows N apart.
template <bool HALF, class Form>
static void panel_all_rows(const Form& w, const Next& next, const int8_t* qx, const float* dx, const float* sx,
                           const int32_t* qs, long M, long K, float* y, long N, long n0) {
    const long blocks = K / BLOCK;
    for (long m = 0; m < M; m += GROUP) {
        const int8_t* q = qx + m * K;
        const float *d = dx + m * blocks, *s = sx + m * blocks;
        const int32_t* n = qs + m * blocks;
        float* out = y + m * N;
        const Next ahead = m == 0 ? next : Next{nullptr, nullptr, nullptr};
        switch (M - m < GROUP ? M - m : GROUP) {
            case 1: panel_rows<1, HALF>(w, ahead, q, d, s, n, K, out, N, n0); break;
            case 2: panel_rows<2, HALF>(w, ahead, q, d, s, n, K, out, N, n0); break;
            case 3: panel_rows<3, HALF>(w, ahead, q, d, s, n, K, out, N, n0); break;
            case 4: panel_rows<4, HALF>(w, ahead, q, d, s, n, K, out, N, n0); break;
            case 5: panel_rows<5, HALF>(w, ahead, q, d, s, n, K, out, N, n0); break;
            case 6: panel_rows<6, HALF>(w, ahead, q, d, s, n, K, out, N, n0); break;
        }
    }
}

// One product's weights as int8_products takes them (6 int64, layers.cpp's Linear): form (3 / 4:
// 4- / 8-bit, 5 / 6: the same with float16 scales), the 4-bit form's nibbles, scales, offsets (the
// 8-bit form's levels, scales, 0), its outputs N, and where its [M, N] result goes.
struct Part {
    long form, a, b, c, out, y;
};
enum { INT8_Q4 = 3, INT8_Q8 = 4, INT8_Q4_HALF = 5, INT8_Q8_HALF = 6 };

// Panel p (of its own N / 32) of one part against every row.
static void part_panel(const Part& part, long p, const int8_t* qx, const float* dx, const float* sx,
                       const int32_t* qs, long M, long K) {
    const unsigned char* packed = (const unsigned char*)part.a;
    const bool half = part.form == INT8_Q4_HALF || part.form == INT8_Q8_HALF;
    const long bytes = half ? 2 : 4;
    const char *scale = (const char*)part.b + p * K * bytes, *offset = (const char*)part.c + p * K * bytes;
    const bool q4 = part.form == INT8_Q4 || part.form == INT8_Q4_HALF;
    const long level_bytes = K * (q4 ? 16 : PANEL), scale_bytes = K * bytes;  // of one panel
    Next next = {nullptr, nullptr, nullptr};
    if (p + AHEAD < (part.out + PANEL - 1) / PANEL)
        next = {(const char*)packed + (p + AHEAD) * level_bytes, scale + AHEAD * scale_bytes,
                q4 ? offset + AHEAD * scale_bytes : nullptr};
    const auto rows = [&](const auto& w) {
        if (half)
            panel_all_rows<true>(w, next, qx, dx, sx, qs, M, K, (float*)part.y, part.out, p * PANEL);
        else
            panel_all_rows<false>(w, next, qx, dx, sx, qs, M, K, (float*)part.y, part.out, p * PANEL);
    };
    if (q4)
        rows(Q4{packed + p * level_bytes, scale, offset});
    else
        rows(Q8{packed + p * level_bytes, scale});
}

// The products of `count` parts with the same x [M, K]: x rounded once, and all their panels in one
// parallel loop (a layer's q / k / v, its gate / up: one barrier and one rounding instead of three
// or two). Each output is its own panel's sums over the same levels, so every part's result has the
// bits of its own product. 0, or -1 when the rows' levels could not be allocated (nothing written).
extern "C" int int8_products(const float* x, long M, long K, const long* table, long count) {
    const Part* parts = (const Part*)table;
    for (long i = 0; i < count; i++)
        if (parts[i].form < INT8_Q4 || parts[i].form > INT8_Q8_HALF) return -1;
    const long blocks = K / BLOCK;
    int8_t* qx = (int8_t*)malloc(M * K + 3 * sizeof(float) * M * blocks);
    if (qx == nullptr) return -1;
    float* dx = (float*)(qx + M * K);  // (M * K is a multiple of 32: aligned for floats)
    float* sx = dx + M * blocks;
    int32_t* qs = (int32_t*)(sx + M * blocks);
    long panels = 0;
    for (long i = 0; i < count; i++) panels += (parts[i].out + PANEL - 1) / PANEL;
    const auto round_row = [=](long r) {
        quantize(x + r * K, K, qx + r * K, dx + r * blocks, sx + r * blocks, qs + r * blocks);
    };
    // A decode's or Verify's few rows are rounded here, before the threads start: as one more
    // parallel loop they cost a barrier per product (210 a SmolLM2 decode), longer than the rounding.
    const bool few = M <= GROUP;
    if (few)
        for (long r = 0; r < M; r++) round_row(r);
#pragma omp parallel
    {
        if (!few) {
#pragma omp for schedule(static)
            for (long r = 0; r < M; r++) round_row(r);
        }
#pragma omp for schedule(static) nowait
        for (long g = 0; g < panels; g++) {
            long i = 0, p = g;  // panel p of part i
            for (long own; p >= (own = (parts[i].out + PANEL - 1) / PANEL); i++) p -= own;
            part_panel(parts[i], p, qx, dx, sx, qs, M, K);
        }
    }
    free(qx);
    return 0;
}

#else  // another compiler: unavailable

extern "C" int int8_built(void) { return 0; }
extern "C" int int8_products(const float*, long, long, const long*, long) { return -1; }

#endif
