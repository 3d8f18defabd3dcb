/* Products of float32 activation rows with MLX's affine-quantized weights, on the host.

   MLX's CPU build multiplies quantized weights through scalar loops (a 576 x 1536 4-bit
   product of one row: 0.8 ms), so the core ran such layers from float32 copies through
   numpy's BLAS, reading 8x the bytes a 4-bit weight holds. These read the quantized words
   as they lie in MLX's arrays.

   Layout (MLX's "affine" mode): weight [out, in * bits / 32] uint32, element j of a word in
   bits [j * bits, (j + 1) * bits); scales and biases [out, in / group] float32 (the caller
   converts other dtypes once); value = scale * q + bias.

   Every row of x is computed by the same operations in the same order whatever the number
   of rows in the call, so a verify block's rows equal one-row decode steps bit for bit. */

#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86 1
#include <immintrin.h>
#endif

/* rows that share one unpacking of a weight chunk */
#define ROW_BLOCK 4

/* one product, or the share of its outputs [o_begin, o_end) one thread computes */
typedef struct {
    const float *x;
    long rows, in_dims;
    const uint32_t *weight;
    const float *scales, *biases;
    long out_dims, group;
    int bits;
    long o_begin, o_end;
    float *y;
} product_args;


int mlxr_abi_version(void) { return 2; }

/* x [rows, in] reordered per 32-element chunk so that a 4-bit chunk's unpacked nibbles meet
   their activations: the low nibbles of bytes 0..7 are elements 0, 2, ..., 14, of bytes
   8..15 elements 16, ..., 30; the high nibbles the odd ones. */
static void reorder_4bit(const float *x, float *xp, long in_dims) {
    for (long c = 0; c < in_dims; c += 32) {
        const float *s = x + c;
        float *d = xp + c;
        for (int k = 0; k < 8; k++) {
            d[k] = s[2 * k];
            d[8 + k] = s[16 + 2 * k];
            d[16 + k] = s[2 * k + 1];
            d[24 + k] = s[17 + 2 * k];
        }
    }
}

static void group_sums(const float *x, float *sums, long in_dims, long group) {
    for (long g = 0; g < in_dims / group; g++) {
        float s = 0.0f;
        for (long i = 0; i < group; i++) s += x[g * group + i];
        sums[g] = s;
    }
}

/* ---- portable loops ---------------------------------------------------------------- */

static void rows_portable(const float *xs, const float *sums, long rows, long in_dims,
                          const uint32_t *w, const float *scales, const float *biases,
                          long o_begin, long o_end, long group, int bits, float *y,
                          long out_dims) {
    long groups = in_dims / group;
    long words = in_dims * bits / 32;
    uint32_t mask = (1u << bits) - 1u;
    int per_word = 32 / bits;
    for (long o = o_begin; o < o_end; o++) {
        const uint32_t *wo = w + o * words;
        for (long r = 0; r < rows; r++) {
            const float *x = xs + r * in_dims;
            float acc = 0.0f, bias = 0.0f;
            for (long g = 0; g < groups; g++) {
                float t = 0.0f;
                for (long i = 0; i < group; i++) {
                    long e = g * group + i;
                    uint32_t q = (wo[e / per_word] >> ((e % per_word) * bits)) & mask;
                    t += (float)q * x[e];
                }
                acc += t * scales[o * groups + g];
                bias += biases[o * groups + g] * sums[r * groups + g];
            }
            y[r * out_dims + o] = acc + bias;
        }
    }
}

/* ---- AVX2 + FMA ------------------------------------------------------------------------ */

