/* Vector helpers shared by the C kernels: 8-float vectors in GCC/Clang vector extensions
 * (the compiler maps them onto whatever -march=native offers), an expf to about 2 ulp, and a
 * map over an array with a padded tail. The cache key of every kernel covers this header. */
#ifndef POSBENCH_VMATH_H
#define POSBENCH_VMATH_H
#include <stdint.h>
#include <string.h>

/* exp(x) to about 2 ulp (Cephes' expf), 8 floats at a time in GCC/Clang vector extensions */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f vexp(v8f x) {
    const v8f lo = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    const v8f hi = -lo + 1.0f;
    v8i m = x < lo;
    x = (v8f)((m & (v8i)lo) | (~m & (v8i)x));
    m = x > hi;
    x = (v8f)((m & (v8i)hi) | (~m & (v8i)x));
    v8f n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
    v8f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23; /* 2^n */
    return p * (v8f)bits;
}

/* out[j] = EXPR(x = in[j]) for j < n, 8 at a time; the tail goes through a padded copy */
#define MAP8(n, in, out, EXPR)                                   \
    do {                                                         \
        int j_ = 0;                                              \
        for (; j_ + 8 <= (n); j_ += 8) {                         \
            v8f x;                                               \
            memcpy(&x, (in) + j_, sizeof x);                     \
            v8f y = EXPR;                                        \
            memcpy((out) + j_, &y, sizeof y);                    \
        }                                                        \
        if (j_ < (n)) {                                          \
            float buf[8] = {0};                                  \
            memcpy(buf, (in) + j_, sizeof(float) * ((n) - j_));  \
            v8f x;                                               \
            memcpy(&x, buf, sizeof x);                           \
            v8f y = EXPR;                                        \
            memcpy(buf, &y, sizeof y);                           \
            memcpy((out) + j_, buf, sizeof(float) * ((n) - j_)); \
        }                                                        \
    } while (0)

#define INLINE static inline __attribute__((always_inline))

#endif
