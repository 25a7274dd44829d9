/* Few-row products with 4-bit and 8-bit group weights on an x86 CPU (see cpu_native.py).

   q4 (cs_q4_gemm) below; q8 (cs_q8_gemm, int8 groups: a GGUF Q8_0 / Q5_0 / Q5_1 matrix such as an
   LM head) after it; q4 with int8 activations (cs_q4i8_gemm: integer dot products where the
   CPU has them, byte pairs elsewhere); then the exact decode attention (cs_attention) and, at
   the end, the whole decode / verify layer stack in one call made of them (cs_forward,
   native_forward.py).

   y[M, N] = x[M, K] @ W^T with  W[n, k] = scale[g, n] * q[n, k] + min[g, n],  g = k / GROUP,
   q in 0..15, x bfloat16, y bfloat16 (round to nearest even) or float32.

   Per output row and group the kernel computes  d = sum_k x[k] * q[n, k]  (fp32 accumulation of
   exact products), then  y += scale * d  and  y += min * sum_k x[k]  (two fused multiply-adds),
   group after group. The instruction sequence of one row does not depend on the other rows of
   the call: rows go in blocks of up to MAXB, each row with its own accumulators, so a row's
   bits are the same whether it is multiplied alone or among any number of rows.

   Two builds of this file (the build flags choose one):
   - __AVX512BF16__: 16 output columns per tile; q goes to bfloat16 through a 16-entry table and
     vdpbf16ps multiplies two k at a time. Pack: per tile, per 4 k, 32 bytes; byte 2c + p holds
     q[k + p] of column c in its low nibble and q[k + 2 + p] in its high nibble.
   - AVX2 + FMA: 8 columns per tile, q converted to fp32, x converted to fp32 once. Pack: per
     tile, per 2 k, 8 bytes; byte c holds q[k] of column c (low nibble) and q[k + 1] (high).
   The scale and min of a group follow its 4-bit values in the tile (one sequential stream per
   tile): TILE scales then TILE mins, float32, or float16 when `half` (a file whose scales are
   float16, as Q4_0 / Q4_1 store them, keeps them so: exact, and 1/4 fewer bytes to read). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* inputs per group (one scale, one min): the one group size of both kernels (cpu_native.py's
   GROUP checks it before a weight is packed) */
#define GROUP 32
/* bytes of one group of one tile: its 4-bit values, then its scales and mins */
#define GROUP_BYTES(half) (GROUP * TILE / 2 + 2 * TILE * ((half) ? 2 : 4))
/* the same for the q8 kernel, whose groups have GROUP or Q8_GROUP16 inputs (gs): their int8
   values, their scales, and their mins where they have them (never with Q8_GROUP16) */
#define Q8_GROUP16 16
#define Q8_GROUP_BYTES(gs, half, has_min) ((gs) * TILE + TILE * ((has_min) ? 2 : 1) * ((half) ? 2 : 4))

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch's cast */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* vectors of this build, and the group epilogue every product shares */
#if defined(__AVX512BF16__)
#define Q8_LOAD(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VLOAD_SCALES(p, half) ((half) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p))) \
                                  : _mm512_loadu_ps((const float *)(p)))
#define VEC __m512
#define VZERO _mm512_setzero_ps
#define VFMA _mm512_fmadd_ps
#define VFNMADD _mm512_fnmadd_ps
#define VMUL_ _mm512_mul_ps
#define VADD_ _mm512_add_ps
#define VSET1 _mm512_set1_ps
#define VSTORE _mm512_storeu_ps
#else
#define Q8_LOAD(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VLOAD_SCALES(p, half) ((half) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p))) \
                                  : _mm256_loadu_ps((const float *)(p)))
#define VEC __m256
#define VZERO _mm256_setzero_ps
#define VFMA _mm256_fmadd_ps
#define VFNMADD _mm256_fnmadd_ps
#define VMUL_ _mm256_mul_ps
#define VADD_ _mm256_add_ps
#define VSET1 _mm256_set1_ps
#define VSTORE _mm256_storeu_ps
#endif

/* After a group of every row of a block: tot += scale * acc, then (with mins) tot += min * the
   row's sum of x over the group; scales and mins TILE values each at sp, float16 when half. */
#define GROUP_EPILOGUE(MB, sp, half, has_min, sx, G, g)                                          \
    do {                                                                                         \
        const VEC sc_ = VLOAD_SCALES(sp, half);                                                  \
        for (int m = 0; m < MB; m++) tot[m] = VFMA(acc[m], sc_, tot[m]);                         \
        if (has_min) {                                                                           \
            const VEC mn_ = VLOAD_SCALES((sp) + TILE * ((half) ? 2 : 4), half);                  \
            for (int m = 0; m < MB; m++)                                                         \
                tot[m] = VFMA(mn_, VSET1((sx)[(size_t)m * (G) + (g)]), tot[m]);                  \
        }                                                                                        \
    } while (0)

#if defined(__AVX512BF16__)
#define TILE 16
#define MAXB 8
typedef uint16_t xelem;
#define DEF_BLOCK(MB)                                                                            \
static inline void block_##MB(const uint8_t *wp, int half, const xelem *x, const float *sx,     \
                              int K, float *out) {                                               \
    const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,      \
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,                          \
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);                         \
    const __m512i low4 = _mm512_set1_epi16(0xF);                                                 \
    const int G = K / GROUP;                                                                     \
    __m512 tot[MB];                                                                              \
    for (int m = 0; m < MB; m++) tot[m] = _mm512_setzero_ps();                                   \
    for (int g = 0; g < G; g++) {                                                                \
        __m512 acc[MB];                                                                          \
        for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();                               \
        const uint8_t *gp = wp + (size_t)g * GROUP_BYTES(half);                                  \
        for (int s = 0; s < GROUP / 4; s++) {                                                    \
            const int k = g * GROUP + s * 4;                                                     \
            __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(gp + s * 32))); \
            __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, low4), table);  \
            __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);    \
            for (int m = 0; m < MB; m++) {                                                       \
                uint32_t p0, p1;                                                                 \
                memcpy(&p0, x + (size_t)m * K + k, 4);                                           \
                memcpy(&p1, x + (size_t)m * K + k + 2, 4);                                       \
                acc[m] = _mm512_dpbf16_ps(acc[m], lo, (__m512bh)_mm512_set1_epi32((int)p0));     \
                acc[m] = _mm512_dpbf16_ps(acc[m], hi, (__m512bh)_mm512_set1_epi32((int)p1));     \
            }                                                                                    \
        }                                                                                        \
        GROUP_EPILOGUE(MB, gp + GROUP * TILE / 2, half, 1, sx, G, g);                           \
    }                                                                                            \
    for (int m = 0; m < MB; m++) _mm512_storeu_ps(out + m * TILE, tot[m]);                       \
}
#else
#define TILE 8
#define MAXB 4
typedef float xelem;
#define DEF_BLOCK(MB)                                                                            \
static inline void block_##MB(const uint8_t *wp, int half, const xelem *x, const float *sx,     \
                              int K, float *out) {                                               \
    const __m256i low4 = _mm256_set1_epi32(0xF);                                                 \
    const int G = K / GROUP;                                                                     \
    __m256 tot[MB];                                                                              \
    for (int m = 0; m < MB; m++) tot[m] = _mm256_setzero_ps();                                   \
    for (int g = 0; g < G; g++) {                                                                \
        __m256 acc[MB];                                                                          \
        for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();                               \
        const uint8_t *gp = wp + (size_t)g * GROUP_BYTES(half);                                  \
        for (int s = 0; s < GROUP / 2; s++) {                                                    \
            const int k = g * GROUP + s * 2;                                                     \
            __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(gp + s * 8))); \
            __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(w, low4));                           \
            __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));                             \
            for (int m = 0; m < MB; m++) {                                                       \
                const float *xr = x + (size_t)m * K + k;                                         \
                acc[m] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(xr), acc[m]);                   \
                acc[m] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(xr + 1), acc[m]);               \
            }                                                                                    \
        }                                                                                        \
        GROUP_EPILOGUE(MB, gp + GROUP * TILE / 2, half, 1, sx, G, g);                           \
    }                                                                                            \
    for (int m = 0; m < MB; m++) _mm256_storeu_ps(out + m * TILE, tot[m]);                       \
}
#endif

DEF_BLOCK(1) DEF_BLOCK(2) DEF_BLOCK(3) DEF_BLOCK(4)
#if MAXB > 4
DEF_BLOCK(5) DEF_BLOCK(6) DEF_BLOCK(7) DEF_BLOCK(8)
#endif

typedef void (*block_fn)(const uint8_t *, int, const xelem *, const float *, int, float *);
static const block_fn BLOCKS[MAXB + 1] = {
    0, block_1, block_2, block_3, block_4,
#if MAXB > 4
    block_5, block_6, block_7, block_8,
#endif
};

int cs_q4_tile(void) { return TILE; }

/* Several tiles at once (the AVX2 build). A row's group sum over a tile is one chain of 32
   dependent FMAs (k in order: that order is the row's bits), so one tile of one row keeps a
   single chain in flight and the FMA unit waits on its latency most of the time. NT tiles of MB
   rows give MB * NT independent chains, each computed exactly as the one-tile block computes
   it (same operations, same order): the same bits, for any number of rows or tiles. Tiles are
   `stride` bytes apart in the pack; tile j's results go to out + j * MAXB * TILE. */