#ifdef HAVE_X86
__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) static inline __m256 widen(__m128i bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

/* a 32-weight chunk at element e of an output row as four vectors of eight, in the order of
   their activations (4-bit: xs reordered by reorder_4bit; 8-bit: as they are) */
__attribute__((target("avx2,fma"), always_inline))
static inline void unpack_avx2(const uint8_t *wo, long e, const int bits, __m256 q[4]) {
    if (bits == 4) {
        const __m128i low = _mm_set1_epi8(0x0f);
        __m128i b = _mm_loadu_si128((const __m128i *)(wo + e / 2));
        __m128i lo = _mm_and_si128(b, low);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        q[0] = widen(lo), q[1] = widen(_mm_srli_si128(lo, 8));
        q[2] = widen(hi), q[3] = widen(_mm_srli_si128(hi, 8));
    } else {
        __m128i b0 = _mm_loadu_si128((const __m128i *)(wo + e));
        __m128i b1 = _mm_loadu_si128((const __m128i *)(wo + e + 16));
        q[0] = widen(b0), q[1] = widen(_mm_srli_si128(b0, 8));
        q[2] = widen(b1), q[3] = widen(_mm_srli_si128(b1, 8));
    }
}

__attribute__((target("avx2,fma"), always_inline))
static inline void block_avx2(const float *xs, const float *sums, long r0, const int nr,
                              long in_dims, const uint32_t *w, const float *scales,
                              const float *biases, long o_begin, long o_end, long group,
                              const int bits, float *y, long out_dims) {
    long groups = in_dims / group, chunks = group / 32, bytes_per_row = in_dims * bits / 8;
    for (long o = o_begin; o < o_end; o++) {
        const uint8_t *wo = (const uint8_t *)w + o * bytes_per_row;
        __m256 acc[ROW_BLOCK];
        for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
        for (long g = 0; g < groups; g++) {
            __m256 t[ROW_BLOCK];
            for (int r = 0; r < nr; r++) t[r] = _mm256_setzero_ps();
            for (long c = 0; c < chunks; c++) {
                long e = (g * chunks + c) * 32;
                __m256 q[4];
                unpack_avx2(wo, e, bits, q);
                for (int r = 0; r < nr; r++) {
                    const float *x = xs + (r0 + r) * in_dims + e;
                    __m256 u = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
                    u = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), u);
                    u = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), u);
                    u = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), u);
                    t[r] = _mm256_add_ps(t[r], u);
                }
            }
            __m256 s = _mm256_set1_ps(scales[o * groups + g]);
            for (int r = 0; r < nr; r++) acc[r] = _mm256_fmadd_ps(t[r], s, acc[r]);
        }
        for (int r = 0; r < nr; r++) {
            const float *sm = sums + (r0 + r) * groups;
            const float *bo = biases + o * groups;
            float bias = 0.0f;
            for (long g = 0; g < groups; g++) bias += bo[g] * sm[g];
            y[(r0 + r) * out_dims + o] = hsum8(acc[r]) + bias;
        }
    }
}

/* one function per row count, so that the per-row accumulators live in registers */
#define ROW_BLOCKS(name, bits)                                                               \
    __attribute__((target("avx2,fma")))                                                     \
    static void rows_avx2_##name(const float *xs, const float *sums, long rows, long in_dims, \
                                 const uint32_t *w, const float *scales, const float *biases, \
                                 long o_begin, long o_end, long group, float *y,              \
                                 long out_dims) {                                             \
        for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {                                       \
            long left = rows - r0;                                                            \
            if (left >= 4)                                                                    \
                block_avx2(xs, sums, r0, 4, in_dims, w, scales, biases, o_begin, o_end,       \
                           group, bits, y, out_dims);                                         \
            else if (left == 3)                                                               \
                block_avx2(xs, sums, r0, 3, in_dims, w, scales, biases, o_begin, o_end,       \
                           group, bits, y, out_dims);                                         \
            else if (left == 2)                                                               \
                block_avx2(xs, sums, r0, 2, in_dims, w, scales, biases, o_begin, o_end,       \
                           group, bits, y, out_dims);                                         \
            else                                                                              \
                block_avx2(xs, sums, r0, 1, in_dims, w, scales, biases, o_begin, o_end,       \
                           group, bits, y, out_dims);                                         \
        }                                                                                     \
    }
