// Paged causal attention on CPU that reads the KV cache in place (see paged_kernel.py for the why).
//
// Layout: q [num_tokens, num_heads, D] fp32; k_cache / v_cache [num_blocks, block_size, num_kv_heads, D]
// in fp32, bf16 or fp16; block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32;
// query_start_loc [num_seqs + 1] int32; out [num_tokens, num_heads, D] fp32.
//
// Determinism: every query row is computed by the same straight-line code whatever else is in the call.
// Its scores are q.k dot products with a fixed 16-lane split of the head dimension, its softmax normaliser
// a sum over its visible keys split over 16 lanes by position from its first key, its output a sum over
// those keys in position order, and the work split (sequence, tile of TILE queries, one kv head or all of them)
// only decides which thread computes a row, never how.
//
// Denormals: every thread computes with flush-to-zero and denormals-are-zero set (and restores its own
// modes after): softmax numerators of keys scoring ~87 below the row's best, and their products with the
// values, are denormal, and x86 takes a microcode assist of ~100 cycles on each; in a trained model's
// peaked middle layers that made decode attention 2-4x slower than on random data. Flushed they add
// nothing a normal float sum would keep; a row still gets the same bits in every batch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {

// The calling thread's float modes with flush-to-zero and denormals-are-zero on, for its lifetime.
class FlushDenormals {
public:
#if defined(__SSE__)
    FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
    ~FlushDenormals() { _mm_setcsr(saved_); }
private:
    unsigned int saved_;
#endif
};

constexpr int TILE = 16;     // query rows of one sequence per work item
constexpr int IN_PLACE_ROWS = 4;  // up to this many rows per item read bf16 K/V in place, more convert once
constexpr int LANES = 16;    // partial sums of a dot product (two AVX2 registers; dot() reduces exactly 16)

inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float f16_to_f32(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);            // inf / nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);   // normal: rebias 15 -> 127
    } else if (man == 0) {
        bits = sign;                                        // +-0
    } else {                                                // subnormal: normalise
        int e = -1;
        do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
        bits = sign | ((112u - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// One cached row (D values) as fp32: a pointer into the cache for fp32, else converted into buf. The
// dtype is a template parameter so each conversion loop is a branch-free, vectorised loop of its own.
template <int DT>
inline const float* load_row(const void* cache, int64_t index, int D, float* buf) {
    if constexpr (DT == 0) {
        return static_cast<const float*>(cache) + index;
    } else {
        const uint16_t* src = static_cast<const uint16_t*>(cache) + index;
        for (int d = 0; d < D; ++d) buf[d] = DT == 1 ? bf16_to_f32(src[d]) : f16_to_f32(src[d]);
        return buf;
    }
}

// Ask for a cached row ahead of its use (the blocks of a sequence are scattered: the hardware prefetcher
// loses the stream at every block boundary).
template <int DT>
inline void prefetch_row(const void* cache, int64_t index, int D) {
    const char* p = static_cast<const char*>(cache) + index * (DT == 0 ? 4 : 2);
    for (int64_t b = 0; b < static_cast<int64_t>(D) * (DT == 0 ? 4 : 2); b += 64) __builtin_prefetch(p + b);
}

inline float dot(const float* a, const float* b, int D) {
    float acc[LANES] = {0.f};
    int d = 0;
    for (; d + LANES <= D; d += LANES) {
        for (int l = 0; l < LANES; ++l) acc[l] += a[d + l] * b[d + l];
    }
    for (int l = 0; d < D && l < LANES; ++d, ++l) acc[l] += a[d] * b[d];   // the last D % LANES
    // fixed pairwise tree, one level at a time with constant bounds so the compiler unrolls it (a loop over
    // the level width kept the lanes in memory: a fifth of the kernel's time)
    for (int l = 0; l < 8; ++l) acc[l] += acc[l + 8];
    for (int l = 0; l < 4; ++l) acc[l] += acc[l + 4];
    for (int l = 0; l < 2; ++l) acc[l] += acc[l + 2];
    return acc[0] + acc[1];
}


// exp(x) for x <= 0 (scores minus their row max), vectorisable: Cody-Waite range reduction by ln 2
// and a degree-6 polynomial (~1 ulp), scaled by 2^k through the exponent bits. Not inlined: inlined into
// run_item, g++ 12 left it scalar ("control flow in loop"); on its own it vectorises.
__attribute__((noinline)) void exp_nonpositive(float* x, int n) {
    for (int i = 0; i < n; ++i) {
        float v = x[i] < -87.0f ? -87.0f : x[i];                  // a select, not std::max's branch: vectorises
        float k = (v * 1.44269504f + 12582912.0f) - 12582912.0f;   // round to nearest integer
        float r = v - k * 0.693359375f;
        r = r + k * 2.12194440e-4f;
        float p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = p * (r * r) + r + 1.0f;
        int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
        x[i] = p * __builtin_bit_cast(float, bits);              // memcpy here kept the loop scalar
    }
}

// Max and sum of a row's n values with LANES partial results by position (value i -> lane i % LANES) and
// the same pairwise tree as dot(): vectorised, and a function of the row's values alone (not of the call).
inline float lane_max(const float* x, int n) {
    float acc[LANES];
    for (int l = 0; l < LANES; ++l) acc[l] = x[0];
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int l = 0; l < LANES; ++l) acc[l] = acc[l] > x[i + l] ? acc[l] : x[i + l];
    }
    for (int l = 0; i < n; ++i, ++l) acc[l] = acc[l] > x[i] ? acc[l] : x[i];
    for (int l = 0; l < 8; ++l) acc[l] = acc[l] > acc[l + 8] ? acc[l] : acc[l + 8];
    for (int l = 0; l < 4; ++l) acc[l] = acc[l] > acc[l + 4] ? acc[l] : acc[l + 4];
    for (int l = 0; l < 2; ++l) acc[l] = acc[l] > acc[l + 2] ? acc[l] : acc[l + 2];
    return acc[0] > acc[1] ? acc[0] : acc[1];
}

inline float lane_sum(const float* x, int n) {
    float acc[LANES] = {0.f};
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int l = 0; l < LANES; ++l) acc[l] += x[i + l];
    }
    for (int l = 0; i < n; ++i, ++l) acc[l] += x[i];
    for (int l = 0; l < 8; ++l) acc[l] += acc[l + 8];
    for (int l = 0; l < 4; ++l) acc[l] += acc[l + 4];
    for (int l = 0; l < 2; ++l) acc[l] += acc[l + 2];
    return acc[0] + acc[1];
}

