// Attention of a ragged batch's short segments (decode and Verify rows; on AMX hosts also prompts,
// layers.cpp) against their sessions' cached keys/values, all segments and heads in one call.
// Built with panels.cpp into one library by specdec/models/panels.py; called by
// specdec/models/ragged.py.
//
// Why: per segment and layer, the Python around SDPA (cache append, mask, kernel checks) cost more
// than the attention did: 8 decodes of 400 cached tokens spent 23.6 of a 48 ms step (SmolLM2-135M,
// 2 threads) in 240 small SDPA calls. Here one call per layer appends every segment's new
// keys/values to its cache buffer and attends every (segment, key/value head) pair, the query
// heads that share a key/value head together, so each key and value is read once for them. A
// session forked from another (`kv_cache.fork_cache`) reads the shared prefix's buffer for its
// first positions and its own for the rest, in the same order and arithmetic as one buffer.
//
// Each (row, head) is computed by one thread, in one order: its scores q . k_j over positions
// 0 .. past + i (causal; row i of the segment is position past + i), exp(s - max) (a vector exp),
// their sum and the weighted sum of values, each accumulated in position order. So a row's result
// does not depend on the rows, segments or threads beside it: a decode batched with others gives
// the bits it gives alone, and a Verify row the bits of its own one-row decode.
//
// A cache holds float32 or float16 keys/values (`kv_half`; the services' KV_CACHE_DTYPE): float16
// halves what a step reads, and attention over the cache is bound by that (8 decodes of 400 cached
// tokens: a third of the step). New rows are rounded to float16 (to nearest even) as they are
// appended, and every row, the new ones included, reads them back from the cache, so the
// arithmetic is the same in a prompt, a Verify and a decode.

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"  // v8 / v16, WIDEST: a head of d floats uses the widest vector that divides
                          // d (SmolLM2's 64: four of 16); exp_neg

#define MAX_ROWS 4  // query rows a pass attends
#define AHEAD 32    // positions ahead whose keys / values are prefetched
#define LINE 64     // bytes of a cache line (prefetches)

// W vectors -> one vector of their lane sums, lane i the sum of vector BITREV[i] (so feed position
// BITREV[i] in slot i for sums in position order). Each vector's lanes go through the same tree
// whatever its neighbours (at each level, lane i plus lane i + half within its block): a position's
// score is the same bits in any group.
#define HALVES(x, y, lo, hi) (__builtin_shufflevector(x, y, lo) + __builtin_shufflevector(x, y, hi))
static const int BITREV8[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#define LO_8_8 0, 1, 2, 3, 8, 9, 10, 11
#define HI_8_8 4, 5, 6, 7, 12, 13, 14, 15
#define LO_8_4 0, 1, 8, 9, 4, 5, 12, 13
#define HI_8_4 2, 3, 10, 11, 6, 7, 14, 15
#define LO_8_2 0, 8, 2, 10, 4, 12, 6, 14
#define HI_8_2 1, 9, 3, 11, 5, 13, 7, 15
static inline v8 lane_sums(const v8* v) {
    v8 a[4], b[2];
    for (int i = 0; i < 4; i++) a[i] = HALVES(v[2 * i], v[2 * i + 1], LO_8_8, HI_8_8);
    for (int i = 0; i < 2; i++) b[i] = HALVES(a[2 * i], a[2 * i + 1], LO_8_4, HI_8_4);
    return HALVES(b[0], b[1], LO_8_2, HI_8_2);
}

#if defined(__AVX512F__)
static const int BITREV16[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#define LO_16_16 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI_16_16 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO_16_8 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HI_16_8 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LO_16_4 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HI_16_4 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LO_16_2 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HI_16_2 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
static inline v16 lane_sums(const v16* v) {
    v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = HALVES(v[2 * i], v[2 * i + 1], LO_16_16, HI_16_16);
    for (int i = 0; i < 4; i++) b[i] = HALVES(a[2 * i], a[2 * i + 1], LO_16_8, HI_16_8);
    for (int i = 0; i < 2; i++) c[i] = HALVES(b[2 * i], b[2 * i + 1], LO_16_4, HI_16_4);
    return HALVES(c[0], c[1], LO_16_2, HI_16_2);
}
#endif

template <class V> struct Lanes;
template <> struct Lanes<v8> {
    static constexpr int width = 8;
    static const int* bitrev() { return BITREV8; }
};
#if defined(__AVX512F__)
template <> struct Lanes<v16> {
    static constexpr int width = 16;
    static const int* bitrev() { return BITREV16; }
};
#endif

// An unaligned load (a vector type loses its alignment attribute as a template argument, and a
// plain dereference would then assume its full alignment).
template <class V> static inline V load(const float* from) {
    V v;
    memcpy(&v, from, sizeof(v));
    return v;
}

// A cached key/value: float32 as stored, or float16 (its bits, `half`) widened exactly.
typedef unsigned short half;
template <class V> static inline V load(const half* from);
template <> inline v8 load<v8>(const half* from) {
    return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)from));
}
#if defined(__AVX512F__)
template <> inline v16 load<v16>(const half* from) {
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)from));
}
#endif