ROW_BLOCKS(4bit, 4)
ROW_BLOCKS(8bit, 8)

/* ---- AVX-512 ----------------------------------------------------------------------------
   Sixteen lanes hold a 4-bit chunk's even elements (low nibbles) or odd ones (high); each
   group's sixteen values scale * q + bias are a table the nibbles index (one permute per
   sixteen weights, no conversion), so no bias term is summed apart. 8-bit words are
   widened and dequantized with one multiply-add. */

__attribute__((target("avx512f"), always_inline))
static inline void block_avx512_4bit(const float *xs, long r0, const int nr, long in_dims,
                                     const uint32_t *w, const float *scales,
                                     const float *biases, long o_begin, long o_end,
                                     long group, float *y, long out_dims) {
    long groups = in_dims / group, chunks = group / 32, bytes_per_row = in_dims / 2;
    const __m512i low = _mm512_set1_epi32(0x0f);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (long o = o_begin; o < o_end; o++) {
        const uint8_t *wo = (const uint8_t *)w + o * bytes_per_row;
        __m512 acc[ROW_BLOCK];
        for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
        for (long g = 0; g < groups; g++) {
            __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(scales[o * groups + g]),
                                           _mm512_set1_ps(biases[o * groups + g]));
            for (long c = 0; c < chunks; c++) {
                long e = (g * chunks + c) * 32;
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wo + e / 2)));
                __m512 we = _mm512_permutexvar_ps(_mm512_and_si512(v, low), table);
                __m512 wd = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
                for (int r = 0; r < nr; r++) {
                    const float *x = xs + (r0 + r) * in_dims + e;
                    acc[r] = _mm512_fmadd_ps(we, _mm512_loadu_ps(x), acc[r]);
                    acc[r] = _mm512_fmadd_ps(wd, _mm512_loadu_ps(x + 16), acc[r]);
                }
            }
        }
        for (int r = 0; r < nr; r++) y[(r0 + r) * out_dims + o] = _mm512_reduce_add_ps(acc[r]);
    }
}

__attribute__((target("avx512f"), always_inline))
static inline void block_avx512_8bit(const float *xs, long r0, const int nr, long in_dims,
                                     const uint32_t *w, const float *scales,
                                     const float *biases, long o_begin, long o_end,
                                     long group, float *y, long out_dims) {
    long groups = in_dims / group, chunks = group / 32;
    for (long o = o_begin; o < o_end; o++) {
        const uint8_t *wo = (const uint8_t *)w + o * in_dims;
        __m512 acc[ROW_BLOCK];
        for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
        for (long g = 0; g < groups; g++) {
            __m512 s = _mm512_set1_ps(scales[o * groups + g]);
            __m512 b = _mm512_set1_ps(biases[o * groups + g]);
            for (long c = 0; c < chunks; c++) {
                long e = (g * chunks + c) * 32;
                __m512 q0 = _mm512_cvtepi32_ps(
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wo + e))));
                __m512 q1 = _mm512_cvtepi32_ps(
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wo + e + 16))));
                __m512 w0 = _mm512_fmadd_ps(q0, s, b), w1 = _mm512_fmadd_ps(q1, s, b);
                for (int r = 0; r < nr; r++) {
                    const float *x = xs + (r0 + r) * in_dims + e;
                    acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), acc[r]);
                    acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), acc[r]);
                }
            }
        }
        for (int r = 0; r < nr; r++) y[(r0 + r) * out_dims + o] = _mm512_reduce_add_ps(acc[r]);
    }
}

