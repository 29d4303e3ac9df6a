// x @ W^T for panels.cpp's 4- and 8-bit weights with x rounded to 8-bit blocks, the products in
// integers: llama.cpp's arithmetic for GGUF's Q4_1 and Q8_0 weights (a Q8 row of x against each).
// Called by specdec/models/panels.py (`product` of an int8 form) and by layers.cpp, for every row a
// linear with such weights computes in a model whose `matmul_dtype` is int8
// (specdec/models/cpu_layout.py): decodes, Verify rows, prompts and the head alike.
//
// Why: a float32 product of rows spends one FMA per weight and row (16 a cycle at best); VPDPBUSD
// (AVX-512 VNNI) sums 4 byte products into each of 16 int32 lanes per instruction (64). SmolLM2's
// 576 -> 1536 projection on an AVX-512 EPYC, 2 threads: 1 / 5 / 8 / 64 rows 25 / 58 / 83 / 650 us
// from the 4-bit copy in float32 (panels.cpp) against 7 / 19 / 31 / 209 here. Without VNNI, AVX2's
// VPMADDUBSW + VPMADDWD compute the same integer sums 8 lanes at a time (`avx2` below): on an AVX2
// EPYC the float32 4-bit copy spent ~3 ms a row of a forward unpacking and multiplying weights.
//
// What a row computes. Each block of 32 inputs of x becomes dx = max|x| / 127 and levels
// qx = round(x / dx) in -127..127 (sx = dx * sum(qx)); an output then adds, block by block in
// order, d * (dx * S) + m * sx, S the exact integer sum of q * qx over the block (4-bit q, w =
// d * q + m; for 8-bit q, m = 0). Only the rounding of x departs from the float32 product
// (measured ~4e-3 of the largest output on random inputs): a different model's arithmetic, which
// is why a model runs every row this way or none. Each row is rounded and summed alone and each
// panel runs on one thread, so a row's result does not depend on the rows or threads beside it: a
// Verify's rows equal their one-row decodes, a batched row its solo self. Both instruction sets
// compute these same numbers (exact integer sums, then the same float32 operations in the same
// order), so which one runs (`int8_use_vnni`) changes no bits.
//
// Weights: 4-bit, [P][K / 4][64] bytes, byte 4j + i of group g holds q[4g + i] of output j (low
// 4 bits) and of output j + 16 (high); 8-bit, [P][K / 4][128] bytes, byte 4j + i of each half of
// 64 holds q[4g + i] + 128 of output j of that half: VPDPBUSD multiplies unsigned by signed bytes,
// so the sum of an 8-bit block also holds 128 * sum(qx), which the row's block sum takes back off.
// Scales (and offsets) [P][K / 32][32], float32 or float16 (`half`).

#if defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 32
#define BLOCK 32
// A thread's panels are consecutive (a static schedule): while it multiplies one, it asks for the
// panel AHEAD on into L2 (prefetcht1). Why: with a Verify's few rows a panel's sums take about as
// long as reading it from memory, and the hardware's own prefetching barely overlapped the two: 8
// products of 576 -> 1536 (4.4 MB, read from memory), 2 threads, 1 / 5 / 8 rows took 169 / 272 /
// 383 us without the hint, 139 / 195 / 322 with it (into L1 instead: less); SmolLM2's 5-row Verify
// and 8-decode steps at 550 cached tokens, 5.5% less. A hint changes no bits.
#define AHEAD 2
#define LINE 64  // bytes of a cache line

extern "C" int int8_built(void) { return 1; }

// Which instructions the products run (panels.py sets it from the CPU's flags as it loads the
// library; the default, AVX2, runs on every CPU that loads the library at all).
static int use_vnni = 0;
extern "C" void int8_use_vnni(int on) { use_vnni = on; }

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

