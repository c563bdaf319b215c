/* How well a core overlaps a streamed read with vector work on it, with and without one software prefetch per
   cache line: 1 GB read once, each 64-byte line feeding `ops` pmaddubsw/paddw pairs (the density of a quantized
   decode matvec: R4K's loop is ~60 instructions a line), on 1 and 2 threads. What pointed at the AVX2 lowering's
   prefetch fault (docs/benchmarks-history.md, fourteenth session): a loop like this streams faster with the prefetch.

       gcc -O2 -mavx2 -fopenmp -o /tmp/overlap benchmarks/stream_overlap.c && /tmp/overlap
*/
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define STREAM(W)                                                                                              \
    static __attribute__((noinline)) __m256i stream##W(const char *p, size_t n, int ahead, __m256i k0,       \
                                                        __m256i k1) {                                          \
        __m256i a[8];                                                                                          \
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_si256();                                             \
        for (size_t i = 0; i < n; i += 64) {                                                                   \
            if (ahead) _mm_prefetch(p + i + ahead, _MM_HINT_T0);                                               \
            __m256i x = _mm256_load_si256((const __m256i *)(p + i));                                          \
            __m256i y = _mm256_load_si256((const __m256i *)(p + i + 32));                                     \
            _Pragma("GCC unroll 32") for (int w = 0; w < W; w++) {                                              \
                __m256i k = (w & 1) ? k1 : k0;                                                                 \
                a[w & 7] = _mm256_add_epi16(a[w & 7], _mm256_maddubs_epi16(x, k));                             \
                a[(w + 4) & 7] = _mm256_add_epi16(a[(w + 4) & 7], _mm256_maddubs_epi16(y, k));                 \
            }                                                                                                  \
        }                                                                                                      \
        for (int j = 1; j < 8; j++) a[0] = _mm256_add_epi16(a[0], a[j]);                                       \
        return a[0];                                                                                           \
    }
STREAM(4) STREAM(8) STREAM(12) STREAM(16)

typedef __m256i (*Stream)(const char *, size_t, int, __m256i, __m256i);

int main(int argc, char **argv) {
    size_t n = (size_t)1 << 30;
    char *p = aligned_alloc(1 << 21, n);
    memset(p, 1, n);
    Stream fns[] = {stream4, stream8, stream12, stream16};
    int work[] = {4, 8, 12, 16}, ahead[] = {0, 4096};
    __m256i k0 = _mm256_set1_epi8(argc), k1 = _mm256_set1_epi8(argc + 1);
    volatile int sink = 0;
    for (int threads = 1; threads <= 2; threads++)
        for (int w = 0; w < 4; w++) {
            printf("%d thread(s), %2d vector instructions a line:", threads, 4 * work[w] + 2);
            for (int a = 0; a < 2; a++) {
                double best = 1e9;
                for (int r = 0; r < 3; r++) {
                    double t = now();
#pragma omp parallel num_threads(threads)
                    {
                        size_t share = n / threads;
                        __m256i s = fns[w](p + omp_get_thread_num() * share, share, ahead[a], k0, k1);
                        sink += _mm256_extract_epi16(s, 0);
                    }
                    t = now() - t;
                    best = t < best ? t : best;
                }
                printf("  %s %5.1f GB/s", ahead[a] ? "prefetch 4 KB ahead" : "no prefetch", n / best / 1e9);
            }
            printf("\n");
        }
    return sink == 12345;
}
