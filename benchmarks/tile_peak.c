/* The prefill matmul's register tile as bare C loops (no dequantization, no epilogue but adding into y): G
 * groups of 16 rows (a vector each with AVX-512, two with AVX2) x TT tokens, a block of 256 columns of f32
 * weights (G x 16 KB) multiplied by 48 tokens whose inputs are rows 8 KB apart (XS floats), as
 * ops.prefill_matmul's are. What a tile shape can reach on one core, apart from the lowering. Build and run:
 *   for t in "2 8" "4 6" "3 8" "4 4"; do set -- $t; gcc -O3 -march=native -DG=$1 -DTT=$2 \
 *       -o /tmp/tile_$1_$2 benchmarks/tile_peak.c && /tmp/tile_$1_$2; done
 * (AVX2: "1 6", the tile ops.tile_groups gives it.) The machine's speed varies: run each several times,
 * alternated, and compare the best. */
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
#ifndef XS
#define XS 2048
#endif
#define BLK 256
#define NT 48
#ifdef __AVX512F__
#define L 16
typedef __m512 vec;
#define ZERO _mm512_setzero_ps
#define LOAD _mm512_load_ps
#define STORE _mm512_store_ps
#define SET1 _mm512_set1_ps
#define FMADD _mm512_fmadd_ps
#define ADD _mm512_add_ps
#else
#define L 8
typedef __m256 vec;
#define ZERO _mm256_setzero_ps
#define LOAD _mm256_load_ps
#define STORE _mm256_store_ps
#define SET1 _mm256_set1_ps
#define FMADD _mm256_fmadd_ps
#define ADD _mm256_add_ps
#endif
#define V (G * 16 / L) /* vectors of a tile's rows */

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
                vec a[V * TT];
                for (int i = 0; i < V * TT; i++) a[i] = ZERO();
                const float *xp = x + (size_t)tt * TT * XS;
                for (int c = 0; c < BLK; c++) {
                    vec wv[V];
                    for (int g = 0; g < V; g++) wv[g] = LOAD(w + (g * L / 16) * 16 * BLK + c * 16 + g * L % 16);
                    for (int k = 0; k < TT; k++) {
                        vec b = SET1(xp[k * XS + c]);
                        for (int g = 0; g < V; g++) a[V * k + g] = FMADD(wv[g], b, a[V * k + g]);
                    }
                }
                for (int k = 0; k < TT; k++)
                    for (int g = 0; g < V; g++) {
                        float *yp = y + (tt * TT + k) * 16 * G + L * g;
                        STORE(yp, ADD(LOAD(yp), a[V * k + g]));
                    }
            }
        t = now() - t;
        if (t < best) best = t;
    }
    printf("%d x 16 rows x %d tokens (%d-lane vectors): %.1f GFLOP/s (checksum %g)\n", G, TT, L,
           200.0 * NT * BLK * G * 16 * 2 / best / 1e9, y[0]);
    return 0;
}