struct Args {
    const float* q; const void* k_cache; const void* v_cache; int dtype;
    const int32_t* block_tables; int64_t max_blocks; const int32_t* seq_lens; const int32_t* qsl;
    int64_t num_heads, num_kv_heads, D, block_size, window; float scale; float* out;
};

struct Scratch {
    std::vector<float> scores, acc, krow, vbuf, inv_sum;
    std::vector<const float*> qrows;
    std::vector<int64_t> pos, lo, slots;
};

// One work item's rows as run_item lays them out: key n's cache offset slots[n], row r's query, position and
// first visible key.
struct Rows {
    int64_t rows, span, lo_min, hi_max;
    const int64_t* slots; const float* const* qrows; const int64_t* pos; const int64_t* lo;
};

#include "paged_kernel_avx512.h"   // scores16, values4: the AVX-512 loops for head dims 64 and 128


// Rows j0..j1 of sequence `seq`, query heads of kv head `kvh`; DT: 0 fp32, 1 bf16, 2 fp16 storage; HD: the
// head dimension when known at compile time (64, 128: loops of a fixed trip count, registers instead of
// memory for a row's partial sums), 0 for any other. The arithmetic is the same either way.
// Each row's query pointer, position and first visible key, and each key's offset in the cache, are worked out
// once per item: computed in the key loops (integer divisions per key and row, and per key twice) they took
// most of a decode step's attention time.
template <int DT, int HD>
void run_item(const Args& a, int64_t seq, int64_t kvh, int64_t j0, int64_t j1, Scratch& s) {
    const int64_t D = HD > 0 ? HD : a.D, rep = a.num_heads / a.num_kv_heads;
    const int64_t seq_len = a.seq_lens[seq], q_start = a.qsl[seq];
    const int64_t ctx0 = seq_len - (a.qsl[seq + 1] - q_start);   // position of query 0
    const int64_t lo_min = a.window > 0 ? std::max<int64_t>(0, ctx0 + j0 - a.window + 1) : 0;
    const int64_t hi_max = ctx0 + j1 - 1;
    const int64_t span = hi_max - lo_min + 1, rows = (j1 - j0) * rep;
    s.scores.resize(rows * span);
    s.acc.assign(rows * D, 0.f);
    s.krow.resize(D);
    s.inv_sum.resize(rows);
    s.qrows.resize(rows);
    s.pos.resize(rows);
    s.lo.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {     // row r = (query j0 + r / rep, head kvh * rep + r % rep)
        s.qrows[r] = a.q + ((q_start + j0 + r / rep) * a.num_heads + kvh * rep + r % rep) * D;
        s.pos[r] = ctx0 + j0 + r / rep;
        s.lo[r] = a.window > 0 ? std::max<int64_t>(0, s.pos[r] - a.window + 1) : 0;
    }
    s.slots.resize(span);
    for (int64_t n = lo_min; n <= hi_max;) {                   // block by block: no division per key
        const int64_t block = a.block_tables[seq * a.max_blocks + n / a.block_size];
        for (int64_t off = n % a.block_size; off < a.block_size && n <= hi_max; ++off, ++n) {
            s.slots[n - lo_min] = ((block * a.block_size + off) * a.num_kv_heads + kvh) * D;
        }
    }
    const int64_t* slots = s.slots.data() - lo_min;            // slots[n]: key n's offset
    const float* const* qrows = s.qrows.data();
    const int64_t* pos = s.pos.data();
    const int64_t* row_lo = s.lo.data();
#if defined(__AVX512F__)
    const Rows w{rows, span, lo_min, hi_max, slots, qrows, pos, row_lo};
    const bool in_place = DT == 0 || (DT == 1 && rows <= IN_PLACE_ROWS);   // fp16 always converted
    if constexpr (HD > 0) {
        if (in_place) scores16<DT, HD, DT != 2>(a, w, s); else scores16<DT, HD, false>(a, w, s);
    } else
#endif
    for (int64_t n = lo_min; n <= hi_max; ++n) {               // scores, one cached key at a time
        const float* key = load_row<DT>(a.k_cache, slots[n], D, s.krow.data());
        for (int64_t r = 0; r < rows; ++r) {
            if (n > pos[r] || n < row_lo[r]) continue;
            s.scores[r * span + (n - lo_min)] = dot(qrows[r], key, D) * a.scale;
        }
    }
    float* inv_sum = s.inv_sum.data();
    for (int64_t r = 0; r < rows; ++r) {                         // softmax numerators
        const int64_t lo = row_lo[r] - lo_min;
        const int len = static_cast<int>(pos[r] - row_lo[r] + 1);
        float* sc = s.scores.data() + r * span + lo;
        const float m = lane_max(sc, len);                        // exact in any order
        for (int n = 0; n < len; ++n) sc[n] -= m;
        exp_nonpositive(sc, len);
        inv_sum[r] = 1.0f / lane_sum(sc, len);                    // 16 lanes by position from the row's first key
    }
#if defined(__AVX512F__)
    if constexpr (HD > 0) {
        if (in_place) values4<DT, HD, DT != 2>(a, w, s); else values4<DT, HD, false>(a, w, s);
    } else
#endif
    for (int64_t n = lo_min; n <= hi_max; ++n) {               // weighted values, in position order
        const float* val = load_row<DT>(a.v_cache, slots[n], D, s.krow.data());
        for (int64_t r = 0; r < rows; ++r) {
            if (n > pos[r] || n < row_lo[r]) continue;
            float p = s.scores[r * span + (n - lo_min)];
            float* acc = s.acc.data() + r * D;
            for (int64_t d = 0; d < D; ++d) acc[d] += p * val[d];
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float* dst = a.out + ((q_start + j0 + r / rep) * a.num_heads + kvh * rep + r % rep) * D;
        const float* acc = s.acc.data() + r * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] * inv_sum[r];
    }
}

