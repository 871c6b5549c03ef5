// flce's Hopper GEMM: C = alpha·A·B (+ source), A and B K-major or MN-major.
// See hopper_gemm.h.
//
// Per block (one per multiprocessor, persistent over output tiles of
// kBlockM × kBlockN): warpgroup 0 is the producer, one thread of which
// loads each k-block of the tile's A (kBlockM × kBlockK) and B (kBlockN ×
// kBlockK) into a ring of kStages shared-memory stages through the TMA
// (128-byte swizzle, completion counted on the stage's "full" mbarrier): a
// K-major operand as rows of 64 elements along K, an MN-major one as boxes
// of 64 k-rows × 64 elements along M or N, which wgmma reads transposed.
// Warpgroups 1 and 2 each own 64 of the tile's rows, wait on "full", issue
// four wgmma m64n256k16 per stage from shared memory (fp32 accumulators in
// registers, one group kept in flight) and give the stage back on its
// "empty" mbarrier once their wgmma read it; after the tile's last k-block
// they write their 64×256 results, times alpha and plus the source where
// there is one, to C in its dtype (EpilogueMode: through shared memory in
// whole 16-byte pieces of rows, as written straight from the fragment half
// of each stored sector was waste and the stores held the accumulators'
// registers past the next tile's first wgmma; an fp32 C added to in place
// as boxes the TMA adds into it, while the warpgroup goes on), and the
// producer already loads the next tile's stages. Tiles run in bands of
// kBandM row tiles, row tiles fastest, so the blocks in flight share B's
// tile and A's band stays in L2 (its loads marked evict-last).
//
// Ping-pong (HopperGemmArgs::ping_pong): each stage holds one warpgroup's
// 64 rows of A and B's 256; the producer loads a tile's stages in two runs,
// warpgroup 1's rows then warpgroup 2's, and the warpgroups multiply in
// turns (named barriers), so that one writes its tile while the other
// multiplies; B is read once per 64 rows instead of 128.
//
// In clusters of 2, the blocks take adjacent row tiles of one column tile:
// each loads its own A rows and half of B's, which the TMA multicasts into
// both; a stage is free again once both blocks' consumers gave it back.
//
// Traffic: A read once per column tile of the band (from L2 mostly),
// B once per band, C written once (and the source read once); 2·m·n·k FLOP.

#include <cuda.h>  // CUtensorMap and its enums (the driver is reached through the runtime)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <type_traits>

#include "kernels/cuda/device_primitives.cuh"
#include "kernels/cuda/hopper_gemm.h"

namespace flce {
namespace internal_cuda {
namespace {

constexpr int kBlockM = 128;     // two consumer warpgroups × 64 rows
constexpr int kBlockN = 256;     // one wgmma's n
constexpr int kBlockK = 64;      // 64 bf16 = 128 bytes: one swizzle row
constexpr int kStages = 4;       // 48 KiB each (40 in ping-pong)
constexpr int kThreads = 384;    // producer + two consumer warpgroups
// A stage's rows of A: the tile's 128 (both consumer warpgroups read the
// stage), or in ping-pong (HopperGemmArgs::ping_pong) one warpgroup's 64.
template <bool kPingPong>
constexpr int kStageARows = kPingPong ? 64 : kBlockM;
template <bool kPingPong>
constexpr int kStageABytes = kStageARows<kPingPong> * kBlockK * 2;
template <bool kPingPong>
constexpr int kStageBytes = (kStageARows<kPingPong> + kBlockN) * kBlockK * 2;
// An MN-major operand's TMA box: kBlockK rows of k, 64 elements (128
// bytes) of M or N each.
constexpr int kMnBox = 64;
// How the epilogue writes C. kStore: C = alpha·A·B, each consumer warp
// through its staging of 16 rows of 128 bytes of C (each row padded by 8
// elements' bytes, at most 32, so that neither the fragment's writes nor
// the rows' reads meet in a bank), then whole 16-byte pieces of rows.
// kAddSource: the same with fp32 staging and the source's values added
// before C's rounding. kReduceInPlace (C fp32 and its own source): each
// consumer warpgroup stages 64 rows × 32 columns of alpha·A·B (8 KiB,
// 128-byte swizzled, two buffers in turn) and the TMA adds them into C in
// L2 (cp.reduce.async.bulk .add): the warpgroup goes on to its next tile
// without waiting for C's read and write.
enum EpilogueMode { kStore, kAddSource, kReduceInPlace };
constexpr int kConsumerWarps = 8;
constexpr int kReduceCols = 32;  // fp32: one 128-byte swizzle row
constexpr int kReduceBoxBytes = 64 * kReduceCols * 4;
constexpr int kStagingBytes = 2 * 2 * kReduceBoxBytes;  // ≥ kConsumerWarps × 16 × (128 + 32)
static_assert(kStagingBytes >= kConsumerWarps * 16 * (128 + 32), "staging too small");
// The stages, the staging (1024-byte aligned, as the swizzle wants), then
// kStages "full" and kStages "empty" barriers, plus the slack that aligns
// the stages to the swizzle's 1024 bytes.
template <bool kPingPong>
constexpr int kSharedBytes =
    kStages * kStageBytes<kPingPong> + kStagingBytes + 2 * kStages * 8 + 1024;
static_assert(kSharedBytes<false> <= 227 * 1024 && kSharedBytes<true> <= 227 * 1024,
              "more shared memory than a block gets");

// The 128 fp32 accumulators of a wgmma m64n256: their registers in the
// instruction (operands %0–%127) and as the asm's in-out operands.
#define FLCE_WGMMA_D_REGS \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                          \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "    \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define FLCE_WGMMA_D_OUTPUTS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),              \
  "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),            \
  "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),        \
  "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),        \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),        \
  "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),        \
  "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),        \
  "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),        \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),        \
  "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),        \
  "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),        \
  "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),        \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),        \
  "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),        \
  "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),        \
  "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),        \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),      \
  "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),  \
  "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),  \
  "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),  \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),  \
  "+f"(d[126]), "+f"(d[127])

