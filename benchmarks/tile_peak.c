/* The prefill matmul's register tile as bare C loops (no dequantization, no epilogue but adding into y): G
 * vectors of 16 rows x TT tokens, a block of 256 columns of f32 weights (G x 16 KB) multiplied by 48 tokens whose
 * inputs are rows 8 KB apart, as ops.prefill_matmul's are. What a tile shape can reach on one core, apart from
 * the lowering. Build and run (AVX-512):
 *   for t in "2 8" "4 6" "3 8" "4 4"; do set -- $t; gcc -O3 -march=native -DG=$1 -DTT=$2 \
 *       -o /tmp/tile_$1_$2 benchmarks/tile_peak.c && /tmp/tile_$1_$2; done
 * The machine's speed varies: run each several times, alternated, and compare the best. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifndef G
#define G 4
#endif
#ifndef TT
#define TT 6
#endif
#define BLK 256
#define XS 2048
#define NT 48

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

int main(void) {
    float *w = aligned_alloc(64, G * 16 * BLK * 4), *x = aligned_alloc(64, (size_t)NT * XS * 4);
    float *y = aligned_alloc(64, G * 16 * NT * 4);
    for (int i = 0; i < G * 16 * BLK; i++) w[i] = 0.001f * (i % 7);
    for (long i = 0; i < (long)NT * XS; i++) x[i] = 0.001f * (i % 5);
    for (int i = 0; i < G * 16 * NT; i++) y[i] = 0.0f;
    double best = 1e9;
    for (int rep = 0; rep < 30; rep++) {
        double t = now();
        for (int it = 0; it < 200; it++)
            for (int tt = 0; tt < NT / TT; tt++) {
                __m512 a[G * TT];
                for (int i = 0; i < G * TT; i++) a[i] = _mm512_setzero_ps();
                const float *xp = x + (size_t)tt * TT * XS;
                for (int c = 0; c < BLK; c++) {
                    __m512 wv[G];
                    for (int g = 0; g < G; g++) wv[g] = _mm512_load_ps(w + g * 16 * BLK + c * 16);
                    for (int k = 0; k < TT; k++) {
                        __m512 b = _mm512_set1_ps(xp[k * XS + c]);
                        for (int g = 0; g < G; g++) a[G * k + g] = _mm512_fmadd_ps(wv[g], b, a[G * k + g]);
                    }
                }
                for (int k = 0; k < TT; k++)
                    for (int g = 0; g < G; g++) {
                        float *yp = y + (tt * TT + k) * 16 * G + 16 * g;
                        _mm512_store_ps(yp, _mm512_add_ps(_mm512_load_ps(yp), a[G * k + g]));
                    }
            }
        t = now() - t;
        if (t < best) best = t;
    }
    printf("%d x 16 rows x %d tokens: %.1f GFLOP/s (checksum %g)\n", G, TT, 200.0 * NT * BLK * G * 16 * 2 / best / 1e9, y[0]);
    return 0;
}