#define ROW_BLOCKS_512(bits)                                                                  \
    __attribute__((target("avx512f")))                                                       \
    static void rows_avx512_##bits(const float *xs, long rows, long in_dims,                  \
                                   const uint32_t *w, const float *scales,                    \
                                   const float *biases, long o_begin, long o_end, long group, \
                                   float *y, long out_dims) {                                 \
        for (long r0 = 0; r0 < rows; r0 += ROW_BLOCK) {                                       \
            long left = rows - r0;                                                            \
            if (left >= 4)                                                                    \
                block_avx512_##bits(xs, r0, 4, in_dims, w, scales, biases, o_begin, o_end,    \
                                    group, y, out_dims);                                      \
            else if (left == 3)                                                               \
                block_avx512_##bits(xs, r0, 3, in_dims, w, scales, biases, o_begin, o_end,    \
                                    group, y, out_dims);                                      \
            else if (left == 2)                                                               \
                block_avx512_##bits(xs, r0, 2, in_dims, w, scales, biases, o_begin, o_end,    \
                                    group, y, out_dims);                                      \
            else                                                                              \
                block_avx512_##bits(xs, r0, 1, in_dims, w, scales, biases, o_begin, o_end,    \
                                    group, y, out_dims);                                      \
        }                                                                                     \
    }
ROW_BLOCKS_512(4bit)
ROW_BLOCKS_512(8bit)
#endif

static int use_avx512(void) {
#ifdef HAVE_X86
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f");
    }
    return known;
#else
    return 0;
#endif
}

static int use_avx2(void) {
#ifdef HAVE_X86
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return known;
#else
    return 0;
#endif
}

/* Which loops serve: 3 AVX-512, 2 AVX2 + FMA, 1 portable. */
int mlxr_path(void) { return use_avx512() ? 3 : use_avx2() ? 2 : 1; }

/* the outputs [o_begin, o_end) of one product */
static int product_range(const product_args *a) {
    long rows = a->rows, in_dims = a->in_dims, group = a->group;
    long groups = in_dims / group;
    float *sums = malloc(sizeof(float) * (size_t)(rows * groups));
    float *xp = a->bits == 4 ? malloc(sizeof(float) * (size_t)(rows * in_dims)) : NULL;
    if (!sums || (a->bits == 4 && !xp)) {
        free(sums);
        free(xp);
        return -2;
    }
#ifdef HAVE_X86
    if (use_avx512()) {
        if (a->bits == 4) {
            for (long r = 0; r < rows; r++)
                reorder_4bit(a->x + r * in_dims, xp + r * in_dims, in_dims);
            rows_avx512_4bit(xp, rows, in_dims, a->weight, a->scales, a->biases, a->o_begin,
                             a->o_end, group, a->y, a->out_dims);
        } else {
            rows_avx512_8bit(a->x, rows, in_dims, a->weight, a->scales, a->biases,
                             a->o_begin, a->o_end, group, a->y, a->out_dims);
        }
        free(sums);
        free(xp);
        return 0;
    }
#endif
    for (long r = 0; r < rows; r++)
        group_sums(a->x + r * in_dims, sums + r * groups, in_dims, group);
#ifdef HAVE_X86
    if (use_avx2()) {
        if (a->bits == 4) {
            for (long r = 0; r < rows; r++)
                reorder_4bit(a->x + r * in_dims, xp + r * in_dims, in_dims);
            rows_avx2_4bit(xp, sums, rows, in_dims, a->weight, a->scales, a->biases, a->o_begin,
                           a->o_end, group, a->y, a->out_dims);
        } else {
            rows_avx2_8bit(a->x, sums, rows, in_dims, a->weight, a->scales, a->biases,
                           a->o_begin, a->o_end, group, a->y, a->out_dims);
        }
        free(sums);
        free(xp);
        return 0;
    }
#endif
    rows_portable(a->x, sums, rows, in_dims, a->weight, a->scales, a->biases, a->o_begin,
                  a->o_end, group, a->bits, a->y, a->out_dims);
    free(sums);
    free(xp);
    return 0;
}

/* ---- a helper thread ----------------------------------------------------------------
   A product's output rows are split between the calling thread and one helper, which
   waits for work spinning for up to HELPER_SPIN_NS (a decode step's products come tens of
   microseconds apart; waking a sleeping thread costs about as much on these machines),
   then sleeping on a condition variable. */

