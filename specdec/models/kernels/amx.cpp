// x @ W^T on AMX tiles for panels.cpp's 4- and 8-bit forms (Q4 / Q8: the same buffers), on CPUs
// that have the tiles (Intel Sapphire Rapids and later), for a prompt's many rows: called by
// specdec/models/panels.py (`amx_product`) and by layers.cpp for a call of prompts only.
//
// Why: the float32 FMAs of panels.cpp (and MKL's) run at ~200 GFLOPS on two cores, so a prompt's
// products cost ~0.5 ms a token on SmolLM2; AMX multiplies bfloat16 tiles into float32 sums at
// several times that. SmolLM2's compact linears at 300 rows on an AMX Xeon, MKL from float32
// against this (ms): 576 -> 1536 1.66 / 0.81, 1536 -> 576 1.63 / 0.98, 576 -> 576 0.58 / 0.42.
// At a few rows it is slower than panels.cpp (1 row 0.041 against 0.026 ms): decodes stay there.
//
// Still float32 arithmetic: each row of x is split exactly into three bfloat16 parts
// (x = hi + mid + lo, 8 + 8 + 8 significant bits), the levels q are bfloat16 exactly, so every
// product q * part is exact, and a tile sums each block of 32 inputs in float32, the three parts
// into one sum per output (hi's products, then mid's, then lo's); the output adds d * that sum
// (and m * sum(x) for Q4_1's offset) over the blocks in order. Within float32 noise of panels.cpp
// (each weight d * q + m rebuilt and FMA'd; measured 3-4x closer to a float64 product), not its
// bits: so decode and Verify rows never come here (a Verify row must equal its decode).
//
// Each tile row is one row of x against the block, whatever rows share the tile, and each panel
// runs on one thread: a row's result does not depend on the rows or threads beside it.
//
// Built by a compiler without AMX intrinsics (GCC before 11, clang), every entry point reports
// itself unavailable instead.

#if defined(__GNUC__) && !defined(__clang__) && defined(__has_include) && __has_include(<amxtileintrin.h>)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PANEL 32
#define BLOCK 32  // inputs per quantization block = one tile's depth in bfloat16 pairs
#define TILE 16   // rows of a full tile

// Linux hands out the tile registers' state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); once granted it holds for the whole process. 1 when granted.
extern "C" int amx_request(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

static inline __m512 widen_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One row x [K] -> its three bfloat16 parts (parts, parts + stride, parts + 2 stride; each rounded to
// nearest, the remainders exact in float32) and, when sums is given, its block sums [K / 32] in one
// fixed order.
static void split(const float* x, long K, uint16_t* parts, long stride, float* sums) {
    for (long i = 0; i < K; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        for (int part = 0; part < 3; part++) {
            __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
            _mm256_storeu_si256((__m256i*)(parts + part * stride + i), h);
            v = _mm512_sub_ps(v, widen_bf16(h));
        }
    }
    if (sums)
        for (long b = 0; b < K / BLOCK; b++)
            sums[b] = _mm512_reduce_add_ps(
                _mm512_add_ps(_mm512_loadu_ps(x + b * BLOCK), _mm512_loadu_ps(x + b * BLOCK + 16)));
}

// Row r of a levels tile holds each of its 16 outputs' weights at inputs 2r and 2r + 1 (words 2n
// and 2n + 1): here from 16 words of input 2r, then 16 of input 2r + 1.
static inline __m512i interleave(__m512i words) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, words);
}

// A block's levels for the panel's two halves of 16 outputs, as bfloat16 tile rows [2][16][32].
struct Q4Levels {
    const uint8_t* nibbles;  // [P][K][16]
    const float *scale, *offset;
    long K;
    inline void unpack(long p, long b, uint16_t* out) const {
        const uint8_t* panel = nibbles + p * K * 16;
        // bfloat16 of 0 .. 15 by table lookup (a word permute indexes 32 words)
        const __m512i table = _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0,
                                               0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0, 0x4170, 0x4160,
                                               0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0,
                                               0x4080, 0x4040, 0x4000, 0x3f80, 0);
        const __m256i low = _mm256_set1_epi8(15);
        for (int r = 0; r < BLOCK / 2; r++) {
            __m256i two = _mm256_loadu_si256((const __m256i*)(panel + (b * BLOCK + 2 * r) * 16));
            __m512i lo = _mm512_cvtepu8_epi16(_mm256_and_si256(two, low));
            __m512i hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(two, 4), low));
            _mm512_storeu_si512(out + r * 32, _mm512_permutexvar_epi16(interleave(lo), table));
            _mm512_storeu_si512(out + (16 + r) * 32, _mm512_permutexvar_epi16(interleave(hi), table));
        }
    }
};

