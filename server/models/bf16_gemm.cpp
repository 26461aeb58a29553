// bf16 linear layer on AMX tiles: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 accumulation, bf16 output
// rounded to nearest even. Called through ctypes by bf16_gemm.py, which packs W once into the tile layout
// below.
//
// Determinism: a row of the output depends on that row of x only. Each output element is one TDPBF16PS
// accumulator updated over K in 32-wide steps in increasing order, whatever M, the thread count or the
// rows around it: rows are computed 16 at a time (a tile), and a last partial block of rows is copied into a
// zero-padded 16-row buffer, so the hardware always runs the same full-tile instructions. The work split
// (column groups x row blocks over the threads) picks the thread, never the arithmetic.
//
// Packed weight layout: [N/16][K/32][16 k-pairs][16 columns][2], i.e. for output column block nb and
// K step kb a 1 KiB tile whose row p holds, for each of the 16 columns, the weights at k = 32 kb + 2p and
// 32 kb + 2p + 1 (the pair TDPBF16PS multiplies with x's elements 2p, 2p + 1).
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))

namespace {

constexpr int64_t TILE_ROWS = 16;       // rows of x per tile
constexpr int64_t TILE_K = 32;          // bf16 elements of K per tile row
constexpr int64_t TILE_ELEMS = 512;     // bf16 elements of one packed weight tile
constexpr int64_t GROUP = 4;            // column blocks (of 16) per accumulator set: tiles 0-3

struct TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Every tile 16 rows x 64 bytes: C (fp32 16 x 16) in 0-3, x in 4, weights in 5-7.
AMX_TARGET void configure_tiles() {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

// rows [0, m) of the accumulators (c: `blocks` tiles of 16 x 16 fp32) plus bias, as bf16 into out.
AMX_TARGET void store_rows(const float* c, int64_t m, int64_t blocks, const float* bias, uint16_t* out,
                           int64_t ldo) {
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {
            __m512 v = _mm512_loadu_ps(c + b * 256 + r * 16);
            if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + b * 16));
            const __m256bh h = _mm512_cvtneps_pbh(v);
            std::memcpy(out + r * ldo + b * 16, &h, sizeof h);
        }
    }
}

// One block of 16 rows of x (a: row stride K) against column blocks [nb0, nb0 + blocks) of the packed weight.
AMX_TARGET void tile_block(const uint16_t* a, int64_t K, const uint16_t* wp, int64_t nb0, int64_t blocks,
                           float* c) {
    const int64_t kb_count = K / TILE_K;
    const int64_t stride = kb_count * TILE_ELEMS;      // between column blocks
    const uint16_t* w = wp + nb0 * stride;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (blocks == GROUP) {
        for (int64_t kb = 0; kb < kb_count; ++kb) {
            const uint16_t* b = w + kb * TILE_ELEMS;
            _tile_loadd(4, a + kb * TILE_K, K * 2);
            _tile_loadd(5, b, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, b + stride, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, b + 2 * stride, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b + 3 * stride, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    } else {
        for (int64_t kb = 0; kb < kb_count; ++kb) {
            const uint16_t* b = w + kb * TILE_ELEMS;
            _tile_loadd(4, a + kb * TILE_K, K * 2);
            _tile_loadd(5, b, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (blocks > 1) {
                _tile_loadd(6, b + stride, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (blocks > 2) {
                _tile_loadd(7, b + 2 * stride, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
        }
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

}  // namespace

// 1 when this CPU has AMX-BF16 and the kernel granted this process the tile state (Linux asks for it once
// per process: arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); 0 otherwise.
extern "C" int specserve_amx_ready() {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return 0;          // AMX-BF16, AMX-TILE
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0;
    return 1;
}

// x [M, K] bf16 row-major, wp packed as above, bias fp32 [N] or null, out [M, N] bf16. Returns 1 on shapes
// it does not take (K not a multiple of 32, N not a multiple of 16).
extern "C" AMX_TARGET int specserve_bf16_linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wp,
                                                int64_t N, const float* bias, uint16_t* out, int num_threads) {
    if (K <= 0 || K % TILE_K != 0 || N <= 0 || N % 16 != 0 || M < 0) return 1;
    if (M == 0) return 0;
    const int64_t nblocks = N / 16, groups = (nblocks + GROUP - 1) / GROUP;
    const int64_t full = M / TILE_ROWS, tail = M % TILE_ROWS, rblocks = full + (tail ? 1 : 0);
    const int64_t items = groups * rblocks;      // group-major: a thread's run of items reuses a group's weights
    #pragma omp parallel num_threads(std::max(1, std::min<int>(num_threads, static_cast<int>(items))))
    {
        configure_tiles();
        alignas(64) float c[GROUP * 256];
        std::vector<uint16_t> stage;
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < items; ++i) {
            const int64_t g = i / rblocks, rb = i % rblocks;
            const int64_t nb0 = g * GROUP, blocks = std::min<int64_t>(GROUP, nblocks - nb0);
            const uint16_t* a = x + rb * TILE_ROWS * K;
            const int64_t m = rb < full ? TILE_ROWS : tail;
            if (m < TILE_ROWS) {                          // the last rows, zero-padded to a full tile
                if (stage.empty()) {
                    stage.assign(TILE_ROWS * K, 0);
                    std::memcpy(stage.data(), a, static_cast<size_t>(m * K) * 2);
                }
                a = stage.data();
            }
            tile_block(a, K, wp, nb0, blocks, c);
            store_rows(c, m, blocks, bias == nullptr ? nullptr : bias + nb0 * 16, out + rb * TILE_ROWS * N + nb0 * 16,
                       N);
        }
        _tile_release();
    }
    return 0;
}