#if !defined(__AVX512BF16__)
#define DEF_BLOCKN(MB, NT)                                                                        \
static void blockn_##MB##_##NT(const uint8_t *wp, size_t stride, int half, const float *x,      \
                               const float *sx, int K, float *out) {                             \
    const __m256i low4 = _mm256_set1_epi32(0xF);                                                 \
    const int G = K / GROUP;                                                                     \
    __m256 tot[MB][NT];                                                                          \
    for (int m = 0; m < MB; m++)                                                                 \
        for (int j = 0; j < NT; j++) tot[m][j] = _mm256_setzero_ps();                            \
    for (int g = 0; g < G; g++) {                                                                \
        __m256 acc[MB][NT];                                                                      \
        for (int m = 0; m < MB; m++)                                                             \
            for (int j = 0; j < NT; j++) acc[m][j] = _mm256_setzero_ps();                        \
        const uint8_t *gp = wp + (size_t)g * GROUP_BYTES(half);                                  \
        for (int s = 0; s < GROUP / 2; s++) {                                                    \
            const int k = g * GROUP + s * 2;                                                     \
            __m256 lo[NT], hi[NT];                                                               \
            for (int j = 0; j < NT; j++) {                                                       \
                __m256i w = _mm256_cvtepu8_epi32(                                                \
                    _mm_loadl_epi64((const __m128i *)(gp + j * stride + s * 8)));                \
                lo[j] = _mm256_cvtepi32_ps(_mm256_and_si256(w, low4));                           \
                hi[j] = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));                             \
            }                                                                                    \
            for (int m = 0; m < MB; m++) {                                                       \
                const __m256 xa = _mm256_broadcast_ss(x + (size_t)m * K + k);                    \
                const __m256 xb = _mm256_broadcast_ss(x + (size_t)m * K + k + 1);                \
                for (int j = 0; j < NT; j++) {                                                   \
                    acc[m][j] = _mm256_fmadd_ps(lo[j], xa, acc[m][j]);                           \
                    acc[m][j] = _mm256_fmadd_ps(hi[j], xb, acc[m][j]);                           \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int j = 0; j < NT; j++) {                                                           \
            const uint8_t *sp = gp + j * stride + GROUP * TILE / 2;                               \
            const __m256 sc = VLOAD_SCALES(sp, half);                                            \
            const __m256 mn = VLOAD_SCALES(sp + TILE * (half ? 2 : 4), half);                    \
            for (int m = 0; m < MB; m++) {                                                       \
                tot[m][j] = _mm256_fmadd_ps(acc[m][j], sc, tot[m][j]);                           \
                tot[m][j] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sx[(size_t)m * G + g]), tot[m][j]); \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    for (int m = 0; m < MB; m++)                                                                 \
        for (int j = 0; j < NT; j++) _mm256_storeu_ps(out + j * MAXB * TILE + m * TILE, tot[m][j]); \
}
DEF_BLOCKN(1, 8) DEF_BLOCKN(1, 4) DEF_BLOCKN(1, 2) DEF_BLOCKN(2, 4) DEF_BLOCKN(2, 2)
DEF_BLOCKN(3, 2) DEF_BLOCKN(4, 2)

typedef void (*blockn_fn)(const uint8_t *, size_t, int, const float *, const float *, int, float *);
/* [MB][log2 NT]: the multi-tile blocks (0 where MB * NT would pass 8 chains: registers) */
static const blockn_fn BLOCKN[MAXB + 1][4] = {
    {0, 0, 0, 0},
    {0, blockn_1_2, blockn_1_4, blockn_1_8},
    {0, blockn_2_2, blockn_2_4, 0},
    {0, blockn_3_2, 0, 0},
    {0, blockn_4_2, 0, 0},
};
#define UNIT_MAX 8
#else
#define UNIT_MAX 1
#endif

/* mb rows (x, sx as the blocks take them) times nt tiles from wp (stride bytes apart) into
   out + j * MAXB * TILE for tile j: the widest multi-tile blocks first, one tile at a time for
   the rest. */
static void q4_tiles(const uint8_t *wp, size_t stride, int nt, int half, const xelem *x,
                     const float *sx, int K, int mb, float *out) {
    int j = 0;
#if !defined(__AVX512BF16__)
    for (int l = 3; l >= 1; l--)
        while (BLOCKN[mb][l] && nt - j >= (1 << l)) {
            BLOCKN[mb][l](wp + (size_t)j * stride, stride, half, x, sx, K, out + (size_t)j * MAXB * TILE);
            j += 1 << l;
        }
#endif
    for (; j < nt; j++)
        BLOCKS[mb](wp + (size_t)j * stride, half, x, sx, K, out + (size_t)j * MAXB * TILE);
}

/* Tiles per unit of work that the threads share (q4_tiles' nt): the widest of 8, 4, 2 whose
   unit count splits evenly over `threads` or gives each thread at least 8 units. */
static int q4_unit(int T, int threads) {
    for (int u = UNIT_MAX; u > 1; u /= 2) {
        const int units = (T + u - 1) / u;
        if (units % threads == 0 || units >= 8 * threads) return u;
    }
    return 1;
}

static inline int team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

static inline int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* x: bf16 bits [M, K]; pack: N / TILE tiles of K / 32 groups (GROUP_BYTES each); y: [M, N], bf16
   bits when out_bf16, else fp32. Returns 0, or -1 when out of memory. */
/* What the products read of x: each row's group sums (one fixed order) into *sx, and x as the
   blocks take it into *x (the bf16 bits as given on AVX-512-BF16; float32 in *xf on AVX2).
   Returns 0, or -1 when out of memory (nothing left allocated). */
static int rows_in(const uint16_t *xb, int M, int K, float **sx, float **xf, const xelem **x) {
    const int G = K / GROUP;
    *sx = (float *)malloc(sizeof(float) * ((size_t)M * G + 1));
#if defined(__AVX512BF16__)
    *xf = 0;
    *x = xb;
#else
    *xf = (float *)malloc(sizeof(float) * ((size_t)M * K + 1));
    *x = *xf;
#endif
    if (!*sx || !*x) { free(*sx); free(*xf); return -1; }
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            for (int j = 0; j < GROUP; j++) {
                const float v = bf16_to_f32(xb[(size_t)m * K + g * GROUP + j]);
                s += v;
                if (*xf) (*xf)[(size_t)m * K + g * GROUP + j] = v;
            }
            (*sx)[(size_t)m * G + g] = s;
        }
    return 0;
}

/* A block's results (mb rows of TILE columns from column t * TILE) into y, bf16 or float32. */
static void rows_out(const float *out, int mb, int m0, int N, int t, void *y, int out_bf16) {
    for (int m = 0; m < mb; m++) {
        const size_t at = (size_t)(m0 + m) * N + (size_t)t * TILE;
        if (out_bf16)
            for (int c = 0; c < TILE; c++) ((uint16_t *)y)[at + c] = f32_to_bf16(out[m * TILE + c]);
        else
            memcpy((float *)y + at, out + m * TILE, sizeof(float) * TILE);
    }
}

/* AMX (the amx build: AVX-512-BF16 plus AMX-BF16 tiles, used only where the OS lets this
   process use them: cpu_native.py asks for them first). The q4 and q8 products take the tile
   unit for every row count: per tile of 16 output columns and group, the group's 4-bit or
   int8 values go to bfloat16 (exactly) in a B tile of 16 k pairs, the rows' inputs of
   the group are an A tile read in place, and one TDPBF16PS gives every row's group sum d at
   once; then y += scale * d + min * sum x, the blocks' epilogue. A row's d is the tile
   unit's dot product of that row alone (row m of C depends only on row m of A: a row's bits
   alone equal its bits among 16 rows, tested), so the product stays row-invariant; it is not
   bit-equal to the AVX-512 blocks' (the tile unit sums a group's 32 products in its own order:
   about 0.5% of outputs differ in the last bit), which is why a library is one build or the
   other. Cost (one thread): a 1-row product about the AVX-512 blocks'; 7 rows ~1.4x one row
   (the blocks: ~3x), 16 rows ~1.9x. */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define CS_AMX 1
#define AMX_ROWS 16  /* rows of an A / C tile */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* This thread's tiles for `rows` rows and groups of `gs` inputs: C 0 and 1 (rows x 16
   float32), A 4 and 6 (rows x gs bf16), B 5 and 7 (gs / 2 k pairs x 16 columns of bf16
   pairs). */
static void amx_config(int rows, int gs) {
    amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = c.rows[4] = c.rows[6] = (uint8_t)rows;
    c.rows[5] = c.rows[7] = (uint8_t)(gs / 2);
    c.colsb[0] = c.colsb[1] = c.colsb[5] = c.colsb[7] = 64;
    c.colsb[4] = c.colsb[6] = (uint16_t)(2 * gs);
    _tile_loadconfig(&c);
}

/* The B tile of one 4-bit group (its GROUP * TILE / 2 bytes at gp): row 2s holds the pairs
   (q[4s], q[4s + 1]) of the 16 columns as bf16, row 2s + 1 (q[4s + 2], q[4s + 3]). */
static inline void amx_b_q4(const uint8_t *gp, uint16_t *bs) {
    const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
    const __m512i low4 = _mm512_set1_epi16(0xF);
    for (int s = 0; s < GROUP / 4; s++) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(gp + s * 32)));
        _mm512_store_si512((__m512i *)(bs + 64 * s), _mm512_permutexvar_epi16(_mm512_and_si512(w, low4), table));
        _mm512_store_si512((__m512i *)(bs + 64 * s + 32), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table));
    }
}

