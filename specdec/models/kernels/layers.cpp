// Every decoder layer of a Llama-shaped model over the short segments of a ragged step (decode
// and Verify rows), or over prompts with the products on AMX tiles (`tiles`), in ONE call:
// RMSNorm, the q / k / v products, rotary embedding, the ragged attention (attention.cpp), the
// output product and residual, RMSNorm, gate / up, SiLU, down and residual. Built with panels.cpp,
// amx.cpp and attention.cpp into one library by specdec/models/panels.py; called by
// specdec/models/fused.py.
//
// Why: a 17.5 ms one-row decode of SmolLM2-135M (2 threads) spent ~7 ms dispatching ~45 tensor ops
// a layer from Python, more than its attention and half its products; here the ops between the
// products are a few loops over a few rows.
//
// Each row is computed alone, in one order: the products by panels.cpp (a row's outputs do not
// depend on the rows beside it), the norms' sums of squares in a fixed order over the row, the
// rest element by element. So a row's result does not depend on the rows, segments or threads
// beside it: a decode batched with others gives the bits it gives alone, and a Verify row the
// bits of its own one-row decode.

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

extern "C" void panels_product(const float* x, long M, long K, const float* panels, long N, float* y);
extern "C" void panels_q4_product(const float* x, long M, long K, const unsigned char* nibbles, const float* scale,
                                  const float* offset, long N, float* y);
extern "C" void panels_q8_product(const float* x, long M, long K, const signed char* levels, const float* scale,
                                  long N, float* y);
extern "C" int amx_q4_product(const float* x, long M, long K, const unsigned char* nibbles, const float* scale,
                              const float* offset, long N, float* y);
extern "C" int amx_q8_product(const float* x, long M, long K, const signed char* levels, const float* scale, long N,
                              float* y);
extern "C" int int8_products(const float* x, long M, long K, const long* parts, long count);
#define SEGMENT_COLUMNS 10  // the longs of one segment's row in a ragged_attention table (attention.cpp)
extern "C" void ragged_attention(const float* q, long q_token, long q_head, const float* k, long k_token, long k_head,
                                 const float* v, long v_token, long v_head, const long* table, long count, long heads,
                                 long kv_heads, long dim, float scale, float* out, long kv_half);

// One linear layer as fused.py describes it (6 int64): its panels' form (0 float32, 1 4-bit,
// 2 8-bit blocks; 3 / 4 the same laid out for int8 rows, int8.cpp, 5 / 6 those with float16
// scales), up to three buffer addresses (float32: panels; 4-bit: nibbles, scales, offsets; 8-bit:
// levels, scales), its output count and its bias's address (0: none).
struct Linear {
    long form, a, b, c, out, bias;
};

// One layer (2 + 7 x 6 int64): the two norms' weights, then q, k, v, o, gate, up, down.
struct Layer {
    long input_norm, post_norm;
    Linear q, k, v, o, gate, up, down;
};

enum { F32 = 0, Q4 = 1, Q8 = 2, INT8_Q4 = 3, INT8_Q8 = 4, INT8_Q4_HALF = 5, INT8_Q8_HALF = 6 };

static void add_bias(const Linear& w, long rows, float* y) {
    if (w.bias)
        for (long r = 0; r < rows; r++)
            for (long n = 0; n < w.out; n++) y[r * w.out + n] += ((const float*)w.bias)[n];
}

// The int8 products of `count` linears of the same x, into ys, in one int8_products call (x rounded
// once, one parallel loop, each output the bits of its own product). 1 when it could not allocate.
static int int8_products_of(const Linear* const* ws, float* const* ys, long count, const float* x, long rows,
                            long in) {
    long parts[3 * 6];
    for (long i = 0; i < count; i++) {
        const Linear& w = *ws[i];
        const long part[6] = {w.form, w.a, w.b, w.c, w.out, (long)ys[i]};
        memcpy(parts + 6 * i, part, sizeof(part));
    }
    if (int8_products(x, rows, in, parts, count)) return 1;
    for (long i = 0; i < count; i++) add_bias(*ws[i], rows, ys[i]);
    return 0;
}