static pthread_mutex_t helper_lock = PTHREAD_MUTEX_INITIALIZER;
/* held by the thread whose product the helper shares (others compute alone meanwhile) */
static pthread_mutex_t helper_owner = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t helper_wake = PTHREAD_COND_INITIALIZER;
static pthread_t helper_thread;
static int helper_started = 0;
static long helper_spin_ns = 0;
static product_args helper_job;
static atomic_long job_posted = 0, job_done = 0;
static atomic_int helper_sleeping = 0, helper_result = 0;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void relax(void) {
#ifdef HAVE_X86
    _mm_pause();
#endif
}

static void *helper_main(void *unused) {
    (void)unused;
    long seen = 0;
    for (;;) {
        long start = now_ns();
        while (atomic_load_explicit(&job_posted, memory_order_acquire) == seen) {
            relax();
            if (now_ns() - start > helper_spin_ns) {
                pthread_mutex_lock(&helper_lock);
                atomic_store(&helper_sleeping, 1);
                while (atomic_load(&job_posted) == seen)
                    pthread_cond_wait(&helper_wake, &helper_lock);
                atomic_store(&helper_sleeping, 0);
                pthread_mutex_unlock(&helper_lock);
            }
        }
        seen = atomic_load_explicit(&job_posted, memory_order_acquire);
        atomic_store(&helper_result, product_range(&helper_job));
        atomic_store_explicit(&job_done, seen, memory_order_release);
    }
    return NULL;
}

/* a forked child has no helper: it computes alone until started again */
static void helper_forgotten(void) {
    helper_started = 0;
    pthread_mutex_init(&helper_lock, NULL);
    pthread_mutex_init(&helper_owner, NULL);
    pthread_cond_init(&helper_wake, NULL);
    atomic_store(&job_posted, 0);
    atomic_store(&job_done, 0);
    atomic_store(&helper_sleeping, 0);
}

/* Start the helper (once; later calls change its spin). Returns 0, or -1 where no thread
   could be started (products then run on the calling thread alone). */
int mlxr_start_helper(long spin_ns) {
    static int fork_handled = 0;
    helper_spin_ns = spin_ns;
    if (helper_started) return 0;
    if (!fork_handled) {
        if (pthread_atfork(NULL, NULL, helper_forgotten)) return -1;
        fork_handled = 1;
    }
    if (pthread_create(&helper_thread, NULL, helper_main, NULL)) return -1;
    pthread_detach(helper_thread);
    helper_started = 1;
    return 0;
}

/* y [rows, out] = x [rows, in] @ dequantize(weight)^T. bits 4 or 8; group a multiple of 32
   dividing in. Outputs are split with the helper thread where it runs and the product
   holds at least min_split weights. Returns 0, or -1 for a case it does not take, -2 out
   of memory. */
int mlxr_quantized_product(const float *x, long rows, long in_dims, const uint32_t *weight,
                           const float *scales, const float *biases, long out_dims,
                           long group, int bits, long min_split, float *y) {
    if ((bits != 4 && bits != 8) || group <= 0 || group % 32 || in_dims % group || rows <= 0
        || out_dims <= 0)
        return -1;
    product_args whole = {x, rows, in_dims, weight, scales, biases, out_dims, group, bits,
                          0, out_dims, y};
    if (!helper_started || out_dims < 16 || out_dims * in_dims < min_split
        || pthread_mutex_trylock(&helper_owner))
        return product_range(&whole);
    /* the helper takes the upper half, in whole blocks of 8 outputs */
    long cut = (out_dims / 2) & ~7L;
    helper_job = whole;
    helper_job.o_begin = cut;
    long seq = atomic_load(&job_posted) + 1;
    /* sequentially consistent, as the helper's side: the post must not pass the read of
       helper_sleeping, or a helper going to sleep misses it */
    atomic_store(&job_posted, seq);
    if (atomic_load(&helper_sleeping)) {
        pthread_mutex_lock(&helper_lock);
        pthread_cond_signal(&helper_wake);
        pthread_mutex_unlock(&helper_lock);
    }
    whole.o_end = cut;
    int mine = product_range(&whole);
    while (atomic_load_explicit(&job_done, memory_order_acquire) != seq) relax();
    int theirs = atomic_load(&helper_result);
    pthread_mutex_unlock(&helper_owner);
    return mine ? mine : theirs;
}