template <int DT>
void run_dim(const Args& a, int64_t seq, int64_t kvh, int64_t j0, int64_t j1, Scratch& s) {
    if (a.D == 64) run_item<DT, 64>(a, seq, kvh, j0, j1, s);
    else if (a.D == 128) run_item<DT, 128>(a, seq, kvh, j0, j1, s);
    else run_item<DT, 0>(a, seq, kvh, j0, j1, s);
}

}  // namespace

extern "C" int specserve_paged_attention(
        const float* q, const void* k_cache, const void* v_cache, int dtype,
        const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens, const int32_t* qsl,
        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t block_size,
        int64_t window, float scale, float* out, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || D <= 0 || block_size <= 0) return 1;
    if (dtype < 0 || dtype > 2) return 1;
    Args a{q, k_cache, v_cache, dtype, block_tables, max_blocks, seq_lens, qsl,
           num_heads, num_kv_heads, D, block_size, window, scale, out};
    std::vector<int64_t> items;       // (seq, tile start) pairs; kv heads are the inner index
    for (int64_t i = 0; i < num_seqs; ++i) {
        for (int64_t j = 0; j < qsl[i + 1] - qsl[i]; j += TILE) { items.push_back(i); items.push_back(j); }
    }
    // A work item is (sequence, tile of queries) and a group of kv heads: all of them once there are enough
    // items to keep every thread busy (a key's kv heads share its cache lines, so one pass over them reads
    // the rest from cache), else one kv head each. The grouping only picks the thread, never the arithmetic.
    const int64_t tiles = static_cast<int64_t>(items.size() / 2);
    const int64_t group = tiles >= 4 * static_cast<int64_t>(num_threads) ? num_kv_heads : 1;
    const int64_t per_tile = num_kv_heads / group, num_items = tiles * per_tile;
    #pragma omp parallel num_threads(num_threads)
    {
        const FlushDenormals modes;
        Scratch scratch;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < num_items; ++w) {
            int64_t item = w / per_tile, kv0 = (w % per_tile) * group;
            int64_t seq = items[2 * item], j0 = items[2 * item + 1];
            int64_t j1 = std::min<int64_t>(j0 + TILE, qsl[seq + 1] - qsl[seq]);
            for (int64_t kvh = kv0; kvh < kv0 + group; ++kvh) {
                if (a.dtype == 0) run_dim<0>(a, seq, kvh, j0, j1, scratch);
                else if (a.dtype == 1) run_dim<1>(a, seq, kvh, j0, j1, scratch);
                else run_dim<2>(a, seq, kvh, j0, j1, scratch);
            }
        }
    }
    return 0;
}