/* The B tile of one 8-bit group of gs inputs (gs * TILE int8 at gp, k pairs per column as the
   AVX-512 q8 pack holds them): row s the pairs (q[2s], q[2s + 1]) of the 16 columns as bf16
   (exact). */
static inline void amx_b_q8(const uint8_t *gp, int gs, uint16_t *bs) {
    for (int s = 0; s < gs / 2; s++)
        _mm512_store_si512((__m512i *)(bs + 32 * s),
                           (__m512i)_mm512_cvtne2ps_pbh(Q8_LOAD(gp + s * 32 + 16), Q8_LOAD(gp + s * 32)));
}

/* out[M, TILE] = x[M, K] (bf16 rows, M <= AMX_ROWS, the tiles configured for M rows and gs)
   times one tile of a q4 (bits 4) or q8 (bits 8, groups of gs) pack at wp, two groups per
   step; sx: the rows' sums per group of GROUP (read only with mins, which gs = GROUP has). */
static void amx_rows(int bits, int gs, const uint8_t *wp, int half, int has_min, const uint16_t *x,
                     const float *sx, int M, int K, float *out) {
    const int G = K / gs;
    const size_t gbytes = bits == 8 ? Q8_GROUP_BYTES(gs, half, has_min) : GROUP_BYTES(half);
    const size_t vbytes = bits == 8 ? (size_t)gs * TILE : GROUP * TILE / 2;  /* values, then scales */
    __attribute__((aligned(64))) uint16_t bs[2][GROUP * TILE];
    __attribute__((aligned(64))) float cb[2][AMX_ROWS * TILE];
    __m512 tot[AMX_ROWS];
    for (int m = 0; m < M; m++) tot[m] = _mm512_setzero_ps();
    for (int g = 0; g < G; g += 2) {
        const int two = g + 1 < G;
        const uint8_t *gp = wp + (size_t)g * gbytes;
        for (int j = 0; j <= two; j++) {
            if (bits == 8) amx_b_q8(gp + j * gbytes, gs, bs[j]);
            else amx_b_q4(gp + j * gbytes, bs[j]);
        }
        _tile_zero(0);
        _tile_loadd(4, x + (size_t)g * gs, 2 * K);
        _tile_loadd(5, bs[0], 64);
        _tile_dpbf16ps(0, 4, 5);
        if (two) {
            _tile_zero(1);
            _tile_loadd(6, x + (size_t)(g + 1) * gs, 2 * K);
            _tile_loadd(7, bs[1], 64);
            _tile_dpbf16ps(1, 6, 7);
        }
        _tile_stored(0, cb[0], 64);
        if (two) _tile_stored(1, cb[1], 64);
        for (int j = 0; j <= two; j++) {
            const __m512 *acc = (const __m512 *)cb[j];  /* row m's group sums d: acc[m] */
            GROUP_EPILOGUE(M, gp + j * gbytes + vbytes, half, has_min, sx, G, g + j);
        }
    }
    for (int m = 0; m < M; m++) _mm512_storeu_ps(out + m * TILE, tot[m]);
}

/* Configure this thread's tiles for `mb` rows and groups of gs unless they are (`*cfg`: rows
   times 64 plus gs of their configuration, 0 for none yet). */
static inline void amx_rows_for(int mb, int gs, int *cfg) {
    if (mb * 64 + gs != *cfg) {
        amx_config(mb, gs);
        *cfg = mb * 64 + gs;
    }
}
/* cs_q4_gemm / cs_q8_gemm (bits 4 / 8) on the tile unit: x bf16 [M, K] and its group sums
   sx; the pack's tiles shared among the threads, each configuring its own tiles. */
static void amx_gemm(int bits, int gs, const uint16_t *x, const float *sx, int M, int K, int N,
                     const uint8_t *pack, int half, int has_min, void *y, int out_bf16) {
    const int G = K / GROUP, T = N / TILE;
    const size_t tile_bytes = (size_t)(K / gs) * (bits == 8 ? Q8_GROUP_BYTES(gs, half, has_min)
                                                            : GROUP_BYTES(half));
    #pragma omp parallel
    {
        int rows = 0;
        float out[AMX_ROWS * TILE];
        #pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            for (int m0 = 0; m0 < M; m0 += AMX_ROWS) {
                const int mb = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
                amx_rows_for(mb, gs, &rows);
                amx_rows(bits, gs, pack + (size_t)t * tile_bytes, half, has_min, x + (size_t)m0 * K,
                         sx + (size_t)m0 * G, mb, K, out);
                rows_out(out, mb, m0, N, t, y, out_bf16);
            }
        }
        if (rows) _tile_release();
    }
}
#else
#define CS_AMX 0
#endif

int cs_amx(void) { return CS_AMX; }

int cs_q4_gemm(const uint16_t *xb, int M, int K, int N, const uint8_t *pack, int half, void *y,
               int out_bf16) {
    float *sx, *xf;
    const xelem *x;
    if (rows_in(xb, M, K, &sx, &xf, &x)) return -1;
#if CS_AMX
    amx_gemm(4, GROUP, x, sx, M, K, N, pack, half, 1, y, out_bf16);
#else
    const int G = K / GROUP, T = N / TILE;
    const size_t stride = (size_t)G * GROUP_BYTES(half);
    const int unit = q4_unit(T, max_threads());
    #pragma omp parallel for schedule(static)
    for (int u = 0; u < (T + unit - 1) / unit; u++) {
        const int t0 = u * unit, nt = T - t0 < unit ? T - t0 : unit;
        float out[UNIT_MAX * MAXB * TILE];
        for (int m0 = 0; m0 < M; m0 += MAXB) {
            const int mb = M - m0 < MAXB ? M - m0 : MAXB;
            q4_tiles(pack + t0 * stride, stride, nt, half, x + (size_t)m0 * K, sx + (size_t)m0 * G, K, mb, out);
            for (int j = 0; j < nt; j++) rows_out(out + j * MAXB * TILE, mb, m0, N, t0 + j, y, out_bf16);
        }
    }
#endif
    free(sx);
    free(xf);
    return 0;
}

/* q8: y[M, N] = x[M, K] @ W^T with W[n, k] = scale[g, n] * q[n, k] (+ min[g, n]), q int8: GGUF's
   Q8_0, and Q5_0 / Q5_1 (5-bit values, exact in int8), y float32 or bf16. Per row and
   group: d = sum_k x[k] * q[n, k] in float32 FMAs (x as float32, q exact), then y += scale * d
   (and y += min * sum_k x[k] when the pack has mins). Pack: per tile, per group, GROUP x TILE int8
   (k-major: the TILE columns of one k together), then the TILE scales and, with `has_min`, the
   TILE mins (float16 when `half`, else float32). Row-invariant as q4. */

#if defined(__AVX512BF16__)
/* AVX-512-BF16: the int8 values go to bf16 (exact) and vdpbf16ps multiplies two k at a time, x
   as bf16; per 2 k, 32 bytes: byte 2c + p holds q[k + p] of column c. */
#define DEF_Q8_BLOCK(MB, GS)                                                                       \
static inline void q8_block_##GS##_##MB(const uint8_t *wp, int half, int has_min, const uint16_t *x,  \
                                 const float *sx, int K, float *out) {                           \
    VEC tot[MB];                                                                                 \
    for (int m = 0; m < MB; m++) tot[m] = VZERO();                                               \
    for (int g = 0; g < K / (GS); g++) {                                                        \
        const uint8_t *gp = wp + (size_t)g * Q8_GROUP_BYTES(GS, half, has_min);                  \
        VEC acc[MB];                                                                             \
        for (int m = 0; m < MB; m++) acc[m] = VZERO();                                           \
        for (int s = 0; s < (GS) / 2; s++) {                                                    \
            const int k = g * (GS) + s * 2;                                                     \
            const __m512bh w = _mm512_cvtne2ps_pbh(Q8_LOAD(gp + s * 32 + 16), Q8_LOAD(gp + s * 32)); \
            for (int m = 0; m < MB; m++) {                                                       \
                uint32_t p0;                                                                     \
                memcpy(&p0, x + (size_t)m * K + k, 4);                                           \
                acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32((int)p0));      \
            }                                                                                    \
        }                                                                                        \
        GROUP_EPILOGUE(MB, gp + (GS) * TILE, half, has_min, sx, K / GROUP, g);                 \
    }                                                                                            \
    for (int m = 0; m < MB; m++) VSTORE(out + m * TILE, tot[m]);                                 \
}
#else
#define DEF_Q8_BLOCK(MB, GS)                                                                       \
static inline void q8_block_##GS##_##MB(const uint8_t *wp, int half, int has_min, const float *x,     \
                                 const float *sx, int K, float *out) {                           \
    VEC tot[MB];                                                                                 \
    for (int m = 0; m < MB; m++) tot[m] = VZERO();                                               \
    for (int g = 0; g < K / (GS); g++) {                                                        \
        const uint8_t *gp = wp + (size_t)g * Q8_GROUP_BYTES(GS, half, has_min);                  \
        VEC acc[MB];                                                                             \
        for (int m = 0; m < MB; m++) acc[m] = VZERO();                                           \
        for (int j = 0; j < (GS); j++) {                                                        \
            const VEC w = Q8_LOAD(gp + j * TILE);                                                \
            for (int m = 0; m < MB; m++)                                                         \
                acc[m] = VFMA(w, VSET1(x[(size_t)m * K + g * (GS) + j]), acc[m]);               \
        }                                                                                        \
        GROUP_EPILOGUE(MB, gp + (GS) * TILE, half, has_min, sx, K / GROUP, g);                 \
    }                                                                                            \
    for (int m = 0; m < MB; m++) VSTORE(out + m * TILE, tot[m]);                                 \
}
#endif
/* (groups of 16 have no mins: their blocks' epilogue never reads sx, whose sums are per 32) */
#define DEF_Q8_BLOCKS(GS) DEF_Q8_BLOCK(1, GS) DEF_Q8_BLOCK(2, GS) DEF_Q8_BLOCK(3, GS) DEF_Q8_BLOCK(4, GS)
DEF_Q8_BLOCKS(32) DEF_Q8_BLOCKS(16)
#if MAXB > 4
#define DEF_Q8_BLOCKS_8(GS) DEF_Q8_BLOCK(5, GS) DEF_Q8_BLOCK(6, GS) DEF_Q8_BLOCK(7, GS) DEF_Q8_BLOCK(8, GS)
DEF_Q8_BLOCKS_8(32) DEF_Q8_BLOCKS_8(16)
#endif