// dim (a multiple of 8) floats into a cache of float32 (copied) or float16 (rounded to nearest even).
static inline void store(float* to, const float* from, long dim) { memcpy(to, from, dim * sizeof(float)); }
static inline void store(half* to, const float* from, long dim) {
    for (long i = 0; i < dim; i += 8)
        _mm_storeu_si128((__m128i*)(to + i), _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT));
}

struct Segment {  // as ragged.py lays out its int64 table, one row per segment (SEGMENT_COLUMNS longs)
    long start;   // its first row in the batch
    long rows;    // its new rows (positions past .. past + rows - 1)
    long past;    // positions its cache held before this step, a shared prefix's included
    long keys;    // address of its own key buffer, [kv heads][capacity][dim] float32: the positions
    long values;  // after the prefix; values likewise
    long capacity;
    long prefix_keys;  // a shared prefix's keys (positions 0 .. prefix_len - 1), [kv heads][prefix_capacity][dim],
    long prefix_values;  // read only; values likewise; all four 0 without one
    long prefix_capacity;
    long prefix_len;
};

// Where a head's keys (or values) of each position lie: a shared prefix's buffer, then its own;
// S: what the cache stores (float or half).
template <class S> struct Span {
    const S* prefix;
    long prefix_len;
    const S* own;
    long dim;
    const S* at(long j) const { return j < prefix_len ? prefix + j * dim : own + (j - prefix_len) * dim; }
};

struct Row {         // one query row of one head
    const float* q;  // its head_dim floats
    float* out;      // where its output goes
    long seen;       // positions it attends: 0 .. seen - 1
};

// Each row's weights over positions 0 .. last - 1 in place of its scores (scores + r * stride):
// exp(s - max) over its own positions, zero past them; returns their sums in total.
template <class V, int ROWS>
static void softmax_weights(const Row* rows, long last, float* scores, long stride, float* total) {
    const int W = Lanes<V>::width;
    for (int r = 0; r < ROWS; r++) {
        float* s = scores + r * stride;
        const long seen = rows[r].seen;
        const long padded = (seen + W - 1) / W * W;
        for (long j = seen; j < padded; j++) s[j] = s[seen - 1];  // finite, and zeroed below
        V top = load<V>(s);
        for (long j = W; j < padded; j += W) top = max_of(top, load<V>(s + j));
        float m = top[0];
        for (int i = 1; i < W; i++) m = top[i] > m ? top[i] : m;
        for (long j = 0; j < padded; j += W) {
            V e = exp_neg(load<V>(s + j) - m);
            memcpy(s + j, &e, sizeof(e));
        }
        for (long j = seen; j < (padded > last ? padded : last); j++) s[j] = 0.0f;
        V sum = {};
        for (long j = 0; j < padded; j += W) sum += load<V>(s + j);
        float t = 0.0f;
        for (int i = 0; i < W; i++) t += sum[i];
        total[r] = t;
    }
}

// The vectors of a head whose value sums a pass keeps at once (CHUNK, a divisor of VECS): as many as
// keep ROWS rows' accumulators and the values beside them in the registers (AVX-512's 32 hold a
// SmolLM2 head's 4 vectors for 4 rows; AVX2's 16, 2 of its 8), the positions' weights and values
// read again for each further chunk. So a pass attends MAX_ROWS rows on either, each key read and
// widened once for all of them. Each output lane sums its positions in order whatever the chunks:
// they do not change a row's bits.
static constexpr int chunk_vecs(int vecs, int rows, int width) {
    const int registers = width == 8 ? 16 : 32;
    int chunk = vecs;
    while (chunk > 1 && ((rows + 1) * chunk >= registers || vecs % chunk != 0)) chunk--;
    return chunk;
}