// ------------------------------------------------------------------ AVX-512 VNNI

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace vnni {

// Rows a pass: 6 x 2 integer and 6 x 2 float sums, 24 of the 32 zmm (8 rows a pass: 8 rows of
// 576 -> 1536 took 38 against 31 us).
constexpr int GROUP = 6;

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

template <int ROWS, bool HALF, class Form>
static void panel_rows(const Form& w, const Next& next, const int8_t* qx, const float* dx, const float* sx,
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

}  // namespace vnni
#pragma GCC pop_options

// ------------------------------------------------------------------ AVX2

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

// Rows a pass, and how a pass covers a panel's outputs (4 vectors of 8): up to WHOLE rows take
// all 4 in one pass, 4 integer sums a row; more take half of them (the bytes of half of each group)
// a pass, 2 sums a row, the second half reading the panel from cache. Past 2 rows whole or 5 in
// halves the sums outgrow the 16 ymm and some spill to the stack; measured regardless, on SmolLM2's
// steps at 550 cached tokens on an AVX2 EPYC: against 2 rows a pass of all 4 at every row count,
// halves throughout were 7-17% slower at 1-2 rows and 7-9% faster at 5; against halves, whole
// passes of 3 rows 0.87-0.93x, of 4 0.94-1.04x a step (the products alone 0.92x), of 5 and 6 rows
// 1.10x and 1.09x (the products alone). Two passes over a panel (GROUP 3-5) were slower still.
constexpr int GROUP = 6, WHOLE = 4;

// vnni::quantize, 8 lanes at a time: the same levels, sums and scales.
static void quantize(const float* x, long K, int8_t* q, float* dx, float* sx, int32_t* qs) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (long b = 0; b < K / BLOCK; b++) {
        __m256 v[4], top8 = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * BLOCK + 8 * i);
            top8 = _mm256_max_ps(top8, _mm256_and_ps(v[i], magnitude));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, top8);
        float top = lanes[0];
        for (int i = 1; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
        const __m256 inverse = _mm256_set1_ps(top > 0 ? 127.0f / top : 0.0f);
        __m256i levels[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {  // nearest, ties to even, as vnni's rounding mode
            const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            const __m256 scaled = _mm256_round_ps(_mm256_mul_ps(v[i], inverse), nearest);
            levels[i] = _mm256_cvttps_epi32(scaled);  // (integral already: exact)
            total = _mm256_add_epi32(total, levels[i]);
        }
        // 32 int32 in -127..127 -> 32 int8 in order (the packs work within 128-bit lanes).
        const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(levels[0], levels[1]),
                                                 _mm256_packs_epi32(levels[2], levels[3]));
        _mm256_storeu_si256((__m256i*)(q + b * BLOCK),
                            _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        int32_t sums[8];
        _mm256_storeu_si256((__m256i*)sums, total);
        qs[b] = sums[0] + sums[1] + sums[2] + sums[3] + sums[4] + sums[5] + sums[6] + sums[7];
        dx[b] = top / 127.0f;
        sx[b] = dx[b] * (float)qs[b];
    }
}

// 8 of a block's scales or offsets as float32 (vnni::sixteen's half).
template <bool HALF>
static inline __m256 eight(const void* at, long i) {
    if (HALF) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)at + i)));
    return _mm256_loadu_ps((const float*)at + i);
}

// The same bytes as vnni's forms, half a group at a time as 2 vectors of 8 lanes, each lane 4
// bytes of weight levels of one output (`FIRST`: the first output of each vector). 4-bit levels
// (0..15) multiply qx in VPMADDUBSW's 16-bit pairs without saturating (2 x 15 x 127), and a block's
// 8 groups sum there too (8 x 3,810 < 32,767): one VPMADDWD a block. 8-bit levels go as |q|
// against qx with q's sign (2 x 128 x 127 < 32,767): the sum of q * qx itself (no 128 * sum(qx) to
// take off), one VPMADDWD a group.
struct Q4 {
    const uint8_t* packed;
    const void *scale, *offset;
    static constexpr int GROUP_BYTES = 64;
    static constexpr bool BLOCK_SUMS = true;  // 16-bit sums over a block's groups
    static constexpr int FIRST[2][2] = {{0, 16}, {8, 24}};  // bytes 32h + 4j + i: outputs 8h + j, 16 + 8h + j
    inline void half(long g, int h, __m256i* w) const {
        const __m256i low = _mm256_set1_epi8(15);
        const __m256i both = _mm256_loadu_si256((const __m256i*)(packed + g * GROUP_BYTES + 32 * h));
        w[0] = _mm256_and_si256(both, low);
        w[1] = _mm256_and_si256(_mm256_srli_epi16(both, 4), low);
    }
    static inline __m256i pairs(__m256i w, __m256i x) { return _mm256_maddubs_epi16(w, x); }
};

struct Q8 {
    const uint8_t* packed;
    const void* scale;
    const void* offset = nullptr;
    static constexpr int GROUP_BYTES = 128;
    static constexpr bool BLOCK_SUMS = false;
    static constexpr int FIRST[2][2] = {{0, 8}, {16, 24}};  // bytes 64h + 4j + i: output 16h + j
    inline void half(long g, int h, __m256i* w) const {  // q itself (q + 128 with its top bit flipped)
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int v = 0; v < 2; v++)
            w[v] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(packed + g * GROUP_BYTES + 64 * h + 32 * v)),
                                    flip);
    }
    static inline __m256i pairs(__m256i w, __m256i x) {
        return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));  // |-128| reads as 128
    }
};