typedef void (*q8_block_fn)(const uint8_t *, int, int, const xelem *, const float *, int, float *);
/* [0]: groups of GROUP, [1]: of Q8_GROUP16 */
static const q8_block_fn Q8_BLOCKS[2][MAXB + 1] = {
    {0, q8_block_32_1, q8_block_32_2, q8_block_32_3, q8_block_32_4,
#if MAXB > 4
     q8_block_32_5, q8_block_32_6, q8_block_32_7, q8_block_32_8,
#endif
    },
    {0, q8_block_16_1, q8_block_16_2, q8_block_16_3, q8_block_16_4,
#if MAXB > 4
     q8_block_16_5, q8_block_16_6, q8_block_16_7, q8_block_16_8,
#endif
    },
};

/* Whether the q8 kernel takes groups of gs inputs (with mins: has_min) over K inputs. */
static int q8_takes(int gs, int has_min, int K) {
    return (gs == GROUP || (gs == Q8_GROUP16 && !has_min)) && K % GROUP == 0;
}

/* x: bf16 bits [M, K]; pack: N / TILE tiles of K / gs groups (Q8_GROUP_BYTES each); y: [M, N],
   bf16 bits when out_bf16, else float32. Returns 0, -1 when out of memory, -2 for groups it
   does not take (q8_takes). */
int cs_q8_gemm(const uint16_t *xb, int M, int K, int N, const uint8_t *pack, int half, int has_min,
               int gs, void *y, int out_bf16) {
    float *sx, *xf;
    const xelem *x;
    if (!q8_takes(gs, has_min, K)) return -2;
    if (rows_in(xb, M, K, &sx, &xf, &x)) return -1;
#if CS_AMX
    amx_gemm(8, gs, x, sx, M, K, N, pack, half, has_min, y, out_bf16);
#else
    const int G = K / GROUP, T = N / TILE;
    const q8_block_fn *blocks = Q8_BLOCKS[gs == Q8_GROUP16];
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        const uint8_t *wp = pack + (size_t)t * (K / gs) * Q8_GROUP_BYTES(gs, half, has_min);
        float out[MAXB * TILE];
        for (int m0 = 0; m0 < M; m0 += MAXB) {
            const int mb = M - m0 < MAXB ? M - m0 : MAXB;
            blocks[mb](wp, half, has_min, x + (size_t)m0 * K, sx + (size_t)m0 * G, K, out);
            rows_out(out, mb, m0, N, t, y, out_bf16);
        }
    }
#endif
    free(sx);
    free(xf);
    return 0;
}

/* q4 with int8 activations (cs_q4i8_gemm, and cs_forward when its model asks), on every build:
   with the CPU's integer dot products where the build has them (AVX-512-VNNI's vpdpbusd on the
   AVX-512 build, AVX-VNNI's on the AVX2 build; cs_vnni() says whether), else with byte pairs
   (vpmaddubsw, then vpmaddwd by ones once a group: llama.cpp's AVX2 path), which give the
   same integers. Each group of GROUP inputs of a row is quantized on its
   own, as llama.cpp's Q8_0 does it: d = max|x| / 127, xq = round(x / d), but with d kept in
   float32 (Q8_0 rounds it to float16) and ties rounded to even (Q8_0: away from zero). Per
   output column and group acc = sum_k xq[k] * q[n, k] is exact in int32
   (|acc| <= 32 * 15 * 127), then y += (scale * d) * acc and y += min * (d * sum_k xq[k]): the
   min term on the quantized inputs too, as llama.cpp's product with Q8_0 takes it (a file's
   weights scale * q + min are about centred, so the two terms' quantization errors largely
   cancel: with the exact sums of x instead, the error measured ~1.3x larger). A row's
   quantization reads only that row and its instruction sequence is the row's own, so the
   product is row-invariant like q4. The 4-bit pack is q4's: per 4 k a 32-bit lane of a
   column holds q[k], q[k + 2], q[k + 1], q[k + 3] on the AVX-512 build (from its byte pairs)
   and q[k .. k + 3] in order on the AVX2 build, so each row's xq is stored in that order.
   Byte pairs: vpmaddubsw sums two products q * xq into int16 (|sum| <= 2 * 15 * 127 = 3810, no
   saturation) and a group's 8 steps add up in int16 (<= 30480 < 32767, no wrap) before
   vpmaddwd widens them: exact, the same acc as vpdpbusd's. */
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define CS_VNNI 1
#else
#define CS_VNNI 0
#endif

int cs_vnni(void) { return CS_VNNI; }

/* bytes a row's int8 inputs take per input (quant_row's layout): 1 on the AVX-512 build; 4 on
   the AVX2 build, which stores each 8 inputs as the 32 bytes its products read (i8_weights2) */
#if defined(__AVX512BF16__)
#define XQ_SPREAD 1
#else
#define XQ_SPREAD 4
#endif

/* One row's K inputs (bf16 bits) to int8 [K] in the build's lane order and per group two
   float32 [2 * K / GROUP]: its scale d and d * the sum of its int8 values. d = max|x| / 127,
   xq = x * (1 / d) rounded to nearest, ties to even (the vector conversion's; llama.cpp's
   roundf takes ties away from zero: they differ only on an exact tie). Both builds compute
   the same values. */
#if defined(__AVX512BF16__)
static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static void quant_row(const uint16_t *xb, int K, int8_t *xq, float *dx) {
    const __m128i order = _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    for (int g = 0; g < K / GROUP; g++) {
        const __m512 v0 = bf16x16(xb + g * GROUP), v1 = bf16x16(xb + g * GROUP + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        const __m512 s = _mm512_set1_ps(id);
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, s)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, s));
        dx[2 * g] = d;
        dx[2 * g + 1] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
        const __m128i q0 = _mm512_cvtsepi32_epi8(i0), q1 = _mm512_cvtsepi32_epi8(i1);
        _mm_storeu_si128((__m128i *)(xq + g * GROUP), _mm_shuffle_epi8(q0, order));  /* k, k+2, k+1, k+3 */
        _mm_storeu_si128((__m128i *)(xq + g * GROUP + 16), _mm_shuffle_epi8(q1, order));
    }
}
#else
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static void quant_row(const uint16_t *xb, int K, int8_t *xq, float *dx) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int g = 0; g < K / GROUP; g++) {
        __m256 v[4];
        __m256 a = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = bf16x8(xb + g * GROUP + 8 * i);
            a = _mm256_max_ps(a, _mm256_and_ps(v[i], abs_mask));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float d = _mm_cvtss_f32(h) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        const __m256 s = _mm256_set1_ps(id);
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], s));
        __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4e));
        u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xb1));
        dx[2 * g] = d;
        dx[2 * g + 1] = d * (float)_mm_cvtsi128_si32(u);
        /* packs interleave the 128-bit halves: the permute puts the 32 values back in order */
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        const __m256i inorder = _mm256_permutevar8x32_epi32(b, order);
        for (int j = 0; j < 4; j++) {  /* xq[k .. k + 3] x 4, then xq[k + 4 .. k + 7] x 4 */
            const int e = 2 * j, o = 2 * j + 1;
            _mm256_storeu_si256((__m256i *)(xq + (size_t)(g * GROUP + 8 * j) * XQ_SPREAD),
                                _mm256_permutevar8x32_epi32(inorder, _mm256_setr_epi32(e, e, e, e, o, o, o, o)));
        }
    }
}
#endif