// Outputs l0 .. l0 + CHUNK - 1 (in vectors) of ROWS rows: their weights (in place of their scores)
// times the values, summed in position order, over their weights' totals.
template <class V, int CHUNK, int ROWS, class S>
static inline void weighted_values(const Row* rows, const Span<S>& values, int l0, long last, const float* scores,
                                   long stride, const float* total) {
    const int W = Lanes<V>::width;
    V acc[ROWS][CHUNK] = {};
    for (long j = 0; j < last; j++) {
        V value[CHUNK];
        const S *at = values.at(j) + l0 * W, *ahead = values.at(j + AHEAD) + l0 * W;
        for (long b = 0; b < CHUNK * W; b += LINE / sizeof(S)) __builtin_prefetch(ahead + b, 0, 3);
        for (int l = 0; l < CHUNK; l++) value[l] = load<V>(at + l * W);
        for (int r = 0; r < ROWS; r++) {
            const float w = scores[r * stride + j];
            for (int l = 0; l < CHUNK; l++) acc[r][l] += w * value[l];
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int l = 0; l < CHUNK; l++) {
            V o = acc[r][l] / total[r];
            memcpy(rows[r].out + (l0 + l) * W, &o, sizeof(o));
        }
}

// ROWS rows against one key/value head: their scores over positions 0 .. last - 1 (last: the most
// any of them sees) into scores[r * stride + j], then weights, then their outputs.
template <class V, int VECS, int ROWS, class S>
static void attend_rows(const Row* rows, const Span<S>& keys, const Span<S>& values, float scale, float* scores,
                        long stride) {
    const int W = Lanes<V>::width;
    const long dim = VECS * W;
    long last = 0;
    for (int r = 0; r < ROWS; r++) last = rows[r].seen > last ? rows[r].seen : last;
    V query[ROWS][VECS];
    for (int r = 0; r < ROWS; r++)
        for (int l = 0; l < VECS; l++) query[r][l] = load<V>(rows[r].q + l * W) * scale;
    for (long j0 = 0; j0 < last; j0 += W) {
        V dots[ROWS][W];
        for (int slot = 0; slot < W; slot++) {
            const long j = j0 + Lanes<V>::bitrev()[slot];
            const S* key = keys.at(j < last ? j : last - 1);  // past the end: a copy, unused
            const S* ahead = keys.at(j0 + AHEAD + slot);
            for (long b = 0; b < dim; b += LINE / sizeof(S)) __builtin_prefetch(ahead + b, 0, 3);
            V k[VECS];
            for (int l = 0; l < VECS; l++) k[l] = load<V>(key + l * W);
            for (int r = 0; r < ROWS; r++) {
                V dot = query[r][0] * k[0];
                for (int l = 1; l < VECS; l++) dot += query[r][l] * k[l];
                dots[r][slot] = dot;
            }
        }
        for (int r = 0; r < ROWS; r++) {
            V sums = lane_sums(dots[r]);
            memcpy(scores + r * stride + j0, &sums, sizeof(sums));
        }
    }
    float total[ROWS];
    softmax_weights<V, ROWS>(rows, last, scores, stride, total);
    // A zero weight adds an exact zero to a row's sums: a row that sees fewer positions than `last`
    // gets the bits it would alone.
    constexpr int CHUNK = chunk_vecs(VECS, ROWS, W);
    for (int l0 = 0; l0 < VECS; l0 += CHUNK)
        weighted_values<V, CHUNK, ROWS>(rows, values, l0, last, scores, stride, total);
}

// One pass over one key/value head: `count` (at most MAX_ROWS) of the segment's query rows
// of that head, from `first` in (row, query head of the group) order, so that each key and value is
// read once for all of them.
template <class V, int VECS, class S>
static void attend_head(const Segment& seg, long kv_head, long first, long count, long group, const float* q,
                        long q_token, long q_head, float* out, long out_token, float scale, float* scores,
                        long stride) {
    const long dim = VECS * Lanes<V>::width;
    const long own = kv_head * seg.capacity * dim, prefix = kv_head * seg.prefix_capacity * dim;
    const Span<S> keys = {(const S*)seg.prefix_keys + prefix, seg.prefix_len, (const S*)seg.keys + own, dim};
    const Span<S> values = {(const S*)seg.prefix_values + prefix, seg.prefix_len, (const S*)seg.values + own, dim};
    Row rows[MAX_ROWS];
    for (long r = 0; r < count; r++) {
        const long i = (first + r) / group, h = kv_head * group + (first + r) % group;  // row i of head h
        rows[r] = {q + (seg.start + i) * q_token + h * q_head, out + (seg.start + i) * out_token + h * dim,
                   seg.past + i + 1};
    }
    switch (count) {
        case 1: attend_rows<V, VECS, 1, S>(rows, keys, values, scale, scores, stride); break;
        case 2: attend_rows<V, VECS, 2, S>(rows, keys, values, scale, scores, stride); break;
        case 3: attend_rows<V, VECS, 3, S>(rows, keys, values, scale, scores, stride); break;
        default: attend_rows<V, VECS, 4, S>(rows, keys, values, scale, scores, stride); break;
    }
}

typedef void (*HeadFn)(const Segment&, long, long, long, long, const float*, long, long, float*, long, float, float*,
                       long);

template <class V, class S> static HeadFn head_fn(long vecs) {
    switch (vecs) {
        case 1: return attend_head<V, 1, S>;
        case 2: return attend_head<V, 2, S>;
        case 3: return attend_head<V, 3, S>;
        case 4: return attend_head<V, 4, S>;
        case 5: return attend_head<V, 5, S>;
        case 6: return attend_head<V, 6, S>;
        case 8: return attend_head<V, 8, S>;
        case 10: return attend_head<V, 10, S>;
        case 12: return attend_head<V, 12, S>;
        case 16: return attend_head<V, 16, S>;
        default: return nullptr;
    }
}

// The floats of the widest vectors that divide a head of `dim` floats (0: none do).
static long width_for(long dim) {
#if defined(__AVX512F__)
    if (dim % 16 == 0) return 16;
#endif
    return dim % 8 == 0 ? 8 : 0;
}

// The attention of one head of `dim` floats: in those vectors.
template <class S> static HeadFn head_for(long dim) {
    const long width = width_for(dim);
#if defined(__AVX512F__)
    if (width == 16) return head_fn<v16, S>(dim / 16);
#endif
    return width == 8 ? head_fn<v8, S>(dim / 8) : nullptr;
}

template <class S>
static void append(const Segment& seg, const float* k, long k_token, long k_head, const float* v, long v_token,
                   long v_head, long kv_heads, long dim) {
    S* keys = (S*)seg.keys;
    S* values = (S*)seg.values;
    for (long h = 0; h < kv_heads; h++)
        for (long r = 0; r < seg.rows; r++) {
            const long at = (h * seg.capacity + seg.past - seg.prefix_len + r) * dim;
            store(keys + at, k + (seg.start + r) * k_token + h * k_head, dim);
            store(values + at, v + (seg.start + r) * v_token + h * v_head, dim);
        }
}

// Whether ragged_attention takes heads of this size.
extern "C" int ragged_attention_supports(long dim) { return head_for<float>(dim) != nullptr; }

// q: this step's query rows, row t head h at q + t * q_token + h * q_head (head_dim floats, stride
// 1); k, v: its new key/value rows likewise, kv_heads of them; segments: `count` Segments, whose
// own buffers have room for past - prefix_len + rows positions, and whose buffers (a prefix's too)
// hold float16 where `kv_half` is set, float32 otherwise. Appends each segment's new keys/values to its
// own buffers, then writes out [rows][heads][dim] (contiguous) for every segment's rows; rows of the
// batch outside the segments are left as they are.
extern "C" void ragged_attention(const float* q, long q_token, long q_head, const float* k, long k_token, long k_head,
                                 const float* v, long v_token, long v_head, const long* table, long count, long heads,
                                 long kv_heads, long dim, float scale, float* out, long kv_half) {
    const HeadFn attend = kv_half ? head_for<half>(dim) : head_for<float>(dim);
    if (attend == nullptr) return;  // ragged.py asks ragged_attention_supports first
    const Segment* segments = (const Segment*)table;
    long longest = 0;
    for (long s = 0; s < count; s++) {
        if (kv_half)
            append<half>(segments[s], k, k_token, k_head, v, v_token, v_head, kv_heads, dim);
        else
            append<float>(segments[s], k, k_token, k_head, v, v_token, v_head, kv_heads, dim);
        if (segments[s].past + segments[s].rows > longest) longest = segments[s].past + segments[s].rows;
    }
    const long stride = (longest + WIDEST - 1) / WIDEST * WIDEST + WIDEST;
    const long group = heads / kv_heads, out_token = heads * dim;
    // Tasks: single passes, (segment, key/value head, pass over its rows x group): a Verify's 5 rows of
    // SmolLM2's 3 key/value heads make 12, where one task per head kept one of two threads idle a
    // third of the time; a prompt's rows spread over the threads alike. Which task or thread runs a
    // pass does not change its rows' results.
    const long per_pass = MAX_ROWS;
    long tasks = 0;
    for (long s = 0; s < count; s++) tasks += (segments[s].rows * group + per_pass - 1) / per_pass * kv_heads;
#pragma omp parallel
    {
        float* scores = (float*)malloc(MAX_ROWS * stride * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < tasks; t++) {
            long s = 0, left = t, passes;  // task `left` of segment s
            for (; left >= (passes = (segments[s].rows * group + per_pass - 1) / per_pass) * kv_heads; s++)
                left -= passes * kv_heads;
            const long first = left % passes * per_pass, items = segments[s].rows * group - first;
            attend(segments[s], left / passes, first, items < per_pass ? items : per_pass, group, q, q_token, q_head,
                   out, out_token, scale, scores, stride);
        }
        free(scores);
    }
}