// wgmma m64n256k16 with fp32 accumulators d (this thread's 128 of the
// 64×256 tile), A and B from shared memory by descriptor, D = A·B + D, or
// D = A·B where scale_d is 0. TYPE: the operands' PTX type.
// TRANS_A, TRANS_B: "1" where that operand is MN-major (read transposed).
#define FLCE_WGMMA_M64N256K16(TYPE, TRANS_A, TRANS_B, d, desc_a, desc_b, scale_d)      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                         \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"        \
               FLCE_WGMMA_D_REGS "}, %128, %129, p, 1, 1, " TRANS_A ", " TRANS_B ";\n}\n" \
               : FLCE_WGMMA_D_OUTPUTS(d)                                               \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d))

// What the epilogue adds and scales: C = alpha·(A·B) + source (fp32,
// row stride ld; null: nothing; C itself for kReduceInPlace).
struct Epilogue {
  const float* source;
  int64_t ld_source;
  float alpha;
  bool whole_pieces;  // C (and the source) take 16-byte pieces of rows
};

// wgmma m64n256k16 as FLCE_WGMMA_M64N256K16 with A from registers: a[0..3],
// this thread's 8 elements of the warp's 16×16 slice of A (the layout
// ldmatrix.x4 gives), B from shared memory by descriptor.
#define FLCE_WGMMA_RA_M64N256K16(TYPE, TRANS_B, d, a0, a1, a2, a3, desc_b, scale_d)   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                         \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"        \
               FLCE_WGMMA_D_REGS "}, {%128, %129, %130, %131}, %132, p, 1, 1, " TRANS_B  \
               ";\n}\n"                                                                 \
               : FLCE_WGMMA_D_OUTPUTS(d)                                               \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "r"(scale_d))

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr int kBandM = 16;  // row tiles per band (in clusters of kCluster)
constexpr int kMnBoxBytes = kBlockK * kMnBox * 2;  // an MN-major box: 8 KiB

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void BarrierInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void BarrierExpectBytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void BarrierArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void BarrierWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// The 2-D box at (inner, outer) of `map` into shared memory at `dst`,
// completing its bytes on `bar`, under L2 policy `policy`.
__device__ __forceinline__ void TmaLoad(uint32_t dst, const CUtensorMap* map, int inner,
                                        int outer, uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(inner), "r"(outer), "l"(policy)
      : "memory");
}

// Brings `bytes` (a multiple of 16) at global address `p` (16-byte
// aligned) into L2, without waiting.
__device__ __forceinline__ void PrefetchL2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// Makes this thread's writes to shared memory visible to the TMA (the
// async proxy).
__device__ __forceinline__ void FenceSharedToTma() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The 128 threads of consumer warpgroup `consumer` (named barrier 1 + it).
__device__ __forceinline__ void WarpgroupSync(int consumer) {
  asm volatile("bar.sync %0, 128;" ::"r"(consumer + 1) : "memory");
}

// Adds the fp32 box at shared address `src` into the tensor of `map` at
// (inner, outer), through L2; one bulk group per call.
__device__ __forceinline__ void TmaReduceAdd(const CUtensorMap* map, int inner, int outer,
                                             uint32_t src) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%1, %2}], [%3];\n"
      "cp.async.bulk.commit_group;" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(inner), "r"(outer), "r"(src)
      : "memory");
}

// Waits until at most N of this thread's bulk groups still read their
// shared memory.
template <int N>
__device__ __forceinline__ void TmaWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Waits until all of this thread's bulk groups are complete.
__device__ __forceinline__ void TmaWaitAll() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// This block's rank in its cluster.
__device__ __forceinline__ uint32_t ClusterRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Arrives on the barrier at `bar`'s offset in the shared memory of the
// cluster's block `rank` (this block's own included). Release at the
// block's scope only: the arrival says a stage's wgmma reads are done
// (wgmma.wait_group already waited for them), which needs no fence; a
// cluster-scope release costs a memory barrier per arrival, which waits
// for the epilogue's outstanding stores.
__device__ __forceinline__ void BarrierArriveIn(uint32_t bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// TmaLoad into the same offsets of every block of the cluster in `mask`,
// completing on each one's barrier at `bar`'s offset.
__device__ __forceinline__ void TmaMulticast(uint32_t dst, const CUtensorMap* map, int inner,
                                             int outer, uint32_t bar, uint16_t mask,
                                             uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster.L2::cache_hint [%0], [%1, {%3, %4}], [%2], %5, %6;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(inner), "r"(outer), "h"(mask),
      "l"(policy)
      : "memory");
}

// Every running thread of the cluster reaches this point before any goes on.
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// A wgmma shared-memory descriptor of an operand's tile as the TMA wrote
// it (rows of 128 bytes, 128-byte swizzled, 8-row groups 1024 bytes apart),
// starting at shared address `addr`. K-major: the rows run along K, one per
// row of the operand (the leading byte offset unused). MN-major: the rows
// run along M or N, one per k, in boxes of 64 k-rows (8 KiB) that hold 64
// elements of M or N each; the leading byte offset steps from one box to
// the next along M or N, the stride byte offset from one 8-row group of k
// to the next.
template <bool kMN>
__device__ __forceinline__ uint64_t Descriptor(uint32_t addr) {
  uint64_t desc = (addr & 0x3FFFF) >> 4;                    // start address
  desc |= uint64_t{kMN ? kMnBoxBytes >> 4 : 1} << 16;       // leading byte offset
  desc |= uint64_t{1024 >> 4} << 32;                        // stride byte offset
  desc |= uint64_t{1} << 62;                                // 128-byte swizzle
  return desc;
}

// What a descriptor's address advances by for the next 16 elements of K
// (one wgmma's k): 32 bytes along a K-major row; 16 rows of an MN-major tile.
template <bool kMN>
constexpr uint64_t kDescriptorStepK = kMN ? (16 * 128) >> 4 : 32 >> 4;

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accesses to the accumulators across the
// asynchronous wgmma's fences.
__device__ __forceinline__ void FenceAccumulators(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define FLCE_WGMMA_FORMS(TYPE, d, desc_a, desc_b, scale_d)                          \
  if constexpr (kMnA && kMnB) {                                                       \
    FLCE_WGMMA_M64N256K16(TYPE, "1", "1", d, desc_a, desc_b, scale_d);                \
  } else if constexpr (kMnB) {                                                        \
    FLCE_WGMMA_M64N256K16(TYPE, "0", "1", d, desc_a, desc_b, scale_d);                \
  } else {                                                                            \
    static_assert(!kMnA, "an MN-major A only with an MN-major B");                    \
    FLCE_WGMMA_M64N256K16(TYPE, "0", "0", d, desc_a, desc_b, scale_d);                \
  }

template <typename T, bool kMnA, bool kMnB>
__device__ __forceinline__ void Wgmma(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                      int scale_d) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    FLCE_WGMMA_FORMS("bf16", d, desc_a, desc_b, scale_d);
  } else {
    FLCE_WGMMA_FORMS("f16", d, desc_a, desc_b, scale_d);
  }
}
#undef FLCE_WGMMA_FORMS