// HALVES halves of a panel's outputs from half h0 on (2 vectors each) for ROWS rows; the pass
// from the first half prefetches `next`.
template <int ROWS, int HALVES, bool HALF, class Form>
static inline void pass_rows(const Form& w, int h0, const Next& next, const int8_t* qx, const float* dx,
                             const float* sx, long K, float* y, long N, long n0) {
    constexpr int V = 2 * HALVES;
    const long blocks = K / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROWS][V];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < V; v++) acc[r][v] = _mm256_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        if (h0 == 0) prefetch_scales<HALF>(next, b);
        __m256i sum[ROWS][V];  // 16-bit pair sums (Q4) or int32 sums (Q8)
        for (int r = 0; r < ROWS; r++)
            for (int v = 0; v < V; v++) sum[r][v] = _mm256_setzero_si256();
        for (int g = 0; g < BLOCK / 4; g++) {
            __m256i lanes[V];
            for (int i = 0; i < HALVES; i++) w.half(b * (BLOCK / 4) + g, h0 + i, lanes + 2 * i);
            if (h0 == 0) prefetch_group<Form>(next, b * (BLOCK / 4) + g);
            for (int r = 0; r < ROWS; r++) {
                const __m256i xs = _mm256_set1_epi32(*(const int32_t*)(qx + r * K + b * BLOCK + g * 4));
                for (int v = 0; v < V; v++) {
                    const __m256i p = Form::pairs(lanes[v], xs);
                    sum[r][v] = Form::BLOCK_SUMS ? _mm256_add_epi16(sum[r][v], p)
                                                 : _mm256_add_epi32(sum[r][v], _mm256_madd_epi16(p, ones));
                }
            }
        }
        for (int v = 0; v < V; v++) {
            const long first = b * PANEL + Form::FIRST[h0 + v / 2][v % 2];
            const __m256 d = eight<HALF>(w.scale, first);
            for (int r = 0; r < ROWS; r++) {
                const __m256i exact = Form::BLOCK_SUMS ? _mm256_madd_epi16(sum[r][v], ones) : sum[r][v];
                const __m256 s = _mm256_cvtepi32_ps(exact);
                acc[r][v] = _mm256_fmadd_ps(d, _mm256_mul_ps(s, _mm256_set1_ps(dx[r * blocks + b])), acc[r][v]);
                if (w.offset)
                    acc[r][v] = _mm256_fmadd_ps(eight<HALF>(w.offset, first), _mm256_set1_ps(sx[r * blocks + b]),
                                                acc[r][v]);
            }
        }
    }
    const long valid = N - n0 < PANEL ? N - n0 : PANEL;
    for (int v = 0; v < V; v++) {
        const long first = Form::FIRST[h0 + v / 2][v % 2], count = valid - first < 8 ? valid - first : 8;
        for (int r = 0; r < ROWS && count > 0; r++) {
            float out[8];
            _mm256_storeu_ps(out, acc[r][v]);
            memcpy(y + r * N + n0 + first, out, count * sizeof(float));
        }
    }
}

template <int ROWS, bool HALF, class Form>
static void panel_rows(const Form& w, const Next& next, const int8_t* qx, const float* dx, const float* sx,
                       const int32_t*, long K, float* y, long N, long n0) {
    if constexpr (ROWS <= WHOLE) {
        pass_rows<ROWS, 2, HALF>(w, 0, next, qx, dx, sx, K, y, N, n0);
    } else {
        pass_rows<ROWS, 1, HALF>(w, 0, next, qx, dx, sx, K, y, N, n0);
        pass_rows<ROWS, 1, HALF>(w, 1, next, qx, dx, sx, K, y, N, n0);
    }
}

}  // namespace avx2
#pragma GCC pop_options

// ------------------------------------------------------------------ either

// The instruction sets' kernels as template arguments.
struct Vnni {
    static constexpr int GROUP = vnni::GROUP;
    using Q4 = vnni::Q4;
    using Q8 = vnni::Q8;
    static void quantize(const float* x, long K, int8_t* q, float* dx, float* sx, int32_t* qs) {
        vnni::quantize(x, K, q, dx, sx, qs);
    }
    template <int ROWS, bool HALF, class Form> static void rows(const Form& w, const Next& next, const int8_t* qx,
                                                                const float* dx, const float* sx, const int32_t* qs,
                                                                long K, float* y, long N, long n0) {
        vnni::panel_rows<ROWS, HALF>(w, next, qx, dx, sx, qs, K, y, N, n0);
    }
};
struct Avx2 {
    static constexpr int GROUP = avx2::GROUP;
    using Q4 = avx2::Q4;
    using Q8 = avx2::Q8;
    static void quantize(const float* x, long K, int8_t* q, float* dx, float* sx, int32_t* qs) {
        avx2::quantize(x, K, q, dx, sx, qs);
    }
    template <int ROWS, bool HALF, class Form> static void rows(const Form& w, const Next& next, const int8_t* qx,
                                                                const float* dx, const float* sx, const int32_t* qs,
                                                                long K, float* y, long N, long n0) {
        avx2::panel_rows<ROWS, HALF>(w, next, qx, dx, sx, qs, K, y, N, n0);
    }
};

