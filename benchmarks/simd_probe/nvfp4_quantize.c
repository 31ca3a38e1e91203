// A probe, not the library: the NVFP4 quantizer of a folded y (nearest rounding, error feedback
// written) in AVX2 intrinsics, one 16-block at a time, with the numba kernel's arithmetic
// operation for operation (built with -ffp-contract=off by simd_probe.py, which checks its bits
// against kernels/native_quantize.py and times both). ELEMENTS_ONLY replaces each block's amax
// and E4M3 scale encode by a constant (wrong bits, for timing the element loop alone).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float pow2f(int e) {
    int32_t b = (e + 127) << 23;
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static inline int32_t fbits(float f) { int32_t b; memcpy(&b, &f, 4); return b; }
static inline float bitsf(int32_t b) { float f; memcpy(&f, &b, 4); return f; }

// rounding.encode_float nearest for E4M3 (ebits 4, mbits 3, bias 7, largest 448), v >= 0 finite
static inline int32_t e4m3(float v, float *value) {
    const int mbits = 3, bias = 7; const float largest = 448.0f, M = 12582912.0f;
    int32_t sign = (fbits(v) >> 31) & 1;
    float a = fabsf(v);
    int e = ((fbits(a) >> 23) & 0xFF) - 127; if (e < 1 - bias) e = 1 - bias;
    float units = a * pow2f(mbits - e);
    float rounded = (units + M) - M;
    float q = rounded * pow2f(e - mbits); if (!(q <= largest)) q = largest;  // min(q, largest)
    int32_t qbits = fbits(q); int qe = (qbits >> 23) - 127;
    // the shift in uint32_t: qe + bias is negative for a zero or subnormal q (then unused)
    int32_t normal = (int32_t)(((uint32_t)(qe + bias) << mbits)
                               | ((qbits >> (23 - mbits)) & ((1 << mbits) - 1)));
    int32_t subnormal = (int32_t)(q * pow2f(mbits - 1 + bias));
    int32_t code = qe >= 1 - bias ? normal : subnormal;
    int nonzero = code != 0;
    *value = bitsf(nonzero ? (qbits | (sign << 31)) : 0);
    return nonzero ? (code | (sign << 7)) : 0;
}

void nvfp4_quantize_folded(const float *y, float *r, uint8_t *packed, uint8_t *scale_codes,
                           int64_t n, float ts) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 six = _mm256_set1_ps(6.0f), two = _mm256_set1_ps(2.0f);
    const __m256 four = _mm256_set1_ps(4.0f), one = _mm256_set1_ps(1.0f);
    const __m256 half = _mm256_set1_ps(0.5f), zero = _mm256_setzero_ps();
    const __m256 M = _mm256_set1_ps(12582912.0f);
    const __m256i eight = _mm256_set1_epi32(8);
    int usable_t = ts > 0.0f && ts < INFINITY;
    for (int64_t b = 0; b < n / 16; b++) {
        const float *yb = y + 16 * b;
        __m256 y0 = _mm256_loadu_ps(yb), y1 = _mm256_loadu_ps(yb + 8);
        __m256i m = _mm256_max_epi32(_mm256_castps_si256(_mm256_and_ps(y0, absmask)),
                                     _mm256_castps_si256(_mm256_and_ps(y1, absmask)));
        __m128i m4 = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0x4E));
        m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0xB1));
#ifdef ELEMENTS_ONLY
        float amax = 1.0f; (void)m4;
#else
        float amax = bitsf(_mm_cvtsi128_si32(m4));
#endif
        float ratio = 0.0f;
        if (usable_t) {
            ratio = amax / (ts * 6.0f);
            if (!(ratio <= 448.0f)) ratio = 448.0f;
        }
#ifdef ELEMENTS_ONLY
        float scale = ratio; scale_codes[b] = 1;
#else
        float scale; scale_codes[b] = (uint8_t)e4m3(ratio, &scale);
#endif
        float denom = scale * ts;
        float divisor = (denom > 0.0f && denom < INFINITY) ? denom : INFINITY;
        __m256 dv = _mm256_set1_ps(divisor), dn = _mm256_set1_ps(denom);
        __m256i codes[2];
        for (int h = 0; h < 2; h++) {
            __m256 yy = h ? y1 : y0;
            __m256 v = _mm256_div_ps(yy, dv);
            __m256 a = _mm256_min_ps(_mm256_and_ps(v, absmask), six);  // numba: min(abs(v), SIX)
            __m256 low = _mm256_cmp_ps(a, two, _CMP_LT_OQ);
            __m256 mid = _mm256_cmp_ps(a, four, _CMP_LT_OQ);
            __m256 mul = _mm256_blendv_ps(_mm256_blendv_ps(half, one, mid), two, low);
            __m256 units = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(a, mul), M), M);
            __m256 off = _mm256_blendv_ps(_mm256_blendv_ps(four, two, mid), zero, low);
            __m256i mag = _mm256_cvttps_epi32(_mm256_add_ps(units, off));
            __m256i positive = _mm256_cmpgt_epi32(mag, _mm256_setzero_si256());
            __m256 neg = _mm256_and_ps(_mm256_cmp_ps(v, zero, _CMP_LT_OQ),
                                       _mm256_castsi256_ps(positive));
            __m256i code = _mm256_add_epi32(mag, _mm256_and_si256(_mm256_castps_si256(neg), eight));
            __m256 step = _mm256_blendv_ps(_mm256_blendv_ps(two, one, mid), half, low);
            __m256 value = _mm256_mul_ps(units, step);
            value = _mm256_blendv_ps(value, _mm256_sub_ps(zero, value), neg);  // -value
            _mm256_storeu_ps(r + 16 * b + 8 * h, _mm256_sub_ps(yy, _mm256_mul_ps(value, dn)));
            codes[h] = code;
        }
        // pack: element 2k low nibble, 2k+1 high nibble
        __m256i lo = codes[0], hi = codes[1];
        __m256i p16 = _mm256_packus_epi32(lo, hi);              // lanes mixed by 128-bit halves
        p16 = _mm256_permute4x64_epi64(p16, 0xD8);              // 16 uint16 in order
        __m128i b16 = _mm_packus_epi16(_mm256_castsi256_si128(p16),
                                       _mm256_extracti128_si256(p16, 1));
        __m128i odd = _mm_srli_epi16(b16, 8), even = _mm_and_si128(b16, _mm_set1_epi16(0xFF));
        __m128i nib = _mm_or_si128(even, _mm_slli_epi16(odd, 4));
        nib = _mm_packus_epi16(nib, nib);
        uint64_t eight_bytes = (uint64_t)_mm_cvtsi128_si64(nib);
        memcpy(packed + 8 * b, &eight_bytes, 8);  // packed + 8 * b need not be aligned
    }
}