// Two 16-bit values as floats, and back (rounded to nearest).
template <typename T>
__device__ __forceinline__ float2 Unpack(uint32_t v);
template <>
__device__ __forceinline__ float2 Unpack<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
template <>
__device__ __forceinline__ float2 Unpack<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}
template <typename T>
__device__ __forceinline__ uint32_t Pack(float x, float y);
template <>
__device__ __forceinline__ uint32_t Pack<__nv_bfloat16>(float x, float y) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t Pack<__half>(float x, float y) {
  const __half2 v = __floats2half2_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Two adjacent results of a row, in C's dtype, to shared memory at `p`.
template <typename OutT>
__device__ __forceinline__ void StagePair(uint8_t* p, float x, float y) {
  if constexpr (std::is_same_v<OutT, float>) {
    *reinterpret_cast<float2*>(p) = make_float2(x, y);
  } else {
    *reinterpret_cast<uint32_t*>(p) = Pack<OutT>(x, y);
  }
}

// Four adjacent results of a row, in C's dtype, to global memory at `p`
// (aligned to their size), streaming.
template <typename OutT>
__device__ __forceinline__ void StoreFour(OutT* p, float4 x) {
  if constexpr (std::is_same_v<OutT, float>) {
    __stcs(reinterpret_cast<float4*>(p), x);
  } else {
    __stcs(reinterpret_cast<uint2*>(p), make_uint2(Pack<OutT>(x.x, x.y), Pack<OutT>(x.z, x.w)));
  }
}

// The row and column tile of cluster block `rank` for the cluster's tile
// `tile` of tiles_m × tiles_n (tiles_m counting kCluster row tiles each):
// bands of kBandM row tiles, row tiles fastest within a band.
template <int kCluster>
__device__ __forceinline__ void TileAt(int tile, int tiles_m, int tiles_n, uint32_t rank,
                                       int& tm, int& tn) {
  constexpr int kBand = kBandM / kCluster;
  const int band = tile / (kBand * tiles_n);
  const int first = band * kBand;
  const int rows = min(kBand, tiles_m - first);
  const int local = tile - band * kBand * tiles_n;
  tm = (first + local % rows) * kCluster + rank;
  tn = local / rows;
}

template <typename T, bool kMnB>
__device__ __forceinline__ void WgmmaRegA(float (&d)[128], const uint32_t (&a)[16], int kk,
                                          uint64_t desc_b, int scale_d) {
  static_assert(kMnB, "the fused gradient only in the dX form");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    FLCE_WGMMA_RA_M64N256K16("bf16", "1", d, a[4 * kk], a[4 * kk + 1], a[4 * kk + 2],
                             a[4 * kk + 3], desc_b, scale_d);
  } else {
    FLCE_WGMMA_RA_M64N256K16("f16", "1", d, a[4 * kk], a[4 * kk + 1], a[4 * kk + 2],
                             a[4 * kk + 3], desc_b, scale_d);
  }
}

