/* Vector helpers shared by the C kernels: 8-float vectors in GCC/Clang vector extensions
 * (the compiler maps them onto whatever -march=native offers), an expf to about 2 ulp, and a
 * map over an array with a padded tail. The cache key of every kernel covers this header. */
#ifndef POSBENCH_VMATH_H
#define POSBENCH_VMATH_H
#include <stdint.h>
#include <string.h>

/* 8 and 16 floats: the compiler maps them onto whatever -march=native offers */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* exp(x) to about 2 ulp (Cephes' expf), defined once for each vector width */
#define DEFINE_VEXP(NAME, VF, VI)                                                       \
    static inline VF NAME(VF x) {                                                       \
        const VF lo = (VF){0} - 87.3f, hi = -lo + 1.0f;                                 \
        VI m = x < lo;                                                                  \
        x = (VF)((m & (VI)lo) | (~m & (VI)x));                                          \
        m = x > hi;                                                                     \
        x = (VF)((m & (VI)hi) | (~m & (VI)x));                                          \
        VF n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x/ln2) */ \
        VF r = x - n * 0.693359375f + n * 2.12194440e-4f;                               \
        VF p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                 \
        p = p * r + 8.3334519073e-3f;                                                   \
        p = p * r + 4.1665795894e-2f;                                                   \
        p = p * r + 1.6666665459e-1f;                                                   \
        p = p * r + 5.0000001201e-1f;                                                   \
        p = p * r * r + r + 1.0f;                                                       \
        VI bits = (__builtin_convertvector(n, VI) + 127) << 23; /* 2^n */               \
        return p * (VF)bits;                                                            \
    }
DEFINE_VEXP(vexp, v8f, v8i)
DEFINE_VEXP(vexp16, v16f, v16i)

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