// `count` (1 .. ROWS) rows against one panel: the kernel of exactly that many rows.
template <class ISA, bool HALF, class Form, int ROWS = ISA::GROUP>
static inline void some_rows(int count, const Form& w, const Next& next, const int8_t* qx, const float* dx,
                             const float* sx, const int32_t* qs, long K, float* y, long N, long n0) {
    if constexpr (ROWS > 1)
        if (count < ROWS) return some_rows<ISA, HALF, Form, ROWS - 1>(count, w, next, qx, dx, sx, qs, K, y, N, n0);
    ISA::template rows<ROWS, HALF>(w, next, qx, dx, sx, qs, K, y, N, n0);
}

// Every row of x (levels qx, dx, sx, qs as `quantize` left them) against one panel of w, GROUP rows
// a pass (the first prefetching `next`): out = y + the panel's first output n0, rows N apart.
template <class ISA, bool HALF, class Form>
static void panel_all_rows(const Form& w, const Next& next, const int8_t* qx, const float* dx, const float* sx,
                           const int32_t* qs, long M, long K, float* y, long N, long n0) {
    const long blocks = K / BLOCK;
    for (long m = 0; m < M; m += ISA::GROUP) {
        const Next ahead = m == 0 ? next : Next{nullptr, nullptr, nullptr};
        const int count = M - m < ISA::GROUP ? M - m : ISA::GROUP;
        some_rows<ISA, HALF>(count, w, ahead, qx + m * K, dx + m * blocks, sx + m * blocks, qs + m * blocks, K,
                             y + m * N, N, n0);
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
template <class ISA>
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
            panel_all_rows<ISA, true>(w, next, qx, dx, sx, qs, M, K, (float*)part.y, part.out, p * PANEL);
        else
            panel_all_rows<ISA, false>(w, next, qx, dx, sx, qs, M, K, (float*)part.y, part.out, p * PANEL);
    };
    if (q4)
        rows(typename ISA::Q4{packed + p * level_bytes, scale, offset});
    else
        rows(typename ISA::Q8{packed + p * level_bytes, scale});
}

// int8_products in one instruction set's kernels.
template <class ISA> static int products(const float* x, long M, long K, const Part* parts, long count) {
    const long blocks = K / BLOCK;
    int8_t* qx = (int8_t*)malloc(M * K + 3 * sizeof(float) * M * blocks);
    if (qx == nullptr) return -1;
    float* dx = (float*)(qx + M * K);  // (M * K is a multiple of 32: aligned for floats)
    float* sx = dx + M * blocks;
    int32_t* qs = (int32_t*)(sx + M * blocks);
    long panels = 0;
    for (long i = 0; i < count; i++) panels += (parts[i].out + PANEL - 1) / PANEL;
    const auto round_row = [=](long r) {
        ISA::quantize(x + r * K, K, qx + r * K, dx + r * blocks, sx + r * blocks, qs + r * blocks);
    };
    // A decode's or Verify's few rows (up to 6) are rounded here, before the threads start: as one
    // more parallel loop they cost a barrier per product (210 a SmolLM2 decode), longer than the rounding.
    const bool few = M <= 6;
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
            part_panel<ISA>(parts[i], p, qx, dx, sx, qs, M, K);
        }
    }
    free(qx);
    return 0;
}

// The products of `count` parts with the same x [M, K]: x rounded once, and all their panels in one
// parallel loop (a layer's q / k / v, its gate / up: one barrier and one rounding instead of three
// or two). Each output is its own panel's sums over the same levels, so every part's result has the
// bits of its own product. 0, or -1 when the rows' levels could not be allocated (nothing written).
extern "C" int int8_products(const float* x, long M, long K, const long* table, long count) {
    const Part* parts = (const Part*)table;
    for (long i = 0; i < count; i++)
        if (parts[i].form < INT8_Q4 || parts[i].form > INT8_Q8_HALF) return -1;
    return use_vnni ? products<Vnni>(x, M, K, parts, count) : products<Avx2>(x, M, K, parts, count);
}

#else  // another compiler: unavailable

extern "C" int int8_built(void) { return 0; }
extern "C" void int8_use_vnni(int) {}
extern "C" int int8_products(const float*, long, long, const long*, long) { return -1; }

#endif