#if defined(__AVX512BF16__)
#define IVEC __m512i
#define IZERO _mm512_setzero_si512
#define ISET1 _mm512_set1_epi32
#define ITOF _mm512_cvtepi32_ps
#if CS_VNNI
#define I8_DOT(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define I8_SUM(acc) (acc)
#else
#define I8_DOT(acc, w, x) _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x))
#define I8_SUM(acc) _mm512_madd_epi16(acc, _mm512_set1_epi16(1))
#endif
/* the 4-bit values of 4 k of the tile (32 bytes at p) as one u8 lane of 4 per column */
static inline __m512i i8_weights(const uint8_t *p) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_and_si512(_mm512_or_si512(w, _mm512_slli_epi16(w, 4)), _mm512_set1_epi16(0x0F0F));
}
#define I8_STEP_BYTES 32
#else
#define IVEC __m256i
#define IZERO _mm256_setzero_si256
#define ISET1 _mm256_set1_epi32
#define ITOF _mm256_cvtepi32_ps
#if CS_VNNI
#define I8_DOT(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#define I8_SUM(acc) (acc)
#else
#define I8_DOT(acc, w, x) _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x))
#define I8_SUM(acc) _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
#endif
/* Two steps of 4 k at once (32 bytes at p; per step byte c holds q[k], q[k + 1] of column c in
   its low and high nibble, byte 8 + c q[k + 2], q[k + 3]): c03 gets columns 0-3 and c47
   columns 4-7, each as one u8 lane of q[k .. k + 3] per column, the first step in the low 128
   bits and the second in the high (in-lane unpacks only; the halves are added once a group) */
static inline void i8_weights2(const uint8_t *p, __m256i *c03, __m256i *c47) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), low4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
    *c03 = _mm256_unpacklo_epi16(a, b);
    *c47 = _mm256_unpackhi_epi16(a, b);
}
#endif

#if !defined(__AVX512BF16__)
/* i8_weights2's halves back to one int32 lane per column: (columns 0-3 | 4-7) of the two steps */
static inline __m256i i8_fold(__m256i c03, __m256i c47) {
    return _mm256_add_epi32(_mm256_permute2x128_si256(c03, c47, 0x20), _mm256_permute2x128_si256(c03, c47, 0x31));
}
#endif

/* the end of group g of a block of MB rows: tot[m] += (scale * d) * ACC + min * (d * sum xq),
   ACC the row's int32 dot products of the group (an expression of m) */
#define I8_GROUP_END(MB, gp, half, dx, G, g, ACC)                                                \
    do {                                                                                         \
        const uint8_t *sp_ = (gp) + GROUP * TILE / 2;                                            \
        const VEC sc_ = VLOAD_SCALES(sp_, half);                                                 \
        const VEC mn_ = VLOAD_SCALES(sp_ + TILE * ((half) ? 2 : 4), half);                      \
        for (int m = 0; m < MB; m++) {                                                           \
            const float *dg = (dx) + 2 * ((size_t)m * (G) + (g));                                \
            tot[m] = VFMA(ITOF(ACC), VMUL_(sc_, VSET1(dg[0])), tot[m]);                          \
            tot[m] = VFMA(mn_, VSET1(dg[1]), tot[m]);                                            \
        }                                                                                        \
    } while (0)

#if defined(__AVX512BF16__)
#define DEF_I8_BLOCK(MB)                                                                         \
static inline void i8_block_##MB(const uint8_t *wp, int half, const int8_t *xq, const float *dx, \
                                 int K, float *out) {                                            \
    const int G = K / GROUP;                                                                     \
    VEC tot[MB];                                                                                 \
    for (int m = 0; m < MB; m++) tot[m] = VZERO();                                               \
    for (int g = 0; g < G; g++) {                                                                \
        IVEC acc[MB];                                                                            \
        for (int m = 0; m < MB; m++) acc[m] = IZERO();                                           \
        const uint8_t *gp = wp + (size_t)g * GROUP_BYTES(half);                                  \
        for (int s = 0; s < GROUP / 4; s++) {                                                    \
            const IVEC w = i8_weights(gp + s * I8_STEP_BYTES);                                   \
            for (int m = 0; m < MB; m++) {                                                       \
                int32_t p;                                                                       \
                memcpy(&p, xq + (size_t)m * K + g * GROUP + s * 4, 4);                           \
                acc[m] = I8_DOT(acc[m], w, ISET1(p));                                            \
            }                                                                                    \
        }                                                                                        \
        I8_GROUP_END(MB, gp, half, dx, G, g, I8_SUM(acc[m]));                                   \
    }                                                                                            \
    for (int m = 0; m < MB; m++) VSTORE(out + m * TILE, tot[m]);                                 \
}
#else
#define DEF_I8_BLOCK(MB)                                                                         \
static inline void i8_block_##MB(const uint8_t *wp, int half, const int8_t *xq, const float *dx, \
                                 int K, float *out) {                                            \
    const int G = K / GROUP;                                                                     \
    VEC tot[MB];                                                                                 \
    for (int m = 0; m < MB; m++) tot[m] = VZERO();                                               \
    for (int g = 0; g < G; g++) {                                                                \
        IVEC a03[MB], a47[MB];                                                                   \
        for (int m = 0; m < MB; m++) a03[m] = a47[m] = IZERO();                                  \
        const uint8_t *gp = wp + (size_t)g * GROUP_BYTES(half);                                  \
        for (int s = 0; s < GROUP / 4; s += 2) {                                                 \
            IVEC w03, w47;                                                                       \
            i8_weights2(gp + s * 16, &w03, &w47);                                                \
            for (int m = 0; m < MB; m++) {                                                       \
                const IVEC x = _mm256_loadu_si256(                                               \
                    (const __m256i *)(xq + ((size_t)m * K + g * GROUP + s * 4) * XQ_SPREAD));    \
                a03[m] = I8_DOT(a03[m], w03, x);                                                 \
                a47[m] = I8_DOT(a47[m], w47, x);                                                 \
            }                                                                                    \
        }                                                                                        \
        I8_GROUP_END(MB, gp, half, dx, G, g, i8_fold(I8_SUM(a03[m]), I8_SUM(a47[m])));          \
    }                                                                                            \
    for (int m = 0; m < MB; m++) VSTORE(out + m * TILE, tot[m]);                                 \
}
#endif
DEF_I8_BLOCK(1) DEF_I8_BLOCK(2) DEF_I8_BLOCK(3) DEF_I8_BLOCK(4)
#if MAXB > 4
DEF_I8_BLOCK(5) DEF_I8_BLOCK(6) DEF_I8_BLOCK(7) DEF_I8_BLOCK(8)
#endif
typedef void (*i8_block_fn)(const uint8_t *, int, const int8_t *, const float *, int, float *);
static const i8_block_fn I8_BLOCKS[MAXB + 1] = {
    0, i8_block_1, i8_block_2, i8_block_3, i8_block_4,
#if MAXB > 4
    i8_block_5, i8_block_6, i8_block_7, i8_block_8,
#endif
};

/* x: bf16 bits [M, K]; pack: a q4 pack; y: [M, N], bf16 bits when out_bf16, else float32.
   Returns 0, -1 when out of memory. */
int cs_q4i8_gemm(const uint16_t *xb, int M, int K, int N, const uint8_t *pack, int half, void *y,
                 int out_bf16) {
    const int G = K / GROUP, T = N / TILE;
    float *dx = (float *)malloc(sizeof(float) * (2 * (size_t)M * G + 1));
    int8_t *xq = (int8_t *)malloc((size_t)M * K * XQ_SPREAD + 4);
    if (!dx || !xq) { free(dx); free(xq); return -1; }
    for (int m = 0; m < M; m++) quant_row(xb + (size_t)m * K, K, xq + (size_t)m * K * XQ_SPREAD, dx + 2 * (size_t)m * G);
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        const uint8_t *wp = pack + (size_t)t * G * GROUP_BYTES(half);
        float out[MAXB * TILE];
        for (int m0 = 0; m0 < M; m0 += MAXB) {
            const int mb = M - m0 < MAXB ? M - m0 : MAXB;
            I8_BLOCKS[mb](wp, half, xq + (size_t)m0 * K * XQ_SPREAD, dx + 2 * (size_t)m0 * G, K, out);
            rows_out(out, mb, m0, N, t, y, out_bf16);
        }
    }
    free(dx);
    free(xq);
    return 0;
}

/* Exact decode attention. Row r (one query position of one request) attends over the keys
   [lo[r], hi[r]) of cache slot slot[r], in key order: scores s = (q . k) * scale (soft-capped
   when softcap > 0), p = exp(s - max) with a fixed polynomial exp, o = sum p v / sum p, all in
   float32 from bfloat16 q, k, v. Each (row, kv head) is computed alone with one instruction
   sequence that depends only on its own key count, so a row's bits depend on nothing else in
   the call: a verify row gets exactly the bits of the 1-row decode of the same token. */
/* exp(x) = 2^n * p(r), r = x - n ln 2 (Cephes' expf polynomial): the part both builds share */
static inline VEC exp_poly(VEC x, VEC n) {
    VEC r = VFNMADD(n, VSET1(0.693359375f), x);
    r = VFNMADD(n, VSET1(-2.12194440e-4f), r);
    VEC p = VSET1(1.9875691500E-4f);
    p = VFMA(p, r, VSET1(1.3981999507E-3f));
    p = VFMA(p, r, VSET1(8.3334519073E-3f));
    p = VFMA(p, r, VSET1(4.1665795894E-2f));
    p = VFMA(p, r, VSET1(1.6666665459E-1f));
    p = VFMA(p, r, VSET1(5.0000001201E-1f));
    return VFMA(p, VMUL_(r, r), VADD_(r, VSET1(1.0f)));
}

