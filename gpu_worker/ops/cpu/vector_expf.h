/* glibc's libmvec expf, 8 at a time (the AVX2 variant, named by the x86-64 vector function ABI), where
 * the build has it: LIBMVEC set. build.py links libmvec on x86-64 glibc. */
#ifndef VECTOR_EXPF_H
#define VECTOR_EXPF_H
#if defined(__AVX2__) && defined(__GLIBC__)
#include <immintrin.h>
#define LIBMVEC 1
__m256 _ZGVdN8v_expf(__m256 x);
#endif
#endif
