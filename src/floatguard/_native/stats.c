/* One pass over float32 / bfloat16 bit patterns into floatguard's TensorStats fields.
 *
 * Same definitions as floatguard.stats._stats_f32 (the torch reference it is tested
 * against): with a = |bits|, the exponent field f = a >> 23 is 0 for zeros and
 * subnormals and 255 for inf/NaN; key 0 counts zeros, 127 + bin a finite non-zero
 * value whose floor(log2|x|) is EXP_MIN + bin (a subnormal's bin is floor(log2 a),
 * its mantissa read as an integer), 404 inf and NaN. Bits of non-negative floats
 * order like their values, so extremes are integer max/min over a.
 *
 * counts (int64[409]): [0, 405) key counts, 405 nan, 406 +inf, 407 -inf, 408 numel.
 * extremes (double[6]) over the finite values: amax (0 when none), smallest non-zero
 *   |x| (inf when none), min (inf when none), max (-inf when none); then what
 *   torch.aminmax would give (NaN if any NaN, else -inf / +inf if any, else min / max).
 *
 * fg_amax_many: the largest magnitude of each of many tensors in one call (what a
 * snapshot step vets), NaN for a tensor holding a NaN, 0 for an empty one. The max of
 * |bits| orders like |x|, and every NaN pattern is above inf's, so one integer max
 * per tensor decides both.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NKEYS 405


#define CHUNK 2048

/* One chunk of |bits| (a) and signs: extremes with selects (vectorised), then a
 * histogram of the exponent field in four sub-histograms (keys f + 149; f == 0
 * lands in 149, f == 255 in 404), then a rescan of the chunk, only when it held
 * zeros/subnormals or inf/NaN, to split those buckets exactly. */
typedef struct {
    int64_t nan, pinf;
    uint32_t pmax, pmin, nmax, nmin, mnz;
    uint32_t h[4][NKEYS];
    int64_t keys[NKEYS];
} acc_t;

static void chunk(const uint32_t *u, int64_t m, acc_t *s) {
    uint32_t pmax = s->pmax, pmin = s->pmin, nmax = s->nmax, nmin = s->nmin, mnz = s->mnz;
    for (int64_t i = 0; i < m; i++) {
        uint32_t a = u[i] & 0x7FFFFFFFu;
        uint32_t neg = u[i] >> 31;
        uint32_t fin = a < 0x7F800000u;
        uint32_t mp = 0u - (fin & (neg ^ 1u)); /* all ones: a finite positive value */
        uint32_t mn = 0u - (fin & neg);
        uint32_t mz = 0u - (fin & (a != 0u));
        uint32_t pa = a & mp, na = a & mn, pl = a | ~mp, nl = a | ~mn;
        uint32_t nz = (a & mz) | (0x7F800000u & ~mz);
        pmax = pa > pmax ? pa : pmax;
        nmax = na > nmax ? na : nmax;
        pmin = pl < pmin ? pl : pmin;
        nmin = nl < nmin ? nl : nmin;
        mnz = nz < mnz ? nz : mnz;
    }
    s->pmax = pmax, s->pmin = pmin, s->nmax = nmax, s->nmin = nmin, s->mnz = mnz;
    uint32_t before0 = s->h[0][149] + s->h[1][149] + s->h[2][149] + s->h[3][149];
    uint32_t before255 = s->h[0][404] + s->h[1][404] + s->h[2][404] + s->h[3][404];
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
        s->h[0][((u[i] & 0x7FFFFFFFu) >> 23) + 149]++;
        s->h[1][((u[i + 1] & 0x7FFFFFFFu) >> 23) + 149]++;
        s->h[2][((u[i + 2] & 0x7FFFFFFFu) >> 23) + 149]++;
        s->h[3][((u[i + 3] & 0x7FFFFFFFu) >> 23) + 149]++;
    }
    for (; i < m; i++) s->h[0][((u[i] & 0x7FFFFFFFu) >> 23) + 149]++;
    uint32_t after0 = s->h[0][149] + s->h[1][149] + s->h[2][149] + s->h[3][149];
    uint32_t after255 = s->h[0][404] + s->h[1][404] + s->h[2][404] + s->h[3][404];
    if (after0 != before0) {
        for (i = 0; i < m; i++) {
            uint32_t a = u[i] & 0x7FFFFFFFu;
            if ((a >> 23) == 0) s->keys[a ? 127u + (31u - (uint32_t)__builtin_clz(a)) : 0u]++;
        }
    }
    if (after255 != before255) {
        for (i = 0; i < m; i++) {
            uint32_t a = u[i] & 0x7FFFFFFFu;
            if (a > 0x7F800000u) s->nan++;
            else if (u[i] == 0x7F800000u) s->pinf++;
        }
    }
}

/* Fold the 32-bit sub-histograms into the 64-bit keys (bucket 149 was split by the
 * rescans). A sub-histogram sees at most a quarter of one thread's share, and it is
 * folded every 2^30 values, so the counters cannot wrap. */
