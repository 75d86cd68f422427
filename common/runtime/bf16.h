/* bf16.h — the bfloat16 word conversions (device.h: Bf16), one definition for
 * every layer: the collectives of both builds (cpu/coll_cpu.c,
 * cuda/coll_kernels.cu), the model's ops and kernels (model/ops_math.h
 * includes this), the driver's probes and the tests. Plain C; __host__
 * __device__ under nvcc. */
#ifndef HWFSDP_BF16_H
#define HWFSDP_BF16_H

#include <stdint.h>
#include <string.h>

/* static inline, and __host__ __device__ where nvcc compiles it */
#ifdef __CUDACC__
#define HWFSDP_HD static inline __host__ __device__
#else
#define HWFSDP_HD static inline
#endif

/* A bfloat16 is the top 16 bits of a float32: same sign and exponent, 7 of
 * the 23 mantissa bits. The one conversion everything uses (kernels on both
 * backends, the collectives, the runtime's checks, the tests) is below.
 *
 * A float's bits and back (the two bit casts below use): f32_bits(float)
 * gives a uint32_t, f32_from_bits(uint32_t) a float. The device has an
 * intrinsic for each; the host copies the bytes, the bit cast that both C and
 * C++ (the .cu files' host code) define. */
#ifdef __CUDA_ARCH__
#define HWFSDP_BIT_CAST(name, To, From, intrinsic) \
    HWFSDP_HD To name(From x) { return intrinsic(x); }
#else
#define HWFSDP_BIT_CAST(name, To, From, intrinsic) \
    HWFSDP_HD To name(From x) {                    \
        To y;                                      \
        memcpy(&y, &x, sizeof y);                  \
        return y;                                  \
    }
#endif
HWFSDP_BIT_CAST(f32_bits, uint32_t, float, __float_as_uint)
HWFSDP_BIT_CAST(f32_from_bits, float, uint32_t, __uint_as_float)

/* float32 -> bfloat16, round to nearest, ties to even: add 0x7fff plus the
 * lowest kept bit, then drop the low 16 bits. A tie (low half exactly 0x8000)
 * rounds up only when the kept part is odd. A carry out of the mantissa bumps
 * the exponent, which is right (and gives inf past bfloat16's largest finite
 * value). Subnormals round the same way. NaN would carry into the exponent,
 * so it is handled first: sign and top mantissa bits kept, quiet bit set. */
HWFSDP_HD uint16_t bf16_from_f32(float x) {
    uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* bfloat16 -> float32: exact (the low 16 mantissa bits are zero). */
HWFSDP_HD float bf16_to_f32(uint16_t b) { return f32_from_bits((uint32_t)b << 16); }

#endif