// Keeps the compiler from reusing A's registers while a wgmma may still
// read them: their live range then reaches the wait that saw it done (else
// ptxas orders every later write of those registers after the wgmma).
__device__ __forceinline__ void FenceOperands(uint32_t (&a)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// Four 8×8 matrices of 16-bit elements from shared memory (ldmatrix.x4):
// lane l gives the address of row l % 8 of matrix l / 8; r[i] gets this
// lane's two elements of matrix i (row lane / 4, columns 2·(lane % 4) + 0, 1).
__device__ __forceinline__ void LoadMatrices(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// A thread's two rows of the fused gradient (LogitGradient): rows
// lane/4 and lane/4 + 8 of its warp's 16.
struct GradientRows {
  float lse[2], coef[2], target[2];
  int column[2];

  __device__ __forceinline__ void Load(const LogitGradient& g, int64_t first_row, int m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = first_row + 8 * h;
      column[h] = row < m ? g.column[row] : LogitGradient::kIgnoredRow;
      lse[h] = row < m ? g.lse[row] : 0.0f;
      coef[h] = row < m ? g.coef[row] : 0.0f;
      target[h] = row < m ? g.target[row] : 0.0f;
    }
  }
  // The gradient at logit z of row half h off its target column, as
  // LaunchGradientRows writes it before its rounding (zero in an ignored
  // row). The target's column and columns past k are set apart (Fix).
  __device__ __forceinline__ float OffTarget(float z, int h) const {
    const float g = PlainOffTarget(coef[h], z, lse[h]);
    return column[h] == LogitGradient::kIgnoredRow ? 0.0f : g;
  }
  // Rewrites the pair of row half h at columns j, j + 1 (packed in `a`)
  // where one of them is the target's or past k.
  template <typename T>
  __device__ __forceinline__ void Fix(uint32_t& a, int h, int j, int k) const {
    if (j + 1 < k && (column[h] < j || column[h] > j + 1)) return;
    float2 g = Unpack<T>(a);
    if (j == column[h]) g.x = target[h];
    if (j + 1 == column[h]) g.y = target[h];
    if (j >= k) g.x = 0.0f;
    if (j + 1 >= k) g.y = 0.0f;
    a = Pack<T>(g.x, g.y);
  }
};

// k-blocks before a tile's end at which the producer prefetches the
// tile's source: about 8 stages' time ahead of the epilogue (the producer
// runs up to kStages ahead of the consumers).
constexpr int kSourcePrefetchBlocks = 4;

// Rows [row0, row0 + rows) of the source in column tile tn (up to kBlockN
// values each) into L2, in whole 16-byte pieces (a row's tail of fewer is
// left to the epilogue's own load). Only where the epilogue takes whole
// pieces (aligned rows).
__device__ __forceinline__ void PrefetchSource(const Epilogue& e, int m, int n, int row0, int rows,
                                               int tn) {
  if (!e.whole_pieces) return;
  const int col = tn * kBlockN;
  const uint32_t bytes = static_cast<uint32_t>(min(kBlockN, n - col)) * 4 / 16 * 16;
  if (bytes == 0) return;
  const int last = min(m, row0 + rows);
  for (int row = row0; row < last; ++row) {
    PrefetchL2(e.source + static_cast<int64_t>(row) * e.ld_source + col, bytes);
  }
}

// Ping-pong's turns (named barriers 3 and 4; 1 and 2 are WarpgroupSync's):
// consumer warpgroup `consumer` waits until the other gave it the turn, or
// gives the other its turn.
__device__ __forceinline__ void WaitTurn(int consumer) {
  if (consumer == 0) {
    asm volatile("bar.sync 3, 256;" ::: "memory");
  } else {
    asm volatile("bar.sync 4, 256;" ::: "memory");
  }
}
__device__ __forceinline__ void GiveTurn(int consumer) {
  if (consumer == 0) {
    asm volatile("bar.arrive 4, 256;" ::: "memory");
  } else {
    asm volatile("bar.arrive 3, 256;" ::: "memory");
  }
}

// A consumer warpgroup's part of HopperGemmKernel: 64 rows of each tile
// (warpgroup 1 the first 64, warpgroup 2 the next), from the stages the
// producer fills, written to C as kMode says (EpilogueMode). `staging`:
// the block's staging region (shared address and pointer).
//
// Cooperative (kPingPong false): both warpgroups read every stage (A's 128
// rows, each its 64) and multiply at once, then both write their rows.
// Ping-pong: a stage holds one warpgroup's 64 rows of A; the stages come in
// runs of k_blocks, warpgroup 1's half of a tile, then warpgroup 2's, and
// the two multiply in turns, so that one's epilogue runs while the other
// multiplies. The turns also keep each warpgroup at most one round of the
// ring ahead of the stage it waits on (a parity wait cannot tell a phase
// from the one two rounds before): a warpgroup starts its run only once
// the other has waited on all of its own.
template <typename T, typename OutT, int kCluster, bool kMnA, bool kMnB, int kMode, bool kGradA,
          bool kPingPong>
__device__ __forceinline__ void Consume(OutT* c, int64_t ldc, int m, int n, int k, int tiles_m,
                                        int tiles_n, int tiles, int k_blocks, int first_tile,
                                        int tile_step, uint32_t rank, uint32_t stage_a,
                                        uint32_t stage_b, uint32_t full, uint32_t empty,
                                        uint32_t staging_address, uint8_t* staging_region,
                                        const CUtensorMap* map_c, const Epilogue& epilogue,
                                        const LogitGradient& gradient) {
  constexpr bool kAccumulate = kMode == kAddSource;
  const int consumer = threadIdx.x / 128 - 1;
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x % 128) / 32;
  // This warp's staging (kStore, kAddSource), or this warpgroup's two
  // buffers (kReduceInPlace), and which of them is next.
  uint8_t* staging = staging_region + (threadIdx.x / 32 - 4) * 16 * (128 + 32);
  const uint32_t reduce_buffers = staging_address + consumer * 2 * kReduceBoxBytes;
  int reduce_next = 0;
  // Gives a stage back to every block of the cluster.
  auto release = [&](int stage) {
    if (lane != 0) return;
    if constexpr (kCluster > 1) {
      for (uint32_t q = 0; q < kCluster; ++q) BarrierArriveIn(empty + 8 * stage, q);
    } else {
      BarrierArrive(empty + 8 * stage);
    }
  };
  static_assert(!(kPingPong && kGradA), "the fused gradient runs cooperatively");
  // This warpgroup's 64 rows of A in a stage: the second half of a K-major
  // tile's rows, or the second of an MN-major tile's two boxes (both 8 KiB
  // on); in ping-pong the stage's only 64.
  const uint32_t a_offset = kPingPong ? 0 : consumer * 64 * kBlockK * 2;
  float d[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) d[i] = 0.0f;
  int stage = 0;
  uint32_t phase = 0;
  // Past the other warpgroup's run of `blocks` stages (ping-pong).
  auto skip = [&](int blocks) {
    const int next = stage + blocks;
    phase ^= static_cast<uint32_t>(next / kStages) & 1;
    stage = next % kStages;
  };
  for (int tile = first_tile, turn = 0; tile < tiles; tile += tile_step, ++turn) {
    int tm, tn;
    TileAt<kCluster>(tile, tiles_m, tiles_n, rank, tm, tn);
    if constexpr (kPingPong) {
      if (consumer == 1) skip(k_blocks);
      if (consumer == 1 || turn > 0) WaitTurn(consumer);
    }
    int previous = -1;
    if constexpr (kGradA) {
      // A: this warpgroup's 64 logit rows of each stage through ldmatrix
      // (row r's 16-byte piece q at q ^ (r % 8), the TMA's swizzle), turned
      // into the gradient in registers, in two register sets in turn: the
      // wgmma of the k-block before may still read the other set.
      GradientRows rows;
      rows.Load(gradient, static_cast<int64_t>(tm) * kBlockM + consumer * 64 + warp * 16 + lane / 4,
                m);
      uint32_t a_even[16], a_odd[16];
      // `a` this k-block's, `other` the one before's.
      auto step = [&](uint32_t (&a)[16], uint32_t (&other)[16], int kb) {
        BarrierWait(full + 8 * stage, phase);
        const uint32_t a_tile = stage_a + stage * kStageABytes<kPingPong> + a_offset;
        const uint64_t desc_b = Descriptor<kMnB>(stage_b + stage * kBlockN * kBlockK * 2);
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
          const int r = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
          const int piece = 2 * kk + lane / 16;
          uint32_t raw[4];
          LoadMatrices(raw, a_tile + r * 128 + ((piece ^ (r % 8)) << 4));
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            // raw[i]: row half i % 2, columns 8·(i / 2) + 2·(lane % 4) + 0, 1.
            const float2 z = Unpack<T>(raw[i]);
            a[4 * kk + i] = Pack<T>(rows.OffTarget(z.x, i % 2), rows.OffTarget(z.y, i % 2));
          }
        }
        // The target's column, in one k-block of each row, and the columns
        // past k, in the last: set apart from the exponentials above.
        const int first = kb * kBlockK;
        const bool tail = first + kBlockK > k;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (tail || (rows.column[h] >= first && rows.column[h] < first + kBlockK)) {
#pragma unroll
            for (int kk = 0; kk < kBlockK / 16; ++kk) {
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                rows.Fix<T>(a[4 * kk + 2 * half + h], h,
                            first + 16 * kk + 8 * half + 2 * (lane % 4), k);
              }
            }
          }
        }
        WgmmaFence();
        FenceAccumulators(d);
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
          WgmmaRegA<T, kMnB>(d, a, kk, desc_b + kk * kDescriptorStepK<kMnB>,
                             (kb > 0 || kk > 0) ? 1 : 0);
        }
        WgmmaCommit();
        FenceAccumulators(d);
        FenceOperands(a);
        WgmmaWait<1>();
        FenceOperands(other);  // the k-block before's wgmma is done with them
        if (previous >= 0) release(previous);
        previous = stage;
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      };
      for (int kb = 0; kb < k_blocks; ++kb) {
        if (kb % 2 == 0) {
          step(a_even, a_odd, kb);
        } else {
          step(a_odd, a_even, kb);
        }
      }
      WgmmaWait<0>();
      FenceOperands(a_even);
      FenceOperands(a_odd);
    }
    for (int kb = 0; kb < (kGradA ? 0 : k_blocks); ++kb) {
      BarrierWait(full + 8 * stage, phase);
      const uint64_t desc_a =
          Descriptor<kMnA>(stage_a + stage * kStageABytes<kPingPong> + a_offset);
      const uint64_t desc_b = Descriptor<kMnB>(stage_b + stage * kBlockN * kBlockK * 2);
      WgmmaFence();
      FenceAccumulators(d);
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        Wgmma<T, kMnA, kMnB>(d, desc_a + kk * kDescriptorStepK<kMnA>,
                             desc_b + kk * kDescriptorStepK<kMnB>, (kb > 0 || kk > 0) ? 1 : 0);
      }
      WgmmaCommit();
      FenceAccumulators(d);
      // The group before this one is done: its stage goes back.
      WgmmaWait<1>();
      if (previous >= 0) release(previous);
      previous = stage;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    if constexpr (kPingPong) {
      // Every stage of this run waited on: the other's turn (none after
      // warpgroup 2's last tile, which warpgroup 1 would never take).
      if (consumer == 0 || tile + tile_step < tiles) GiveTurn(consumer);
      if (consumer == 0) skip(k_blocks);
    }
    WgmmaWait<0>();
    FenceAccumulators(d);
    if (previous >= 0) release(previous);

    if constexpr (kMode == kReduceInPlace) {
      // The epilogue of an fp32 C added to in place, 32 columns at a time:
      // alpha times the fragment (d[4j + q] is row lane/4 + 8·(q/2), column
      // 8j + 2·(lane%4) + q%2 of the warp's 16 rows) into a buffer (row
      // r's 16-byte piece q at piece q ^ (r % 8), the TMA's 128-byte
      // swizzle), then the TMA adds the 64×32 box into C. Before a buffer
      // is written again, the add two boxes back has read it.
      const int row0 = tm * kBlockM + consumer * 64;
      if (row0 < m) {
#pragma unroll
        for (int chunk = 0; chunk < kBlockN / kReduceCols; ++chunk) {
          const int chunk_col = tn * kBlockN + chunk * kReduceCols;
          if (chunk_col >= n) break;
          const uint32_t buffer = reduce_buffers + reduce_next * kReduceBoxBytes;
          if (threadIdx.x % 128 == 0) TmaWaitRead<1>();
          WarpgroupSync(consumer);
#pragma unroll
          for (int jj = 0; jj < kReduceCols / 8; ++jj) {
            const int j = chunk * (kReduceCols / 8) + jj;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int r = warp * 16 + lane / 4 + 8 * half;
              const int piece = 2 * jj + (lane % 4) / 2;
              const uint32_t at = buffer + r * 128 + ((piece ^ (r % 8)) * 16) + 8 * (lane % 2);
              asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(at),
                           "f"(epilogue.alpha * d[4 * j + 2 * half]),
                           "f"(epilogue.alpha * d[4 * j + 2 * half + 1])
                           : "memory");
            }
          }
          FenceSharedToTma();
          WarpgroupSync(consumer);
          if (threadIdx.x % 128 == 0) TmaReduceAdd(map_c, chunk_col, row0, buffer);
          reduce_next ^= 1;
        }
      }
      continue;
    }
    // The epilogue, 128 bytes of staged columns at a time: the warp's
    // fragment (d[4j + q] is row lane/4 + 8·(q/2), column 8j + 2·(lane%4) +
    // q%2 of its 16 rows) into its staging, times alpha, then whole 16-byte
    // pieces of rows to C, so that each store writes whole lines; streaming
    // (evict-first), as nothing reads C again here. With a source, the
    // staging holds fp32 and each piece of C is its four values plus the
    // source's, rounded once.
    using StageT = std::conditional_t<kAccumulate, float, OutT>;
    constexpr int kChunkCols = 128 / sizeof(StageT);
    constexpr int kPitch = 128 + 8 * sizeof(StageT);
    constexpr int kPieceCols = 16 / sizeof(StageT);
    const int64_t warp_row = static_cast<int64_t>(tm) * kBlockM + consumer * 64 + warp * 16;
    if (warp_row < m) {
#pragma unroll
      for (int chunk = 0; chunk < kBlockN / kChunkCols; ++chunk) {
        const int chunk_col = tn * kBlockN + chunk * kChunkCols;
        if (chunk_col >= n) break;
        // The source's pieces of this chunk, all four loads in flight
        // at once, before the staging's writes.
        float4 added[4];
        if constexpr (kAccumulate) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int64_t grow = warp_row + i * 4 + lane / 8;
            const int gcol = chunk_col + (lane % 8) * kPieceCols;
            if (epilogue.whole_pieces && grow < m && gcol + kPieceCols <= n) {
              added[i] = *reinterpret_cast<const float4*>(epilogue.source +
                                                          grow * epilogue.ld_source + gcol);
            }
          }
        }