// tiles: the 4- and 8-bit forms on AMX tiles (amx.cpp; a prompt's rows, see decoder_layers),
// panels.cpp where amx.cpp could not allocate its buffers. 1 when an int8 product could not
// allocate its rows' levels (its output unwritten), else 0.
static int product(const Linear& w, const float* x, long rows, long in, float* y, long tiles) {
    switch (w.form) {
        case F32: panels_product(x, rows, in, (const float*)w.a, w.out, y); break;
        case Q4:
            if (tiles && amx_q4_product(x, rows, in, (const unsigned char*)w.a, (const float*)w.b, (const float*)w.c,
                                        w.out, y) == 0)
                break;
            panels_q4_product(x, rows, in, (const unsigned char*)w.a, (const float*)w.b, (const float*)w.c, w.out, y);
            break;
        case Q8:
            if (tiles && amx_q8_product(x, rows, in, (const signed char*)w.a, (const float*)w.b, w.out, y) == 0) break;
            panels_q8_product(x, rows, in, (const signed char*)w.a, (const float*)w.b, w.out, y);
            break;
        default: {  // INT8_Q4, INT8_Q8 and their _HALF forms
            const Linear* one[1] = {&w};
            float* const out[1] = {y};
            return int8_products_of(one, out, 1, x, rows, in);
        }
    }
    add_bias(w, rows, y);
    return 0;
}

// Up to three products of the same x, into ys: as one int8_products call (x rounded once, one
// parallel loop, the same bits as one by one) where every linear multiplies int8 rows (which never
// take the tiles), else one by one. 1 when an int8 product could not allocate, else 0.
static int products(const Linear* const* ws, float* const* ys, long count, const float* x, long rows, long in,
                    long tiles) {
    bool together = true;
    for (long i = 0; i < count; i++) together = together && ws[i]->form >= INT8_Q4;
    if (together) return int8_products_of(ws, ys, count, x, rows, in);
    int failed = 0;
    for (long i = 0; i < count; i++) failed |= product(*ws[i], x, rows, in, ys[i], tiles);
    return failed;
}

// y = weight * x / sqrt(mean(x^2) + eps), row by row; the squares summed in 8 interleaved partial
// sums (so the loop vectorises) combined in one fixed order.
static void rms_norm(const float* x, long rows, long width, const float* weight, float eps, float* y) {
    for (long r = 0; r < rows; r++) {
        const float* row = x + r * width;
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        long i = 0;
        for (; i + 8 <= width; i += 8)
            for (int l = 0; l < 8; l++) part[l] += row[i + l] * row[i + l];
        float sum = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
        for (; i < width; i++) sum += row[i] * row[i];
        const float inv = 1.0f / sqrtf(sum / (float)width + eps);
        for (i = 0; i < width; i++) y[r * width + i] = weight[i] * (row[i] * inv);
    }
}