struct Q8Levels {
    const int8_t* levels;  // [P][K][32]
    const float *scale, *offset;  // offset: null
    long K;
    inline void unpack(long p, long b, uint16_t* out) const {
        for (int r = 0; r < BLOCK / 2; r++)
            for (int half = 0; half < 2; half++) {
                const int8_t* at = levels + p * K * PANEL + (b * BLOCK + 2 * r) * PANEL + half * 16;
                __m512 even = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)at)));
                __m512 odd = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(at + PANEL))));
                __m512i words = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // even in words 0..15
                _mm512_storeu_si512(out + (half * 16 + r) * 32, interleave(words));
            }
    }
};

// Rows go 32 at a time, as two groups of 16 (tiles 0 / 1), against the two halves of a block's
// levels (tiles 2 / 3), summed into four tiles (4 / 5: group 0's halves, 6 / 7: group 1's): four
// independent sums keep the tile unit busy where one group's two would wait on each other.
struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void configure(int first, int second) {
    TileConfig config;
    memset(&config, 0, sizeof(config));
    config.palette = 1;
    const int rows[8] = {first, second, TILE, TILE, first, first, second, second};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = rows[t] ? rows[t] : 1;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

// One block's products for up to 32 rows (parts at a, the next part `stride` further) into the
// four sum tiles, the second group's only when it has rows: each part against both halves, hi then
// mid then lo.
static inline void block_tiles(const uint16_t* a, long stride, long K, const uint16_t* levels, bool second) {
    _tile_loadd(2, levels, 64);
    _tile_loadd(3, levels + 512, 64);
    _tile_zero(4);
    _tile_zero(5);
    if (second) {
        _tile_zero(6);
        _tile_zero(7);
    }
    for (int part = 0; part < 3; part++) {
        _tile_loadd(0, a + part * stride, K * 2);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (second) {
            _tile_loadd(1, a + part * stride + TILE * K, K * 2);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
}

static inline void store_tiles(float* sums, bool second) {
    _tile_stored(4, sums, 128);
    _tile_stored(5, sums + 16, 128);
    if (second) {
        _tile_stored(6, sums + TILE * 32, 128);
        _tile_stored(7, sums + TILE * 32 + 16, 128);
    }
}

// Up to 32 rows (m0 ..) of one panel: first + second rows, the second group empty or not. (Issuing
// block b + 1's products before scaling block b's sums was slower: the tiles are not renamed.)
template <bool OFFSETS>
static void rows_of_panel(const uint16_t* parts, long M, long K, long m0, int first, int second, const uint16_t* levels,
                          const float* scale, const float* offset, const float* block_sums, float* y, long N, long n0) {
    alignas(64) float acc[32 * 32];
    alignas(64) float sums[32 * 32];
    const int rows = first + second;
    const long blocks = K / BLOCK;
    memset(acc, 0, sizeof(float) * rows * 32);
    for (long b = 0; b < blocks; b++) {
        block_tiles(parts + m0 * K + b * BLOCK, M * K, K, levels + b * 1024, second);
        store_tiles(sums, second);
        const __m512 d0 = _mm512_loadu_ps(scale + b * PANEL), d1 = _mm512_loadu_ps(scale + b * PANEL + 16);
        __m512 o0 = _mm512_setzero_ps(), o1 = _mm512_setzero_ps();
        if (OFFSETS) o0 = _mm512_loadu_ps(offset + b * PANEL), o1 = _mm512_loadu_ps(offset + b * PANEL + 16);
        for (int i = 0; i < rows; i++) {
            float* row = acc + i * 32;
            __m512 a0 = _mm512_fmadd_ps(d0, _mm512_load_ps(sums + i * 32), _mm512_load_ps(row));
            __m512 a1 = _mm512_fmadd_ps(d1, _mm512_load_ps(sums + i * 32 + 16), _mm512_load_ps(row + 16));
            if (OFFSETS) {
                const __m512 sum = _mm512_set1_ps(block_sums[(m0 + i) * blocks + b]);
                a0 = _mm512_fmadd_ps(o0, sum, a0);
                a1 = _mm512_fmadd_ps(o1, sum, a1);
            }
            _mm512_store_ps(row, a0);
            _mm512_store_ps(row + 16, a1);
        }
    }
    const long valid = N - n0 < PANEL ? N - n0 : PANEL;
    for (int i = 0; i < rows; i++) memcpy(y + (m0 + i) * N + n0, acc + i * 32, valid * sizeof(float));
}

// A thread's panels go in batches whose unpacked levels fit in ~1 MB (its share of the L2 cache),
// each batch against every 32 rows in turn: the rows' parts (32 x 3 x K x 2 bytes) and the levels
// then stay in cache while the other is read.
#define BATCH_BYTES (1 << 20)

// 0, or -1 when a buffer could not be allocated (nothing written: the caller computes it another way).
template <class Levels>
static int run(const float* x, long M, long K, long N, float* y, const Levels& w) {
    const bool offsets = w.offset != nullptr;
    const long count = (N + PANEL - 1) / PANEL, blocks = K / BLOCK;
    const long batch = BATCH_BYTES / (K * PANEL * 2) > 0 ? BATCH_BYTES / (K * PANEL * 2) : 1;
    uint16_t* parts = (uint16_t*)malloc(sizeof(uint16_t) * 3 * M * K);
    float* block_sums = offsets ? (float*)malloc(sizeof(float) * M * blocks) : nullptr;
    int failed = parts == nullptr || (offsets && block_sums == nullptr);
    if (failed) {
        free(parts);
        free(block_sums);
        return -1;
    }
#pragma omp parallel
    {
        uint16_t* levels = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * batch * K * PANEL);
        if (levels == nullptr) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long r = 0; r < M; r++) split(x + r * K, K, parts + r * K, M * K, offsets ? block_sums + r * blocks : 0);
        // (the loop's barrier: every row split, every thread's buffer tried; after it `failed` holds)
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        const long first = count * me / threads, last = count * (me + 1) / threads;
        int configured = -1;  // rows of the tiles' current configuration
        for (long p0 = first; !failed && p0 < last; p0 += batch) {
            const long p1 = p0 + batch < last ? p0 + batch : last;
            for (long p = p0; p < p1; p++)
                for (long b = 0; b < blocks; b++) w.unpack(p, b, levels + ((p - p0) * blocks + b) * 1024);
            for (long m0 = 0; m0 < M; m0 += 32) {
                const int rows = M - m0 < 32 ? (int)(M - m0) : 32;
                const int one = rows < TILE ? rows : TILE, two = rows - one;
                if (rows != configured) configure(one, two), configured = rows;
                for (long p = p0; p < p1; p++) {
                    const uint16_t* at = levels + (p - p0) * blocks * 1024;
                    const float* scale = w.scale + p * K;
                    if (offsets)
                        rows_of_panel<true>(parts, M, K, m0, one, two, at, scale, w.offset + p * K, block_sums, y, N,
                                            p * PANEL);
                    else
                        rows_of_panel<false>(parts, M, K, m0, one, two, at, scale, nullptr, nullptr, y, N, p * PANEL);
                }
            }
        }
        if (configured >= 0) _tile_release();
        free(levels);
    }
    free(parts);
    free(block_sums);
    return failed ? -1 : 0;
}

extern "C" int amx_q4_product(const float* x, long M, long K, const unsigned char* nibbles, const float* scale,
                              const float* offset, long N, float* y) {
    return run(x, M, K, N, y, Q4Levels{nibbles, scale, offset, K});
}

extern "C" int amx_q8_product(const float* x, long M, long K, const signed char* levels, const float* scale, long N,
                              float* y) {
    return run(x, M, K, N, y, Q8Levels{(const int8_t*)levels, scale, nullptr, K});
}

#else  // no AMX intrinsics in this compiler: unavailable

extern "C" int amx_request(void) { return 0; }
extern "C" int amx_q4_product(const float*, long, long, const unsigned char*, const float*, const float*, long,
                              float*) {
    return -1;
}
extern "C" int amx_q8_product(const float*, long, long, const signed char*, const float*, long, float*) { return -1; }

#endif