#pragma unroll
        for (int jj = 0; jj < kChunkCols / 8; ++jj) {
          const int j = chunk * (kChunkCols / 8) + jj;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            StagePair<StageT>(staging + (lane / 4 + 8 * half) * kPitch +
                                  (8 * jj + 2 * (lane % 4)) * sizeof(StageT),
                              epilogue.alpha * d[4 * j + 2 * half],
                              epilogue.alpha * d[4 * j + 2 * half + 1]);
          }
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = i * 4 + lane / 8;  // of the warp's 16
          const int piece = lane % 8;        // of the row's 8
          const int4 v = *reinterpret_cast<const int4*>(staging + row * kPitch + piece * 16);
          const int64_t grow = warp_row + row;
          const int gcol = chunk_col + piece * kPieceCols;
          if (grow >= m || gcol >= n) continue;
          OutT* p = c + grow * ldc + gcol;
          const bool whole = epilogue.whole_pieces && gcol + kPieceCols <= n;
          if constexpr (kAccumulate) {
            float4 x = *reinterpret_cast<const float4*>(&v);
            const float* src = epilogue.source + grow * epilogue.ld_source + gcol;
            if (whole) {
              const float4 y = added[i];
              StoreFour(p, make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w));
            } else {
              const float e[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
              for (int q = 0; q < 4; ++q) {
                if (gcol + q < n) p[q] = FromFloatDev<OutT>(e[q] + src[q]);
              }
            }
          } else if (whole) {
            __stcs(reinterpret_cast<int4*>(p), v);
          } else {
            const OutT* e = reinterpret_cast<const OutT*>(&v);
#pragma unroll
            for (int q = 0; q < kPieceCols; ++q) {
              if (gcol + q < n) p[q] = e[q];
            }
          }
        }
        __syncwarp();
      }
    }
  }
  // The TMA's adds read this block's shared memory and write C: done
  // before the block exits.
  if (kMode == kReduceInPlace && threadIdx.x % 128 == 0) TmaWaitAll();
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename T, typename OutT, int kCluster, bool kMnA, bool kMnB, int kMode, bool kGradA,
          bool kPingPong>