static void fold(acc_t *s) {
    for (int k = 0; k < NKEYS; k++) {
        if (k != 149) s->keys[k] += (int64_t)s->h[0][k] + s->h[1][k] + s->h[2][k] + s->h[3][k];
    }
    memset(s->h, 0, sizeof(s->h));
}

static double as_float(uint32_t a) {
    float f;
    memcpy(&f, &a, sizeof f);
    return (double)f;
}

static void run(const void *data, int64_t n, int bf16, int nthreads, int64_t *out,
                double *ext) {
    memset(out, 0, 409 * sizeof(int64_t));
    uint32_t gpmax = 0, gpmin = 0xFFFFFFFFu, gnmax = 0, gnmin = 0xFFFFFFFFu;
    uint32_t gmnz = 0x7F800000u;
    int64_t gnan = 0, gpinf = 0;
    const uint32_t *p32 = (const uint32_t *)data;
    const uint16_t *p16 = (const uint16_t *)data;
    int64_t nchunks = (n + CHUNK - 1) / CHUNK;
    if (n < (1 << 16) || nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
    {
        acc_t *s = (acc_t *)calloc(1, sizeof(acc_t));
        uint32_t buf[CHUNK];
        s->pmin = s->nmin = 0xFFFFFFFFu;
        s->mnz = 0x7F800000u;
#pragma omp for schedule(static)
        for (int64_t c = 0; c < nchunks; c++) {
            int64_t lo = c * CHUNK, m = n - lo < CHUNK ? n - lo : CHUNK;
            const uint32_t *u = p32 + lo;
            if (bf16) {
                for (int64_t i = 0; i < m; i++) buf[i] = ((uint32_t)p16[lo + i]) << 16;
                u = buf;
            }
            chunk(u, m, s);
            if ((c & ((1 << 19) - 1)) == (1 << 19) - 1) fold(s); /* every 2^30 values */
        }
        fold(s);
#pragma omp critical
        {
            for (int k = 0; k < NKEYS; k++) out[k] += s->keys[k];
            gnan += s->nan;
            gpinf += s->pinf;
            if (s->pmax > gpmax) gpmax = s->pmax;
            if (s->pmin < gpmin) gpmin = s->pmin;
            if (s->nmax > gnmax) gnmax = s->nmax;
            if (s->nmin < gnmin) gnmin = s->nmin;
            if (s->mnz < gmnz) gmnz = s->mnz;
        }
        free(s);
    }
    out[405] = gnan;
    out[406] = gpinf;
    out[407] = out[404] - gnan - gpinf;
    out[408] = n;
    int npos = gpmin != 0xFFFFFFFFu;
    int nneg = gnmin != 0xFFFFFFFFu;
    ext[0] = as_float(gpmax > gnmax ? gpmax : gnmax);
    ext[1] = as_float(gmnz);
    ext[2] = nneg ? -as_float(gnmax) : (npos ? as_float(gpmin) : INFINITY);
    ext[3] = npos ? as_float(gpmax) : (nneg ? -as_float(gnmin) : -INFINITY);
    ext[4] = gnan ? NAN : (out[407] ? -INFINITY : ext[2]);
    ext[5] = gnan ? NAN : (gpinf ? INFINITY : ext[3]);
}

int fg_abi_version(void) { return 3; }

void fg_stats_f32(const void *data, int64_t n, int nthreads, int64_t *out, double *ext) {
    run(data, n, 0, nthreads, out, ext);
}

void fg_stats_bf16(const void *data, int64_t n, int nthreads, int64_t *out, double *ext) {
    run(data, n, 1, nthreads, out, ext);
}

/* kinds: 0 float32, 1 bfloat16, 2 float16 (contiguous memory of n elements each). */
void fg_amax_many(const void *const *data, const int64_t *n, const int *kind, int64_t count,
                  double *out) {
    for (int64_t t = 0; t < count; t++) {
        int64_t m = n[t];
        if (kind[t] == 0) {
            const uint32_t *u = (const uint32_t *)data[t];
            uint32_t mx = 0;
            for (int64_t i = 0; i < m; i++) {
                uint32_t a = u[i] & 0x7fffffffu;
                mx = a > mx ? a : mx;
            }
            out[t] = mx > 0x7f800000u ? NAN : as_float(mx);
        } else {
            const uint16_t *h = (const uint16_t *)data[t];
            uint16_t mx = 0;
            for (int64_t i = 0; i < m; i++) {
                uint16_t a = h[i] & 0x7fffu;
                mx = a > mx ? a : mx;
            }
            if (kind[t] == 1) {
                out[t] = mx > 0x7f80u ? NAN : as_float((uint32_t)mx << 16);
            } else {
                uint32_t e = mx >> 10, f = mx & 0x3ffu;
                out[t] = e == 31 ? (f ? NAN : INFINITY) : ldexp(e ? (double)(f | 0x400u) : (double)f, (e ? (int)e : 1) - 25);
            }
        }
    }
}