#if defined(__AVX512BF16__)
#define W 16
static inline VEC vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline float vsum(VEC v) { return _mm512_reduce_add_ps(v); }
/* lane j of the result: the sum of a[j]'s lanes (16 horizontal sums in ~30 shuffles and adds) */
static inline VEC vsum_each(const VEC *a) {
    VEC b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const VEC e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const VEC e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline VEC vexp(VEC x) {  /* exp(x); exactly 0 below -87.3 (and for -inf) */
    const VEC lo = _mm512_set1_ps(-87.3f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const VEC n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(exp_poly(x, n), n));
}
#define VLOADU _mm512_loadu_ps
#define VMUL _mm512_mul_ps
#define VSUB _mm512_sub_ps
#define VADD _mm512_add_ps
#else
#define W 8
static inline VEC vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float vsum(VEC v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* lane j of the result: the sum of a[j]'s lanes */
static inline VEC vsum_each(const VEC *a) {
    VEC b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}
static inline VEC vexp(VEC x) {
    const VEC lo = _mm256_set1_ps(-87.3f);
    const VEC keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_max_ps(x, lo);
    const VEC n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const VEC p = exp_poly(x, n);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}
#define VLOADU _mm256_loadu_ps
#define VMUL _mm256_mul_ps
#define VSUB _mm256_sub_ps
#define VADD _mm256_add_ps
#endif

#define MAX_HD 256
#define MAX_G 16

int cs_attention_width(void) { return W; }

#define PV_HEADS(CC)                                                                             \
    for (int g = 0; g < G; g++) {                                                                \
        VEC a[CC];                                                                               \
        for (int c = 0; c < CC; c++) a[c] = VZERO();                                             \
        const float *pg = s + (size_t)g * np;                                                    \
        for (int j = 0; j < n; j++) {                                                            \
            const uint16_t *vp = v_cache + (base + (size_t)(lo[r] + j) * KV) * hd;               \
            const VEC p = VSET1(pg[j]);                                                          \
            for (int c = 0; c < CC; c++) a[c] = VFMA(p, vload_bf16(vp + c * W), a[c]);          \
        }                                                                                        \
        for (int c = 0; c < CC; c++) VSTORE(acc[g] + c * W, a[c]);                               \
    }

/* One (row r, kv head kv) task of the exact attention: row r's G = H / KV query heads (row r of
   q starts at r * q_stride) over its keys, into out (row r at r * H * hd). 0, or -1 when out
   of memory. */
static int attn_task(const uint16_t *q, size_t q_stride, const uint16_t *k_cache,
                     const uint16_t *v_cache, int L, const int32_t *slot, const int32_t *lo,
                     const int32_t *hi, int r, int kv, int H, int KV, int hd, float scale,
                     float softcap, uint16_t *out) {
    const int G = H / KV, C = hd / W;
    const int n = hi[r] - lo[r];
    uint16_t *o = out + ((size_t)r * H + (size_t)kv * G) * hd;
    if (n <= 0) { memset(o, 0, sizeof(uint16_t) * G * hd); return 0; }
    const int np = (n + W - 1) / W * W;  /* scores padded with -inf to whole vectors */
    float *s = (float *)malloc(sizeof(float) * (size_t)G * np);
    if (!s) return -1;
    VEC qv[MAX_G][MAX_HD / W];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) qv[g][c] = vload_bf16(q + (size_t)r * q_stride + ((size_t)kv * G + g) * hd + c * W);
    const size_t base = ((size_t)slot[r] * L) * KV + kv;
    float mx[MAX_G];
    for (int g = 0; g < G; g++) mx[g] = -INFINITY;
    /* q . k: W keys at a time (their W horizontal sums at once), then the keys left one by
       one; which keys go which way depends only on n */
    const int nb = n / W * W;
    for (int j = 0; j < nb; j += W) {
        VEC kf[W][MAX_HD / W];
        for (int jj = 0; jj < W; jj++) {
            const uint16_t *kp = k_cache + (base + (size_t)(lo[r] + j + jj) * KV) * hd;
            for (int c = 0; c < C; c++) kf[jj][c] = vload_bf16(kp + c * W);
        }
        for (int g = 0; g < G; g++) {
            VEC acc[W];
            for (int jj = 0; jj < W; jj++) {
                acc[jj] = VMUL(qv[g][0], kf[jj][0]);
                for (int c = 1; c < C; c++) acc[jj] = VFMA(qv[g][c], kf[jj][c], acc[jj]);
            }
            VSTORE(s + (size_t)g * np + j, vsum_each(acc));
        }
    }
    for (int j = nb; j < n; j++) {
        const uint16_t *kp = k_cache + (base + (size_t)(lo[r] + j) * KV) * hd;
        VEC kf[MAX_HD / W];
        for (int c = 0; c < C; c++) kf[c] = vload_bf16(kp + c * W);
        for (int g = 0; g < G; g++) {
            VEC acc = VMUL(qv[g][0], kf[0]);
            for (int c = 1; c < C; c++) acc = VFMA(qv[g][c], kf[c], acc);
            s[(size_t)g * np + j] = vsum(acc);
        }
    }
    for (int g = 0; g < G; g++) {
        float *sg = s + (size_t)g * np;
        for (int j = 0; j < n; j++) {
            float v = sg[j] * scale;
            if (softcap > 0.f) v = tanhf(v / softcap) * softcap;
            sg[j] = v;
            if (v > mx[g]) mx[g] = v;
        }
    }
    float inv[MAX_G];
    for (int g = 0; g < G; g++) {
        float *sg = s + (size_t)g * np;
        for (int j = n; j < np; j++) sg[j] = -INFINITY;
        const VEC m = VSET1(mx[g]);
        VEC tot = VZERO();
        for (int j = 0; j < np; j += W) {
            const VEC e = vexp(VSUB(VLOADU(sg + j), m));
            VSTORE(sg + j, e);
            tot = VADD(tot, e);
        }
        inv[g] = 1.0f / vsum(tot);
    }
    float acc[MAX_G][MAX_HD] __attribute__((aligned(64)));
    /* sum_j p_j v_j: acc = fma(p_j, v_j, acc) in key order; one head at a time with its
       accumulators in registers for the common head sizes */
    switch (C) {
    case 2: PV_HEADS(2); break;
    case 4: PV_HEADS(4); break;
    case 8: PV_HEADS(8); break;
    case 16: PV_HEADS(16); break;
    default:
        for (int g = 0; g < G; g++) memset(acc[g], 0, sizeof(float) * hd);
        for (int j = 0; j < n; j++) {
            const uint16_t *vp = v_cache + (base + (size_t)(lo[r] + j) * KV) * hd;
            VEC vf[MAX_HD / W];
            for (int c = 0; c < C; c++) vf[c] = vload_bf16(vp + c * W);
            for (int g = 0; g < G; g++) {
                const VEC p = VSET1(s[(size_t)g * np + j]);
                for (int c = 0; c < C; c++) VSTORE(acc[g] + c * W, VFMA(p, vf[c], VLOADU(acc[g] + c * W)));
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < hd; d++) o[(size_t)g * hd + d] = f32_to_bf16(acc[g][d] * inv[g]);
    free(s);
    return 0;
}

/* q: bf16 [R, H, hd]; k_cache, v_cache: bf16 [slots, L, KV, hd]; slot, lo, hi: [R];
   out: bf16 [R, H, hd]. hd a multiple of W, at most MAX_HD; H / KV at most MAX_G.
   Returns 0, -1 when out of memory, -2 for a shape it does not take. */
int cs_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, int L,
                 const int32_t *slot, const int32_t *lo, const int32_t *hi, int R, int H, int KV,
                 int hd, float scale, float softcap, uint16_t *out) {
    const int G = H / KV;
    if (hd % W || hd > MAX_HD || G > MAX_G || G * KV != H) return -2;
    int failed = 0;
    #pragma omp parallel for schedule(static)
    for (int task = 0; task < R * KV; task++)
        if (attn_task(q, (size_t)H * hd, k_cache, v_cache, L, slot, lo, hi, task / KV, task % KV, H,
                      KV, hd, scale, softcap, out)) {
            #pragma omp atomic write
            failed = 1;
        }
    return failed ? -1 : 0;
}

/* ---- The whole decode / verify layer stack in one call (cs_forward) ------------------------

   For R rows (one query position each) and every decoder layer, in one OpenMP team:
     h = RMSNorm(x); qkv = h @ Wqkv (+ b); q / k heads RMSNorm'd (qk-norm); RoPE on q and k;
     k, v written to the layer's bf16 cache at (slot, pos); att = the exact attention above;
     a = att @ Wo (+ b) (RMSNorm'd: gemma); x = x + a; h = RMSNorm(x);
     g, u = h @ Wgate_up (+ b); m = act(g) * u; d = m @ Wdown (+ b) (RMSNorm'd: gemma); x = x + d.
   Every step rounds to bfloat16 where the runner's torch path does (the linears' outputs, a
   norm's result, each RoPE product and sum, act(g), act(g) * u, each residual sum), so the two
   differ only in the order of the float32 sums inside a norm, a product or an activation.
   Each row is computed by one thread with an instruction sequence that depends only on the
   row (the GEMM blocks as cs_q4_gemm / cs_q8_gemm, the attention as cs_attention, the rest
   row by row), so a row's bits do not depend on the other rows of the call. The steps of a
   layer are worksharing loops of the one team (over rows, weight tiles or attention tasks),
   each ending in its barrier: no thread team is started per operation. */

typedef struct {         /* one packed weight [n, k] (cpu_native.GroupPack) and its bias */
    const uint8_t *pack;
    const uint16_t *bias;  /* bf16 [n], or NULL */
    int n, k, bits, half, has_min;
    int group;             /* inputs per group: GROUP, or Q8_GROUP16 for an 8-bit one without mins */
} cs_lin;

typedef struct {         /* one decoder layer */
    cs_lin qkv, o, gate_up, down;
    /* norm weights as float32 [D] ([H + KV, hd] for qk_norm); NULL where the layer has none */
    const float *attn_in, *mlp_in, *attn_out, *mlp_out, *qk_norm;
    int rope;              /* which (cos, sin) pair of the call its RoPE reads */
    int window;            /* which attention rows of the call it reads (its window's) */
} cs_layer;

typedef struct {         /* what every layer shares */
    int layers, D, H, KV, hd, I, rot;  /* I: the MLP's inner size; rot: RoPE'd dims per head */
    int norm_offset;       /* gemma: norm weights hold 1 + w, the product is taken in float32 */
    int gelu;              /* 1: gelu (tanh approximation), 0: silu */
    float eps, scale, softcap;  /* the norms' epsilon; the attention's scale and soft cap (0: none) */
    int int8;              /* 1: the 4-bit products take int8 activations (cs_q4i8_gemm's) */
} cs_model;

static inline float bf(float v) { return bf16_to_f32(f32_to_bf16(v)); }

/* sum_j x[j]^2 over n values in the order of torch's CPU sum of a contiguous float32 row
   (aten SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum, 8-float vectors,
   4 accumulators, a cascade of 4 levels), so that a norm's statistic has torch's bits: one
   sum order, whatever the rows of the call. */
#define SUM_L 8
static float torch_sumsq(const uint16_t *x, int n) {
    const int vecs = n / SUM_L, size = vecs / 4;
    int ceil_log2 = 0;
    while ((1 << ceil_log2) < size) ceil_log2++;
    const int lp = ceil_log2 / 4 > 4 ? ceil_log2 / 4 : 4, step = 1 << lp, mask = step - 1;
    float acc[4][4][SUM_L];
    memset(acc, 0, sizeof acc);
#define SQ(e) (bf16_to_f32(x[e]) * bf16_to_f32(x[e]))
#define ADD_ROW(i) for (int k = 0; k < 4; k++) for (int l = 0; l < SUM_L; l++) \
        acc[0][k][l] += SQ(((i) * 4 + k) * SUM_L + l)
    int i = 0;
    while (i + step <= size) {
        for (int j = 0; j < step; j++, i++) ADD_ROW(i);
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < SUM_L; l++) { acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0.f; }
            if (i & (mask << (j * lp))) break;
        }
    }
    for (; i < size; i++) ADD_ROW(i);
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < SUM_L; l++) acc[0][k][l] += acc[j][k][l];
    for (int t = size * 4; t < vecs; t++)
        for (int l = 0; l < SUM_L; l++) acc[0][0][l] += SQ(t * SUM_L + l);
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < SUM_L; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.f;
    for (int e = vecs * SUM_L; e < n; e++) total += SQ(e);
    for (int l = 0; l < SUM_L; l++) total += acc[0][0][l];
    return total;