__global__ void __launch_bounds__(kThreads, 1)
    HopperGemmKernel(const __grid_constant__ CUtensorMap map_a,
                     const __grid_constant__ CUtensorMap map_b,
                     const __grid_constant__ CUtensorMap map_c, OutT* c, int64_t ldc, int m,
                     int n, int k, const Epilogue epilogue, const LogitGradient gradient) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t shared_raw[];
  const uint32_t raw = SharedAddress(shared_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  constexpr int kARows = kStageARows<kPingPong>;
  const uint32_t stage_a = base;                                        // kStages × kARows×kBlockK
  const uint32_t stage_b = base + kStages * kStageABytes<kPingPong>;    // kStages × kBlockN×kBlockK
  const uint32_t staging = base + kStages * kStageBytes<kPingPong>;     // kStagingBytes
  const uint32_t full = staging + kStagingBytes;                    // kStages barriers
  const uint32_t empty = full + kStages * 8;                        // kStages barriers
  // The blocks of a cluster take kCluster row tiles of one column tile:
  // each loads its own A rows and 1/kCluster of B's, which the TMA writes
  // into every block of the cluster. A stage is free again once every
  // block's consumers are done with it.
  const uint32_t rank = kCluster > 1 ? ClusterRank() : 0;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      BarrierInit(full + 8 * s, 1);
      // Every block's consumer warps that read the stage (ping-pong: one
      // warpgroup's).
      BarrierInit(empty + 8 * s, (kPingPong ? kConsumerWarps / 2 : kConsumerWarps) * kCluster);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (kCluster > 1) {
    ClusterSync();  // the peers' barriers exist before anything reaches them
  } else {
    __syncthreads();
  }

  const int tiles_m = (m + kBlockM * kCluster - 1) / (kBlockM * kCluster);  // cluster row tiles
  const int tiles_n = (n + kBlockN - 1) / kBlockN;
  const int tiles = tiles_m * tiles_n;
  const int k_blocks = (k + kBlockK - 1) / kBlockK;
  const int warpgroup = threadIdx.x / 128;
  const int first_tile = blockIdx.x / kCluster;
  const int tile_step = gridDim.x / kCluster;
  constexpr int kSliceRows = kBlockN / kCluster;  // B rows each block loads

  if (warpgroup == 0) {
    // The producer: few registers, one thread issues the loads.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      // A's band is read again for each of its column tiles: kept in L2.
      const uint64_t keep = L2EvictLast(), normal = L2EvictNormal();
      int stage = 0;
      uint32_t phase = 0;
      for (int tile = first_tile; tile < tiles; tile += tile_step) {
        int tm, tn;
        TileAt<kCluster>(tile, tiles_m, tiles_n, rank, tm, tn);
        // One run of stages for the tile's rows of A, or (ping-pong) one
        // for each warpgroup's 64.
        for (int run = 0; run < kBlockM / kARows; ++run) {
          const int row0 = tm * kBlockM + run * kARows;
          for (int kb = 0; kb < k_blocks; ++kb) {
            // The source's part of the run's rows into L2 some stages
            // before the epilogue reads it (read straight from memory,
            // each of its chunks waited for DRAM in turn).
            if (kMode == kAddSource && kb == max(0, k_blocks - kSourcePrefetchBlocks)) {
              PrefetchSource(epilogue, m, n, row0, kARows, tn);
            }
            BarrierWait(empty + 8 * stage, phase ^ 1);
            const uint32_t bar = full + 8 * stage;
            BarrierExpectBytes(bar, kStageBytes<kPingPong>);
            // A K-major operand's box is 64 elements of K × its rows (at
            // (k, row)); an MN-major one's 64 elements of M or N × 64
            // k-rows (at (column, k)), kMnBoxBytes each.
            const uint32_t a_stage = stage_a + stage * kStageABytes<kPingPong>;
            if constexpr (kMnA) {
              for (int box = 0; box < kARows / kMnBox; ++box) {
                TmaLoad(a_stage + box * kMnBoxBytes, &map_a, row0 + box * kMnBox, kb * kBlockK,
                        bar, keep);
              }
            } else {
              TmaLoad(a_stage, &map_a, kb * kBlockK, row0, bar, keep);
            }
            // B: this block's share of the tile's rows (all of them, or
            // 1/kCluster multicast into every block of the cluster).
            const uint32_t b_stage = stage_b + stage * kBlockN * kBlockK * 2;
            if constexpr (kMnB) {
              constexpr int kBoxes = kBlockN / kMnBox / kCluster;
              for (int i = 0; i < kBoxes; ++i) {
                const int box = rank * kBoxes + i;
                const uint32_t dst = b_stage + box * kMnBoxBytes;
                const int column = tn * kBlockN + box * kMnBox;
                if constexpr (kCluster > 1) {
                  TmaMulticast(dst, &map_b, column, kb * kBlockK, bar, (1u << kCluster) - 1,
                               normal);
                } else {
                  TmaLoad(dst, &map_b, column, kb * kBlockK, bar, normal);
                }
              }
            } else if constexpr (kCluster > 1) {
              TmaMulticast(b_stage + rank * kSliceRows * kBlockK * 2, &map_b, kb * kBlockK,
                           tn * kBlockN + rank * kSliceRows, bar, (1u << kCluster) - 1, normal);
            } else {
              for (int half = 0; half < 2; ++half) {
                TmaLoad(b_stage + half * 128 * kBlockK * 2, &map_b, kb * kBlockK,
                        tn * kBlockN + half * 128, bar, normal);
              }
            }
            if (++stage == kStages) {
              stage = 0;
              phase ^= 1;
            }
          }
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    Consume<T, OutT, kCluster, kMnA, kMnB, kMode, kGradA, kPingPong>(
        c, ldc, m, n, k, tiles_m, tiles_n, tiles, k_blocks, first_tile, tile_step, rank, stage_a,
        stage_b, full, empty, staging, shared_raw + (staging - raw), &map_c, epilogue, gradient);
  }
  // No block leaves while a peer may still arrive on its barriers.
  if constexpr (kCluster > 1) ClusterSync();
#else
  __trap();  // built for Hopper's sm_90a only; the launcher checks the device
#endif
}


using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, through the runtime (no -lcuda).
EncodeTiled TensorMapEncoder() {
  static const EncodeTiled encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(fn);
  }();
  return encode;
}

// Whether rows of `ld` elements of `bytes` each at `p` start on 16 bytes.
bool RowsOf16Bytes(const void* p, int64_t ld, size_t bytes) {
  return (ld * bytes) % 16 == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// A map over an operand of `rows` rows of `cols` elements (row stride
// `ld`), in boxes of box_rows × box_cols, 128-byte swizzled (box_cols × 2
// bytes = 128); zeros past the edges.
cudaError_t MakeMap(CUtensorMap* map, const void* data, CUtensorMapDataType type, int64_t rows,
                    int64_t cols, int64_t ld, int box_rows, int box_cols) {
  const EncodeTiled encode = TensorMapEncoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      encode(map, type, 2, const_cast<void*>(data), dims, strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The map of an operand with `extent` rows along M or N: K-major, boxes of
// `k_major_rows` rows × kBlockK; MN-major (k rows of `extent`), boxes of
// kBlockK rows × kMnBox.
cudaError_t OperandMap(CUtensorMap* map, const void* data, CUtensorMapDataType type, Major major,
                       int64_t extent, int64_t k, int64_t ld, int k_major_rows) {
  if (major == Major::kMN) return MakeMap(map, data, type, k, extent, ld, kBlockK, kMnBox);
  return MakeMap(map, data, type, extent, k, ld, k_major_rows, kBlockK);
}

template <typename T, typename OutT, int kCluster, bool kMnA, bool kMnB, int kMode, bool kGradA,
          bool kPingPong>
cudaError_t Launch(const HopperGemmArgs& args, const CUtensorMap& map_a, const CUtensorMap& map_b,
                   const CUtensorMap& map_c, int sms, cudaStream_t stream) {
  auto kernel = HopperGemmKernel<T, OutT, kCluster, kMnA, kMnB, kMode, kGradA, kPingPong>;
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSharedBytes<kPingPong>;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  // Once per device (each cost host time in every launch): the kernel's
  // shared memory, and how many of its clusters fit at once (a GPC's odd
  // multiprocessor holds no cluster of 2). 0: not yet; -1: not known.
  constexpr int kMaxDevices = 64;
  static std::atomic<int> clusters_on[kMaxDevices];
  int device = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  int clusters = device < kMaxDevices ? clusters_on[device].load(std::memory_order_acquire) : 0;
  if (clusters == 0) {
    error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 kSharedBytes<kPingPong>);
    if (error != cudaSuccess) return error;
    clusters = -1;
    if (kCluster > 1) {
      config.gridDim = dim3(sms / kCluster * kCluster);
      int found = 0;
      if (cudaOccupancyMaxActiveClusters(&found, kernel, &config) == cudaSuccess && found > 0) {
        clusters = found;
      }
      cudaGetLastError();  // a failed query only leaves the estimate
    }
    if (device < kMaxDevices) clusters_on[device].store(clusters, std::memory_order_release);
  }
  // Persistent: as many clusters as can be resident at once, never more
  // than there are tiles.
  int resident = sms / kCluster;
  if (clusters > 0 && clusters < resident) resident = clusters;
  const int64_t tiles = ((args.m + kBlockM * kCluster - 1) / (kBlockM * kCluster)) *
                        ((args.n + kBlockN - 1) / kBlockN);
  config.gridDim = dim3(static_cast<unsigned>((tiles < resident ? tiles : resident) * kCluster));
  // 16-byte pieces of C's rows where its rows allow them (with a source,
  // pieces of four values, of C and of the source alike).
  Epilogue epilogue{args.source, args.ld_source, args.alpha, false};
  if (kMode == kAddSource) {
    epilogue.whole_pieces = args.ldc % 4 == 0 &&
                            reinterpret_cast<uintptr_t>(args.c) % (4 * sizeof(OutT)) == 0 &&
                            RowsOf16Bytes(args.source, args.ld_source, sizeof(float));
  } else {
    epilogue.whole_pieces = RowsOf16Bytes(args.c, args.ldc, sizeof(OutT));
  }
  error = cudaLaunchKernelEx(&config, kernel, map_a, map_b, map_c, static_cast<OutT*>(args.c),
                             args.ldc, static_cast<int>(args.m), static_cast<int>(args.n),
                             static_cast<int>(args.k), epilogue, args.gradient);
  if (error != cudaSuccess) return error;
  return cudaGetLastError();
}

template <typename T, typename OutT, bool kMnA, bool kMnB, int kMode, bool kPingPong>
cudaError_t LaunchForm(const HopperGemmArgs& args, CUtensorMapDataType type, int sms,
                       cudaStream_t stream) {
  // A's stage in one K-major box of its 128 rows (ping-pong: 64), B's in boxes of the 128 rows
  // that one load brings (half of its 256, or a cluster block's share);
  // MN-major operands in 8 KiB boxes; C (kReduceInPlace) in boxes of one
  // warpgroup's 64 rows × kReduceCols.
  CUtensorMap map_a, map_b, map_c = {};
  cudaError_t error =
      OperandMap(&map_a, args.a, type, args.a_major, args.m, args.k, args.lda,
                 kStageARows<kPingPong>);
  if (error != cudaSuccess) return error;
  error = OperandMap(&map_b, args.b, type, args.b_major, args.n, args.k, args.ldb, kBlockN / 2);
  if (error != cudaSuccess) return error;
  if (kMode == kReduceInPlace) {
    error = MakeMap(&map_c, args.c, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, args.m, args.n,
                    args.ldc * 2, 64, kReduceCols);  // (MakeMap's ld counts 2-byte elements)
    if (error != cudaSuccess) return error;
  }
  // The fused gradient only in the dX form, cooperatively (HopperGemmSupported).
  if constexpr (!kMnA && kMnB && !kPingPong) {
    if (args.gradient.present()) {
      if (args.cluster == 2) {
        return Launch<T, OutT, 2, kMnA, kMnB, kMode, true, false>(args, map_a, map_b, map_c, sms,
                                                                 stream);
      }
      return Launch<T, OutT, 1, kMnA, kMnB, kMode, true, false>(args, map_a, map_b, map_c, sms,
                                                               stream);
    }
  }
  if (args.cluster == 2) {
    return Launch<T, OutT, 2, kMnA, kMnB, kMode, false, kPingPong>(args, map_a, map_b, map_c, sms,
                                                                  stream);
  }
  return Launch<T, OutT, 1, kMnA, kMnB, kMode, false, kPingPong>(args, map_a, map_b, map_c, sms,
                                                                stream);
}

template <typename T, typename OutT, int kMode, bool kPingPong>
cudaError_t LaunchWithSchedule(const HopperGemmArgs& args, CUtensorMapDataType type, int sms,
                               cudaStream_t stream) {
  if (args.a_major == Major::kMN) {
    return LaunchForm<T, OutT, true, true, kMode, kPingPong>(args, type, sms, stream);
  }
  if (args.b_major == Major::kMN) {
    return LaunchForm<T, OutT, false, true, kMode, kPingPong>(args, type, sms, stream);
  }
  return LaunchForm<T, OutT, false, false, kMode, kPingPong>(args, type, sms, stream);
}

template <typename T, typename OutT, int kMode>
cudaError_t LaunchWithEpilogue(const HopperGemmArgs& args, CUtensorMapDataType type, int sms,
                               cudaStream_t stream) {
  if (args.ping_pong) return LaunchWithSchedule<T, OutT, kMode, true>(args, type, sms, stream);
  return LaunchWithSchedule<T, OutT, kMode, false>(args, type, sms, stream);
}

template <typename T, typename OutT>
cudaError_t LaunchWithOutput(const HopperGemmArgs& args, CUtensorMapDataType type, int sms,
                             cudaStream_t stream) {
  if (args.source == nullptr) return LaunchWithEpilogue<T, OutT, kStore>(args, type, sms, stream);
  // An fp32 C that is its own source, in 16-byte rows: added by the TMA.
  if (std::is_same_v<OutT, float> && args.source == args.c && args.ld_source == args.ldc &&
      RowsOf16Bytes(args.c, args.ldc, sizeof(float))) {
    return LaunchWithEpilogue<T, OutT, kReduceInPlace>(args, type, sms, stream);
  }
  return LaunchWithEpilogue<T, OutT, kAddSource>(args, type, sms, stream);
}

template <typename T>
cudaError_t LaunchFor(const HopperGemmArgs& args, CUtensorMapDataType type, int sms,
                      cudaStream_t stream) {
  if (args.out_type == DType::kFloat32) return LaunchWithOutput<T, float>(args, type, sms, stream);
  return LaunchWithOutput<T, T>(args, type, sms, stream);
}

}  // namespace

bool HopperGemmSupported(const HopperGemmArgs& args, int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      major != 9 || minor != 0) {
    return false;
  }
  const bool half = args.in_type == DType::kBFloat16 || args.in_type == DType::kFloat16;
  const bool out = args.out_type == args.in_type || args.out_type == DType::kFloat32;
  const bool form = args.a_major == Major::kK || args.b_major == Major::kMN;
  const LogitGradient& g = args.gradient;
  const bool gradient = !g.present() || (!args.ping_pong && args.a_major == Major::kK &&
                                         args.b_major == Major::kMN && g.coef != nullptr &&
                                         g.column != nullptr && g.target != nullptr);
  // A row of an operand: K long (K-major) or M / N long (MN-major).
  const auto rows_fit = [&](Major major, int64_t ld, int64_t extent) {
    return ld % 8 == 0 && ld >= (major == Major::kK ? args.k : extent) &&
           (major == Major::kMN || args.k % 8 == 0);
  };
  constexpr int64_t kMax = int64_t{1} << 31;
  return half && out && form && gradient && args.k > 0 && rows_fit(args.a_major, args.lda, args.m) &&
         rows_fit(args.b_major, args.ldb, args.n) && args.ldc >= args.n &&
         (args.source == nullptr || args.ld_source >= args.n) &&
         (args.cluster == 1 || args.cluster == 2) && args.m >= 0 && args.n >= 0 &&
         args.m < kMax && args.n < kMax && args.k < kMax &&
         reinterpret_cast<uintptr_t>(args.a) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(args.b) % 16 == 0;
}

cudaError_t LaunchHopperGemm(const HopperGemmArgs& args, int sms, cudaStream_t stream) {
  if (args.m == 0 || args.n == 0) return cudaSuccess;
  int device = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  int major = 0;
  error = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (error != cudaSuccess) return error;
  if (major != 9) return cudaErrorNotSupported;
  if (!HopperGemmSupported(args, device) || sms <= 0) return cudaErrorInvalidValue;
  if (args.in_type == DType::kBFloat16) {
    return LaunchFor<__nv_bfloat16>(args, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, sms, stream);
  }
  return LaunchFor<__half>(args, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, sms, stream);
}

}  // namespace internal_cuda
}  // namespace flce
