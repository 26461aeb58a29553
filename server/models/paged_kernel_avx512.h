// The AVX-512 loops of paged_kernel.cpp for head dims known at compile time (64, 128), included by it inside
// its namespace once Args, Scratch and Rows are defined; the arithmetic is the scalar code's (see there).
#pragma once
#if defined(__AVX512F__)
// 16 cached values as fp32, read where they lie: fp32 loaded, bf16 widened in registers (exact; converting
// into a buffer first wrote and re-read every row).
template <int DT>
inline __m512 load16(const void* row, int64_t c) {
    if constexpr (DT == 0) {
        return _mm512_loadu_ps(static_cast<const float*>(row) + c);
    } else {
        static_assert(DT == 1, "fp16 rows go through load_row");
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + c));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
}

// The pairwise tree over 16 lanes (l + 8, then + 4, + 2, + 1) for 16 keys' lane sums at once, by shuffles
// that pair two keys' halves per add: the same additions the scalar tree in dot() makes (the horizontal sum
// per key and row was most of the kernel's time). Element j of the result is key j's sum.
inline __m512 tree16(const __m512* v) {
    __m512 t[8], w[4], x[2];
    for (int i = 0; i < 8; ++i) {       // l + 8: [a 0-7 | b 0-7] + [a 8-15 | b 8-15]
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    }
    for (int m = 0; m < 4; ++m) {       // l + 4, within each key's 8 lanes
        w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], 0xDD));
    }
    for (int n = 0; n < 2; ++n) {       // l + 2, within each key's 4 lanes
        x[n] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * n], w[2 * n + 1], 0x44),
                             _mm512_shuffle_ps(w[2 * n], w[2 * n + 1], 0xEE));
    }
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
    // back to key order: key j = 4 e + L sits in element 4 L + e
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, f);
}

// dot(q, keys[j], HD) for 16 keys at once, bit for bit: each key's 16 lane sums are the same multiply-adds
// over the same chunks, then tree16. Key rows are fp32 (the cache or load_row's buffer) when DT is 0, the
// cache's own bf16 rows when DT is 1.
template <int HD, int DT>
inline __m512 dot16(const float* q, const void* const* keys) {
    static_assert(HD % LANES == 0, "whole 16-lane chunks");
    __m512 v[16];
    for (int j = 0; j < 16; ++j) {
        __m512 acc = _mm512_fmadd_ps(_mm512_loadu_ps(q), load16<DT>(keys[j], 0), _mm512_setzero_ps());
        for (int c = LANES; c < HD; c += LANES) {
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), load16<DT>(keys[j], c), acc);
        }
        v[j] = acc;
    }
    return tree16(v);
}

// Scores of every row, 16 cached keys at a time, scaled; only keys visible to a row are stored. Key rows are
// read in place (fp32, or bf16 widened in registers: decode's few rows) or converted into a buffer per 16 keys.
template <int DT, int HD, bool IN_PLACE>
void scores16(const Args& a, const Rows& w, Scratch& s) {
    constexpr int64_t D = HD;
    s.krow.resize(16 * D);
    const void* keys[16];
    const __m512 scale = _mm512_set1_ps(a.scale);
    for (int64_t n0 = w.lo_min; n0 <= w.hi_max; n0 += 16) {
        const int64_t nk = std::min<int64_t>(16, w.hi_max - n0 + 1);
        for (int64_t j = 0; j < nk; ++j) {
            if constexpr (IN_PLACE) keys[j] = static_cast<const char*>(a.k_cache) + w.slots[n0 + j] * (DT == 0 ? 4 : 2);
            else keys[j] = load_row<DT>(a.k_cache, w.slots[n0 + j], D, s.krow.data() + j * D);
        }
        for (int64_t j = n0 + 16; j < std::min<int64_t>(n0 + 32, w.hi_max + 1); ++j) {   // the next 16 keys
            prefetch_row<DT>(a.k_cache, w.slots[j], D);
        }
        for (int64_t j = nk; j < 16; ++j) keys[j] = keys[0];     // padding: computed, never stored
        for (int64_t r = 0; r < w.rows; ++r) {
            if (n0 > w.pos[r] || n0 + nk - 1 < w.lo[r]) continue;
            // keys n0 + j stored where visible to the row: j in [row_lo - n0, pos - n0] and below nk
            const int64_t first = std::max<int64_t>(0, w.lo[r] - n0);
            const int64_t last = std::min<int64_t>(nk - 1, w.pos[r] - n0);
            const __mmask16 keep = static_cast<__mmask16>(((1u << (last + 1)) - 1u) & ~((1u << first) - 1u));
            const __m512 sc = dot16<HD, IN_PLACE ? DT : 0>(w.qrows[r], keys);
            _mm512_mask_storeu_ps(s.scores.data() + r * w.span + (n0 - w.lo_min), keep, _mm512_mul_ps(sc, scale));
        }
    }
}

// Weighted values in position order, 4 rows' sums held in registers; value rows read in place (fp32, or bf16
// widened per key: decode's few rows) or converted into a buffer once (more rows than IN_PLACE_ROWS, fp16).
template <int DT, int HD, bool IN_PLACE>
void values4(const Args& a, const Rows& w, Scratch& s) {
    constexpr int C = HD / 16;
    constexpr int64_t D = HD;
    if constexpr (!IN_PLACE) {
        s.vbuf.resize(w.span * D);
        for (int64_t n = w.lo_min; n <= w.hi_max; ++n) {
            if (n + 8 <= w.hi_max) prefetch_row<DT>(a.v_cache, w.slots[n + 8], D);
            load_row<DT>(a.v_cache, w.slots[n], D, s.vbuf.data() + (n - w.lo_min) * D);
        }
    }
    for (int64_t r0 = 0; r0 < w.rows; r0 += 4) {
        __m512 acc[4][C];
        for (int rr = 0; rr < 4; ++rr) {
            for (int c = 0; c < C; ++c) acc[rr][c] = _mm512_setzero_ps();
        }
        for (int64_t n = w.lo_min; n <= w.hi_max; ++n) {
            __m512 v[C];
            if constexpr (IN_PLACE) {
                if (r0 == 0 && n + 8 <= w.hi_max) prefetch_row<DT>(a.v_cache, w.slots[n + 8], D);
                const void* val = static_cast<const char*>(a.v_cache) + w.slots[n] * (DT == 0 ? 4 : 2);
                for (int c = 0; c < C; ++c) v[c] = load16<DT>(val, 16 * c);
            } else {
                for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(s.vbuf.data() + (n - w.lo_min) * D + 16 * c);
            }
            for (int rr = 0; rr < 4; ++rr) {
                const int64_t r = r0 + rr;
                if (r >= w.rows || n > w.pos[r] || n < w.lo[r]) continue;
                const __m512 p = _mm512_set1_ps(s.scores[r * w.span + (n - w.lo_min)]);
                for (int c = 0; c < C; ++c) acc[rr][c] = _mm512_fmadd_ps(p, v[c], acc[rr][c]);
            }
        }
        for (int rr = 0; rr < 4 && r0 + rr < w.rows; ++rr) {
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(s.acc.data() + (r0 + rr) * D + 16 * c, acc[rr][c]);
        }
    }
}
#endif