#undef ADD_ROW
#undef SQ
}

/* RMSNorm of n values as the runner's torch path: h = x / sqrt(mean(x^2) + eps) in float32
   (the mean as torch takes it: the sum above, divided by n), then bf16(bf16(h) * w) (w a bf16
   weight), or bf16(h * w) for gemma's float32 1 + w. */
static void rms_row(const uint16_t *x, int n, const float *w, float eps, int offset, uint16_t *out) {
    const float inv = 1.0f / sqrtf(torch_sumsq(x, n) / (float)n + eps);
    for (int j = 0; j < n; j++) {
        const float h = bf16_to_f32(x[j]) * inv;
        out[j] = f32_to_bf16(offset ? h * w[j] : bf(h) * w[j]);
    }
}

/* What a product reads of one row of its input (xb, K values): its group sums in one fixed
   order, and on AVX2 the row as float32 (rows_in's work, row by row). */
static void prep_row(const uint16_t *xb, int K, float *sx, float *xf) {
    for (int g = 0; g < K / GROUP; g++) {
        float s = 0.f;
        for (int j = 0; j < GROUP; j++) {
            const float v = bf16_to_f32(xb[g * GROUP + j]);
            s += v;
            if (xf) xf[g * GROUP + j] = v;
        }
        sx[g] = s;
    }
}

/* A product's results (mb rows of TILE columns of tile t, from row m0) into y [., w->n] as
   bf16, rounded where the torch path rounds: the product, then with its bias added. */
static void lin_out(const cs_lin *w, const float *out, int mb, int m0, int t, uint16_t *y) {
    for (int m = 0; m < mb; m++)
        for (int c = 0; c < TILE; c++) {
            const int col = t * TILE + c;
            float v = bf(out[m * TILE + c]);
            if (w->bias) v = bf(v + bf16_to_f32(w->bias[col]));
            y[(size_t)(m0 + m) * w->n + col] = f32_to_bf16(v);
        }
}

/* y[M, n] = x[M, k] @ W^T (+ bias), bf16 out, its weight tiles shared among the team (an
   orphaned worksharing loop: called by every thread of the team). x: the bf16 rows (read on
   AVX-512-BF16), xf: the same as float32 (read on AVX2), sx: their group sums; xq, dx: the
   rows as int8 and their scales (quant_row's), or NULL: where given, 4-bit products take them. */
static void lin_rows(const cs_lin *w, const uint16_t *x, const float *xf, const float *sx,
                     const int8_t *xq, const float *dx, int M, uint16_t *y) {
    const int K = w->k, N = w->n, G = K / GROUP, T = N / TILE;
#if defined(__AVX512BF16__)
    const xelem *xe = x;
    (void)xf;
#else
    const xelem *xe = xf;
    (void)x;
#endif
    const size_t tile_bytes = (size_t)(K / w->group) * (w->bits == 8 ? Q8_GROUP_BYTES(w->group, w->half, w->has_min)
                                                                     : GROUP_BYTES(w->half));
#if CS_AMX
    if (w->bits == 8 || !xq) {  /* the products on the tile unit (every thread alike) */
        int rows = 0;
        float out[AMX_ROWS * TILE];
        #pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            const uint8_t *wp = w->pack + (size_t)t * tile_bytes;
            for (int m0 = 0; m0 < M; m0 += AMX_ROWS) {
                const int mb = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
                amx_rows_for(mb, w->group, &rows);
                amx_rows(w->bits, w->group, wp, w->half, w->has_min, xe + (size_t)m0 * K,
                         sx + (size_t)m0 * G, mb, K, out);
                lin_out(w, out, mb, m0, t, y);
            }
        }
        if (rows) _tile_release();
        return;
    }
#endif
    if (w->bits == 4 && !xq) {  /* several tiles a unit (q4_tiles) */
        const int unit = q4_unit(T, team_size());
        #pragma omp for schedule(static)
        for (int u = 0; u < (T + unit - 1) / unit; u++) {
            const int t0 = u * unit, nt = T - t0 < unit ? T - t0 : unit;
            float out[UNIT_MAX * MAXB * TILE];
            for (int m0 = 0; m0 < M; m0 += MAXB) {
                const int mb = M - m0 < MAXB ? M - m0 : MAXB;
                q4_tiles(w->pack + (size_t)t0 * tile_bytes, tile_bytes, nt, w->half, xe + (size_t)m0 * K,
                         sx + (size_t)m0 * G, K, mb, out);
                for (int j = 0; j < nt; j++) lin_out(w, out + j * MAXB * TILE, mb, m0, t0 + j, y);
            }
        }
        return;
    }
    #pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        const uint8_t *wp = w->pack + (size_t)t * tile_bytes;
        float out[MAXB * TILE];
        for (int m0 = 0; m0 < M; m0 += MAXB) {
            const int mb = M - m0 < MAXB ? M - m0 : MAXB;
            if (w->bits == 8)
                Q8_BLOCKS[w->group == Q8_GROUP16][mb](wp, w->half, w->has_min, xe + (size_t)m0 * K,
                                                      sx + (size_t)m0 * G, K, out);
            else if (xq)
                I8_BLOCKS[mb](wp, w->half, xq + (size_t)m0 * K * XQ_SPREAD, dx + 2 * (size_t)m0 * G, K, out);
            else
                BLOCKS[mb](wp, w->half, xe + (size_t)m0 * K, sx + (size_t)m0 * G, K, out);
            lin_out(w, out, mb, m0, t, y);
        }
    }
}

/* RoPE of one head (hd values, the first rot of them rotated, rotate-half pairs j, j + rot / 2)
   as the torch path: bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)). */
static void rope_head(uint16_t *x, int rot, const uint16_t *cos, const uint16_t *sin) {
    float rx[MAX_HD];
    const int h = rot / 2;
    for (int j = 0; j < rot; j++) rx[j] = bf16_to_f32(x[j]);
    for (int j = 0; j < rot; j++) {
        const float other = j < h ? -rx[j + h] : rx[j - h];
        x[j] = f32_to_bf16(bf(rx[j] * bf16_to_f32(cos[j])) + bf(other * bf16_to_f32(sin[j])));
    }
}