// One layer's step as the model calls it, in one call: this step's K/V rows (k_new, v_new: [num_tokens,
// num_kv_heads, D] in the cache's dtype) written at their slots, then the attention above with
// queries and output in fp32 or bf16 (q_bf16). A bf16 output is the fp32 result rounded to nearest even, as
// torch rounds it. Saves the model's per-layer copies, casts and allocations around the kernel.
extern "C" int specserve_paged_attention_step(
        const void* q, int q_bf16, const void* k_new, const void* v_new, const int64_t* slot_mapping,
        void* k_cache, void* v_cache, int dtype, const int32_t* block_tables, int64_t max_blocks,
        const int32_t* seq_lens, const int32_t* qsl, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
        int64_t D, int64_t block_size, int64_t window, float scale, void* out, int num_threads) {
    if (dtype < 0 || dtype > 2 || num_seqs < 0) return 1;
    const int64_t num_tokens = qsl[num_seqs];
    const size_t row = static_cast<size_t>(num_kv_heads * D) * (dtype == 0 ? 4 : 2);
    for (int64_t t = 0; t < num_tokens; ++t) {
        std::memcpy(static_cast<char*>(k_cache) + slot_mapping[t] * row, static_cast<const char*>(k_new) + t * row, row);
        std::memcpy(static_cast<char*>(v_cache) + slot_mapping[t] * row, static_cast<const char*>(v_new) + t * row, row);
    }
    if (!q_bf16) {
        return specserve_paged_attention(static_cast<const float*>(q), k_cache, v_cache, dtype, block_tables,
                                         max_blocks, seq_lens, qsl, num_seqs, num_heads, num_kv_heads, D, block_size,
                                         window, scale, static_cast<float*>(out), num_threads);
    }
    const int64_t n = num_tokens * num_heads * D;
    std::vector<float> qf(n), of(n);
    const uint16_t* qh = static_cast<const uint16_t*>(q);
    for (int64_t i = 0; i < n; ++i) qf[i] = bf16_to_f32(qh[i]);
    const int rc = specserve_paged_attention(qf.data(), k_cache, v_cache, dtype, block_tables, max_blocks, seq_lens,
                                             qsl, num_seqs, num_heads, num_kv_heads, D, block_size, window, scale,
                                             of.data(), num_threads);
    uint16_t* oh = static_cast<uint16_t*>(out);
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &of[i], 4);
        oh[i] = std::isnan(of[i]) ? 0x7FC0u : static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    }
    return rc;
}
