// x @ W^T for panels.cpp's 4- and 8-bit weights with x rounded to 8-bit blocks, the products in
// integers (AVX-512 VNNI): llama.cpp's arithmetic for GGUF's Q4_1 and Q8_0 weights (a Q8 row of x
// against each). Called by specdec/models/panels.py (`int8_product`) and by layers.cpp, for every
// row of a model whose `matmul_dtype` is int8 (specdec/models/cpu_layout.py): decodes, Verify rows,
// prompts and the head alike, never mixed with the float32 forms in one model.
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
// 4 bits) and of output j + 16 (high); 8-bit, [P][K / 4][128] int8, byte 4j + i of each half of
// 64 holds q[4g + i] of output j of that half, with each block's sum of q per output ([P][K / 32]
// [32] int32): VPDPBUSD multiplies unsigned by signed bytes, so 8-bit rows go as qx + 128 and the
// sum takes 128 * sum(q) back off.

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

extern "C" int int8_built(void) { return 1; }

// One row x [K] -> levels q [K], dx and sx [K / 32].
static void quantize(const float* x, long K, int8_t* q, float* dx, float* sx) {
    for (long b = 0; b < K / BLOCK; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * BLOCK), v1 = _mm512_loadu_ps(x + b * BLOCK + 16);
        const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inverse = _mm512_set1_ps(top > 0 ? 127.0f / top : 0.0f);
        const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, inverse), round);
        const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, inverse), round);
        _mm_storeu_si128((__m128i*)(q + b * BLOCK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(q + b * BLOCK + 16), _mm512_cvtepi32_epi8(q1));
        dx[b] = top / 127.0f;
        sx[b] = dx[b] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

struct Q4 {
    const uint8_t* packed;  // this panel's [K / 4][64]
    const float *scale, *offset;
    static constexpr bool SIGNED_X = true;
    // A group of 4 inputs: outputs 0-15 and 16-31 as unsigned levels.
    inline void group(long g, __m512i* w) const {
        const __m512i low = _mm512_set1_epi8(15), both = _mm512_loadu_si512(packed + g * 64);
        w[0] = _mm512_and_si512(both, low);
        w[1] = _mm512_and_si512(_mm512_srli_epi16(both, 4), low);
    }
    inline __m512i correction(long, int) const { return _mm512_setzero_si512(); }
};

struct Q8 {
    const int8_t* packed;  // this panel's [K / 4][128]
    const float* scale;
    const int32_t* sums;  // this panel's [K / 32][32]
    const float* offset = nullptr;
    static constexpr bool SIGNED_X = false;
    inline void group(long g, __m512i* w) const {
        w[0] = _mm512_loadu_si512(packed + g * 128);
        w[1] = _mm512_loadu_si512(packed + g * 128 + 64);
    }
    inline __m512i correction(long b, int half) const {  // 128 * sum(q): what qx + 128 added
        return _mm512_slli_epi32(_mm512_loadu_si512(sums + b * PANEL + half * 16), 7);
    }
};

template <int ROWS, class W>
static inline void panel_rows(const W& w, const int8_t* qx, const float* dx, const float* sx, long K, float* y, long N,
                              long n0) {
    const long blocks = K / BLOCK;
    __m512 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi32((int)0x80808080u);  // qx + 128 as unsigned bytes
    for (long b = 0; b < blocks; b++) {
        __m512i sum[ROWS][2];
        for (int r = 0; r < ROWS; r++) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
        for (int g = 0; g < BLOCK / 4; g++) {
            __m512i lanes[2];
            w.group(b * (BLOCK / 4) + g, lanes);
            for (int r = 0; r < ROWS; r++) {
                const __m512i xs = _mm512_set1_epi32(*(const int32_t*)(qx + r * K + b * BLOCK + g * 4));
                for (int h = 0; h < 2; h++)
                    sum[r][h] = W::SIGNED_X ? _mm512_dpbusd_epi32(sum[r][h], lanes[h], xs)
                                            : _mm512_dpbusd_epi32(sum[r][h], _mm512_xor_si512(xs, flip), lanes[h]);
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m512 d = _mm512_loadu_ps(w.scale + b * PANEL + h * 16);
            const __m512i back = w.correction(b, h);
            for (int r = 0; r < ROWS; r++) {
                const __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r][h], back));
                acc[r][h] = _mm512_fmadd_ps(d, _mm512_mul_ps(s, _mm512_set1_ps(dx[r * blocks + b])), acc[r][h]);
                if (w.offset)
                    acc[r][h] = _mm512_fmadd_ps(_mm512_loadu_ps(w.offset + b * PANEL + h * 16),
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

// 0, or -1 when the rows' levels could not be allocated (nothing written).
template <class MakeW>
static int run(const float* x, long M, long K, long N, float* y, MakeW make) {
    const long blocks = K / BLOCK, count = (N + PANEL - 1) / PANEL;
    int8_t* qx = (int8_t*)malloc(M * K + 2 * sizeof(float) * M * blocks);
    if (qx == nullptr) return -1;
    float* dx = (float*)(qx + M * K);  // (M * K is a multiple of 32: aligned for floats)
    float* sx = dx + M * blocks;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (long r = 0; r < M; r++) quantize(x + r * K, K, qx + r * K, dx + r * blocks, sx + r * blocks);
#pragma omp for schedule(static)
        for (long p = 0; p < count; p++) {
            const auto w = make(p);
            for (long m = 0; m < M; m += GROUP) {
                const int8_t* q = qx + m * K;
                const float *d = dx + m * blocks, *s = sx + m * blocks;
                float* out = y + m * N;
                switch (M - m < GROUP ? M - m : GROUP) {
                    case 1: panel_rows<1>(w, q, d, s, K, out, N, p * PANEL); break;
                    case 2: panel_rows<2>(w, q, d, s, K, out, N, p * PANEL); break;
                    case 3: panel_rows<3>(w, q, d, s, K, out, N, p * PANEL); break;
                    case 4: panel_rows<4>(w, q, d, s, K, out, N, p * PANEL); break;
                    case 5: panel_rows<5>(w, q, d, s, K, out, N, p * PANEL); break;
                    case 6: panel_rows<6>(w, q, d, s, K, out, N, p * PANEL); break;
                }
            }
        }
    }
    free(qx);
    return 0;
}

extern "C" int int8_q4_product(const float* x, long M, long K, const unsigned char* packed, const float* scale,
                               const float* offset, long N, float* y) {
    return run(x, M, K, N, y, [=](long p) { return Q4{packed + p * K * 16, scale + p * K, offset + p * K}; });
}

extern "C" int int8_q8_product(const float* x, long M, long K, const signed char* packed, const float* scale,
                               const int* sums, long N, float* y) {
    return run(x, M, K, N, y, [=](long p) {
        return Q8{(const int8_t*)packed + p * K * PANEL, scale + p * K, (const int32_t*)sums + p * K};
    });
}

#else  // another compiler: unavailable

extern "C" int int8_built(void) { return 0; }
extern "C" int int8_q4_product(const float*, long, long, const unsigned char*, const float*, const float*, long,
                               float*) {
    return -1;
}
extern "C" int int8_q8_product(const float*, long, long, const signed char*, const float*, const int*, long, float*) {
    return -1;
}

#endif
