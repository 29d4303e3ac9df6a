// Vector types and the vector exp shared by attention.cpp (softmax) and layers.cpp (SiLU); GCC's
// vector extensions, so each is one instruction per vector. Part of the library's sources
// (specdec/models/panels.py hashes it with them).
#pragma once

#include <immintrin.h>

// Vectors of 8 floats (AVX2) and, with AVX-512, of 16.
typedef float v8 __attribute__((vector_size(32)));
typedef int i8 __attribute__((vector_size(32)));
#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64)));
typedef int i16 __attribute__((vector_size(64)));
#define WIDEST 16
typedef v16 widest;
#else
#define WIDEST 8
typedef v8 widest;
#endif

template <class V> struct IntsOf;
template <> struct IntsOf<v8> { typedef i8 type; };
static inline v8 floor_of(v8 x) { return (v8)_mm256_floor_ps((__m256)x); }
#if defined(__AVX512F__)
template <> struct IntsOf<v16> { typedef i16 type; };
static inline v16 floor_of(v16 x) {
    return (v16)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
#endif

template <class V> static inline V max_of(V a, V b) { return a > b ? a : b; }

// exp(x) for x <= 0 (and up to 88, exp_upto_88): Cephes' expf (range reduction by ln 2, a degree-6
// polynomial), relative error about 1e-7. Below -87.3 it returns exp(-87.3) ~ 1e-38.
template <class V> static inline V exp_neg(V x) {
    typedef typename IntsOf<V>::type I;
    x = max_of(x, (V){} - 87.3f);
    V n = floor_of(x * 1.44269504088896341f + 0.5f);
    V r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    I two_n = (__builtin_convertvector(n, I) + 127) << 23;
    return p * (V)two_n;
}

// exp(x) for x <= 88 (exp_neg's arithmetic holds there; past it a float overflows): x clamped to 88.
template <class V> static inline V exp_upto_88(V x) {
    return exp_neg(x < 88.0f ? x : (V){} + 88.0f);
}