/* out [o_end - o_begin, in] = dequantize(weight) rows [o_begin, o_end), float32 (for products
   of many rows, which the BLAS then takes). Returns 0 or -1 as above. */
int mlxr_dequantize(const uint32_t *weight, const float *scales, const float *biases,
                    long out_dims, long in_dims, long group, int bits, long o_begin,
                    long o_end, float *out) {
    if ((bits != 4 && bits != 8) || group <= 0 || in_dims % group || o_begin < 0
        || o_end > out_dims || o_begin > o_end)
        return -1;
    long groups = in_dims / group;
    const uint8_t *bytes = (const uint8_t *)weight;
    long row_bytes = in_dims * bits / 8;
    for (long o = o_begin; o < o_end; o++) {
        const uint8_t *wo = bytes + o * row_bytes;
        float *d = out + (o - o_begin) * in_dims;
        for (long g = 0; g < groups; g++) {
            float s = scales[o * groups + g], b = biases[o * groups + g];
            for (long i = g * group; i < (g + 1) * group; i++) {
                unsigned q = bits == 8 ? wo[i] : (wo[i / 2] >> ((i & 1) * 4)) & 15u;
                d[i] = s * (float)q + b;
            }
        }
    }
    return 0;
}

/* ---- the layers between products (mlxrunner.nn.host_ops) ---------------------------------
   Each as MLX's function computes it in float32; rows are the leading dimensions. */

/* y = x * (1 / sqrt(mean(x * x) + eps)) (* weight, where given), row by row */
void mlxr_rms_norm(const float *x, const float *weight, long rows, long dims, float eps,
                   float *y) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dims;
        float *yr = y + r * dims;
        float sum = 0.0f;
        for (long i = 0; i < dims; i++) sum += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(sum / (float)dims + eps);
        if (weight)
            for (long i = 0; i < dims; i++) yr[i] = xr[i] * inv * weight[i];
        else
            for (long i = 0; i < dims; i++) yr[i] = xr[i] * inv;
    }
}

/* RoPE of x [outer, L, D] (outer: batch rows times heads, heads_per_row of them to a batch
   row) over its first dims: the angle of position p and pair i is positions[b, l] * inv[i]
   (positions [B or 1, L], already offset and scaled); rotate-half pairs (i, i + dims / 2),
   or neighbouring ones where traditional. The dims past `dims` are copied. */
void mlxr_rope(const float *x, long outer, long heads_per_row, long L, long D, long dims,
               int traditional, const float *positions, long position_rows, const float *inv,
               float *y) {
    long half = dims / 2;
    for (long o = 0; o < outer; o++) {
        long b = position_rows > 1 ? o / heads_per_row : 0;
        for (long l = 0; l < L; l++) {
            const float *xr = x + (o * L + l) * D;
            float *yr = y + (o * L + l) * D;
            float p = positions[b * L + l];
            for (long i = 0; i < half; i++) {
                float theta = p * inv[i];
                float c = cosf(theta), s = sinf(theta);
                long i1 = traditional ? 2 * i : i, i2 = traditional ? 2 * i + 1 : i + half;
                float x1 = xr[i1], x2 = xr[i2];
                yr[i1] = x1 * c - x2 * s;
                yr[i2] = x1 * s + x2 * c;
            }
            for (long i = dims; i < D; i++) yr[i] = xr[i];
        }
    }
}

/* y = gate / (1 + exp(-gate)) * up */
void mlxr_silu_mul(const float *gate, const float *up, long n, float *y) {
    for (long i = 0; i < n; i++) y[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}