// Rotary embedding in place, rotate-half form: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over
// the two halves of each head; cos, sin: [rows, dim] (the model's rotary module's, scaling applied).
static void rotate(float* x, long rows, long heads, long dim, const float* cos, const float* sin) {
    const long half = dim / 2;
    for (long r = 0; r < rows; r++)
        for (long h = 0; h < heads; h++) {
            float* head = x + (r * heads + h) * dim;
            const float *c = cos + r * dim, *s = sin + r * dim;
            for (long i = 0; i < half; i++) {
                const float x1 = head[i], x2 = head[i + half];
                head[i] = x1 * c[i] - x2 * s[i];
                head[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
}

// gate <- silu(gate) * up, element by element (split over the threads: each element is its own),
// with vector_math.h's exp (a libm call per element made SiLU ~9% of an int8 prompt's time), in
// torch's form g / (1 + e^-g), so that transformers' modules and these layers differ only by the
// exps' last bits (an int8 model rounds these outputs to 8-bit levels next). Past g = -88 e^-g is
// clamped: the quotient is -0 or a denormal either way.
static inline void silu_chunk(float* gate, const float* up, long n) {  // n <= WIDEST (a tail: fewer)
    widest g = {}, u = {};
    memcpy(&g, gate, n * sizeof(float));
    memcpy(&u, up, n * sizeof(float));
    g = g / (1.0f + exp_upto_88(-g)) * u;
    memcpy(gate, &g, n * sizeof(float));
}

static void silu_times(float* gate, const float* up, long count) {
    const long whole = count / WIDEST * WIDEST;
#pragma omp parallel for schedule(static) if (count >= 16384)
    for (long i = 0; i < whole; i += WIDEST) silu_chunk(gate + i, up + i, WIDEST);
    if (whole < count) silu_chunk(gate + whole, up + whole, count - whole);
}

static void add(float* into, const float* from, long count) {
    for (long i = 0; i < count; i++) into[i] += from[i];
}

// h: the residual stream [rows, hidden], updated in place through `count_layers` layers; layers:
// count_layers Layers; cos, sin: [rows, dim]; tables: [count_layers][segments][SEGMENT_COLUMNS], each layer's
// ragged_attention table (its cache buffers reserved for the new rows); tiles: the products on AMX
// tiles (a call of prompts only, whose rows then take amx.cpp's float32 sums: never set for a call
// with decode or Verify rows, which keep panels.cpp's bits); kv_half: the caches hold float16
// (attention.cpp). Returns 0, or -1 when a scratch buffer (or an int8 product's) could not be
// allocated (h is then unchanged or partly updated: discard it).
extern "C" int decoder_layers(float* h, long rows, long hidden, long inter, const long* layers, long count_layers,
                              float eps, const float* cos, const float* sin, const long* tables, long segments,
                              long heads, long kv_heads, long dim, float scale, long tiles, long kv_half) {
    const long q_width = heads * dim, kv_width = kv_heads * dim;
    long widest = inter > q_width ? inter : q_width;  // gate and up also hold [rows, hidden] products
    widest = widest > hidden ? widest : hidden;
    float* scratch = (float*)malloc(sizeof(float) * rows * (hidden + q_width + 2 * kv_width + q_width + 2 * widest));
    if (scratch == nullptr) return -1;
    float *normed = scratch, *q = normed + rows * hidden, *k = q + rows * q_width, *v = k + rows * kv_width;
    float *attended = v + rows * kv_width, *gate = attended + rows * q_width, *up = gate + rows * widest;
    int failed = 0;
    for (long l = 0; l < count_layers && !failed; l++) {
        const Layer& w = ((const Layer*)layers)[l];
        rms_norm(h, rows, hidden, (const float*)w.input_norm, eps, normed);
        const Linear* qkv[3] = {&w.q, &w.k, &w.v};
        float* const qkv_out[3] = {q, k, v};
        failed |= products(qkv, qkv_out, 3, normed, rows, hidden, tiles);
        rotate(q, rows, heads, dim, cos, sin);
        rotate(k, rows, kv_heads, dim, cos, sin);
        ragged_attention(q, q_width, dim, k, kv_width, dim, v, kv_width, dim, tables + l * segments * SEGMENT_COLUMNS,
                         segments, heads, kv_heads, dim, scale, attended, kv_half);
        failed |= product(w.o, attended, rows, q_width, gate, tiles);  // (gate as scratch: [rows, hidden] fits)
        add(h, gate, rows * hidden);
        rms_norm(h, rows, hidden, (const float*)w.post_norm, eps, normed);
        const Linear* gate_up[2] = {&w.gate, &w.up};
        float* const gate_up_out[2] = {gate, up};
        failed |= products(gate_up, gate_up_out, 2, normed, rows, hidden, tiles);
        silu_times(gate, up, rows * inter);
        failed |= product(w.down, gate, rows, inter, up, tiles);  // (up as scratch: [rows, hidden] fits)
        add(h, up, rows * hidden);
    }
    free(scratch);
    return failed ? -1 : 0;
}