/* After the QKV product of row r: qk-norm, RoPE, and its k and v into the caches. */
static void qkv_row(const cs_model *m, const cs_layer *ly, uint16_t *qkv, int r, const int32_t *write,
                    int R, uint16_t *kc, uint16_t *vc, int L, const uint16_t *const *rope) {
    const int H = m->H, KV = m->KV, hd = m->hd;
    uint16_t *row = qkv + (size_t)r * (H + 2 * KV) * hd;
    const uint16_t *cos = rope[2 * ly->rope] + (size_t)r * m->rot;
    const uint16_t *sin = rope[2 * ly->rope + 1] + (size_t)r * m->rot;
    for (int h = 0; h < H + KV; h++) {
        uint16_t *head = row + (size_t)h * hd;
        if (ly->qk_norm) rms_row(head, hd, ly->qk_norm + (size_t)h * hd, m->eps, m->norm_offset, head);
        rope_head(head, m->rot, cos, sin);
    }
    const size_t at = ((size_t)write[r] * L + (size_t)write[R + r]) * KV * hd;  /* (slot, pos) */
    memcpy(kc + at, row + (size_t)H * hd, sizeof(uint16_t) * KV * hd);
    memcpy(vc + at, row + (size_t)(H + KV) * hd, sizeof(uint16_t) * KV * hd);
}

static inline float act_of(float g, int gelu) {
    if (gelu) return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    return g / (1.0f + expf(-g));
}

/* Scratch of one forward (malloc'd together, freed together). */
typedef struct {
    uint16_t *h, *qkv, *att, *a, *gu, *mid;
    float *sx, *xf;
    int8_t *xq;            /* int8 activations (the model's int8): the next product's rows */
    float *dx;             /* and per row and group their scale and scale * sum (quant_row's) */
} fwd_buf;

static void free_buf(fwd_buf *b) {
    free(b->h); free(b->qkv); free(b->att); free(b->a); free(b->gu); free(b->mid);
    free(b->sx); free(b->xf); free(b->xq); free(b->dx);
}

static int alloc_buf(const cs_model *m, int R, fwd_buf *b) {
    const size_t D = m->D, Q = (size_t)(m->H + 2 * m->KV) * m->hd, A = (size_t)m->H * m->hd;
    size_t kmax = D > A ? D : A;
    if ((size_t)m->I > kmax) kmax = m->I;
    memset(b, 0, sizeof *b);
    b->h = malloc(2 * R * D + 2);
    b->qkv = malloc(2 * R * Q + 2);
    b->att = malloc(2 * R * A + 2);
    b->a = malloc(2 * R * D + 2);
    b->gu = malloc(4 * R * (size_t)m->I + 2);
    b->mid = malloc(2 * R * (size_t)m->I + 2);
    b->sx = malloc(sizeof(float) * (R * kmax / GROUP + 1));
#if !defined(__AVX512BF16__)
    b->xf = malloc(sizeof(float) * (R * kmax + 1));
    if (!b->xf) { free_buf(b); return -1; }
#endif
    if (m->int8) {
        b->xq = malloc((size_t)R * kmax * XQ_SPREAD + 4);
        b->dx = malloc(sizeof(float) * (2 * R * kmax / GROUP + 1));
        if (!b->xq || !b->dx) { free_buf(b); return -1; }
    }
    if (!b->h || !b->qkv || !b->att || !b->a || !b->gu || !b->mid || !b->sx) { free_buf(b); return -1; }
    return 0;
}

/* The input of the next product, row r: group sums (and float32 on AVX2) of x [K], and its
   int8 form when the model's products take int8 activations. */
#define PREP(b, x, r, K)                                                                         \
    do {                                                                                         \
        prep_row((x) + (size_t)(r) * (K), (K), (b)->sx + (size_t)(r) * ((K) / GROUP),           \
                 (b)->xf ? (b)->xf + (size_t)(r) * (K) : 0);                                     \
        if ((b)->xq) quant_row((x) + (size_t)(r) * (K), (K),                                     \
                               (b)->xq + (size_t)(r) * (K) * XQ_SPREAD,                          \
                               (b)->dx + 2 * (size_t)(r) * ((K) / GROUP));                       \
    } while (0)

/* One decoder layer for R rows (called by every thread of the team). */
static int layer_rows(const cs_model *m, const cs_layer *ly, int R, uint16_t *x, fwd_buf *b,
                      const int32_t *write, uint16_t *kc, uint16_t *vc, int L,
                      const uint16_t *const *rope, const int32_t *rows, uint16_t *keep) {
    const int D = m->D, H = m->H, KV = m->KV, hd = m->hd, I = m->I, A = H * hd;
    int failed = 0;
    #pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {
        if (keep) memcpy(keep + (size_t)r * D, x + (size_t)r * D, sizeof(uint16_t) * D);
        rms_row(x + (size_t)r * D, D, ly->attn_in, m->eps, m->norm_offset, b->h + (size_t)r * D);
        PREP(b, b->h, r, D);
    }
    lin_rows(&ly->qkv, b->h, b->xf, b->sx, b->xq, b->dx, R, b->qkv);
    #pragma omp for schedule(static)
    for (int r = 0; r < R; r++) qkv_row(m, ly, b->qkv, r, write, R, kc, vc, L, rope);
    #pragma omp for schedule(static)
    for (int task = 0; task < R * KV; task++)
        if (attn_task(b->qkv, (size_t)(H + 2 * KV) * hd, kc, vc, L, rows, rows + R, rows + 2 * R,
                      task / KV, task % KV, H, KV, hd, m->scale, m->softcap, b->att)) {
            #pragma omp atomic write
            failed = 1;
        }
    #pragma omp for schedule(static)
    for (int r = 0; r < R; r++) PREP(b, b->att, r, A);
    lin_rows(&ly->o, b->att, b->xf, b->sx, b->xq, b->dx, R, b->a);
    #pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {
        uint16_t *xr = x + (size_t)r * D, *ar = b->a + (size_t)r * D;
        if (ly->attn_out) rms_row(ar, D, ly->attn_out, m->eps, m->norm_offset, ar);
        for (int j = 0; j < D; j++) xr[j] = f32_to_bf16(bf16_to_f32(xr[j]) + bf16_to_f32(ar[j]));
        rms_row(xr, D, ly->mlp_in, m->eps, m->norm_offset, b->h + (size_t)r * D);
        PREP(b, b->h, r, D);
    }
    lin_rows(&ly->gate_up, b->h, b->xf, b->sx, b->xq, b->dx, R, b->gu);
    #pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {
        const uint16_t *g = b->gu + (size_t)r * 2 * I;
        uint16_t *mr = b->mid + (size_t)r * I;
        for (int j = 0; j < I; j++)
            mr[j] = f32_to_bf16(bf(act_of(bf16_to_f32(g[j]), m->gelu)) * bf16_to_f32(g[I + j]));
        PREP(b, b->mid, r, I);
    }
    lin_rows(&ly->down, b->mid, b->xf, b->sx, b->xq, b->dx, R, b->a);
    #pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {
        uint16_t *xr = x + (size_t)r * D, *ar = b->a + (size_t)r * D;
        if (ly->mlp_out) rms_row(ar, D, ly->mlp_out, m->eps, m->norm_offset, ar);
        for (int j = 0; j < D; j++) xr[j] = f32_to_bf16(bf16_to_f32(xr[j]) + bf16_to_f32(ar[j]));
    }
    return failed;
}

static int lin_fits(const cs_lin *w, int n, int k) {
    return w->pack && w->n == n && w->k == k && n % TILE == 0 && k % GROUP == 0
        && ((w->bits == 4 && w->group == GROUP) || (w->bits == 8 && q8_takes(w->group, w->has_min, k)));
}

/* x: bf16 [R, D], the embeddings in, the last layer's output out. write: int32 [2, R], each
   row's cache slot and position. caches: per layer its k then v cache, bf16 [slots, L, KV, hd].
   rope: per RoPE of the model, cos then sin, bf16 [R, rot]. rows: per window of the model,
   int32 [3, R] (slot, first key, past-last key: cs_attention's). keep: per layer NULL or bf16
   [R, D], which receives the layer's input. Returns 0, -1 when out of memory, -2 for a shape
   it does not take. */
int cs_forward(const cs_model *m, const cs_layer *layers, int R, uint16_t *x, const int32_t *write,
               uint16_t *const *caches, int L, const uint16_t *const *rope,
               const int32_t *const *rows, uint16_t *const *keep) {
    const int H = m->H, KV = m->KV, hd = m->hd, D = m->D;
    if (hd % W || hd > MAX_HD || KV <= 0 || H % KV || H / KV > MAX_G || m->rot % 2 || m->rot > hd
        || m->rot <= 0)
        return -2;
    for (int i = 0; i < m->layers; i++) {
        const cs_layer *ly = layers + i;
        if (!lin_fits(&ly->qkv, (H + 2 * KV) * hd, D) || !lin_fits(&ly->o, D, H * hd)
            || !lin_fits(&ly->gate_up, 2 * m->I, D) || !lin_fits(&ly->down, D, m->I))
            return -2;
    }
    if (R <= 0) return 0;
    fwd_buf b;
    if (alloc_buf(m, R, &b)) return -1;
    int failed = 0;
    #pragma omp parallel
    {
        for (int i = 0; i < m->layers; i++) {
            const cs_layer *ly = layers + i;
            if (layer_rows(m, ly, R, x, &b, write, caches[2 * i], caches[2 * i + 1], L, rope,
                           rows[ly->window], keep[i])) {
                #pragma omp atomic write
                failed = 1;
            }
        }
    }
    free_buf(&b);
    return failed ? -1 : 0;
}
