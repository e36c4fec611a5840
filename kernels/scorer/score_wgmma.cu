// Part of the FlashMemory scorer's CUDA source: the files of kernels/scorer/
// are concatenated in the order of src/kernels.rs (after kernels/common.cuh)
// and compiled by NVRTC as one unit.

// ------------------------------------------ scoring with wgmma (Hopper, sm_90a)
//
// The same result as fm_score, on Hopper's warpgroup MMA: one m64nNk16
// instruction per 16 key dimensions covers 64 chunks x every (scorer, head)
// column (N = FM_SCORERS * FM_HEADS <= 256), both operands read by the tensor
// cores straight from shared memory in the 128-byte-swizzled K-major layout.
// Each warpgroup streams its own 64-chunk tiles through a WG_STAGES-deep
// cp.async ring; a thread holds whole (scorer, head) rows of its chunks, so the
// ensemble is reduced in registers (one quad shuffle) with no shared-memory
// partials. Compiled with
// -DFM_WGMMA for sm_90a when the shape allows (N a multiple of 64, head_dim a
// multiple of 64).
#if defined(FM_WGMMA)

#define WG_GROUPS 3                      // warpgroups taking turns on the tensor cores
#define WG_THREADS (128 * WG_GROUPS)
#define WG_KBLOCKS (FM_HEAD_DIM / 64)    // 128-byte K blocks per row
#define WG_Q_BYTES (FM_QROWS * FM_HEAD_DIM * 2)

// Byte offset of 16-byte chunk c (0 .. FM_CHUNKS16) of row r in a tile of
// `rows` rows, in the canonical K-major SW128 layout: one region per 64-wide
// K block; rows 128 bytes apart; 8-row atoms of 1024 bytes; chunk index XOR
// (row % 8).
__device__ __forceinline__ u32 sw128(u32 rows, u32 r, u32 c) {
    return (c >> 3) * (rows * 128u) + r * 128u + (((c & 7u) ^ (r & 7u)) << 4);
}

// GMMA shared-memory descriptor: start address, leading byte offset 16 (unused
// for swizzled K-major), stride 1024 bytes between 8-row atoms, 128B swizzle.
__device__ __forceinline__ u64 gmma_desc(u32 saddr) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The shared-memory (SS) forms: m64nNk16 on bf16 (both operands K-major,
// no transpose) and m64nNk32 on fp8 e4m3 (always K-major: no transpose
// operands), one macro per width N with the instruction's types and its
// trailing immediates (scale-a, scale-b, and for bf16 the two transposes).
#define WG_SS_N64(NAME, TYPES, TAIL) \
__device__ __forceinline__ void NAME(float* d, u64 desc_a, u64 desc_b, u32 accumulate) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n64" TYPES " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p" TAIL ";\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
}
WG_SS_N64(wgmma_n64, "k16.f32.bf16.bf16", ", 1, 1, 0, 0")

#define WG_SS_N128(NAME, TYPES, TAIL) \
__device__ __forceinline__ void NAME(float* d, u64 desc_a, u64 desc_b, u32 accumulate) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n128" TYPES " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p" TAIL ";\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
}
WG_SS_N128(wgmma_n128, "k16.f32.bf16.bf16", ", 1, 1, 0, 0")

// C: the accumulators' constraint, "+f" (read and written) or "=f" (written:
// a first k-step with scale-d 0).
#define WG_SS_N192_C(NAME, TYPES, TAIL, C) \
__device__ __forceinline__ void NAME(float* d, u64 desc_a, u64 desc_b, u32 accumulate) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n192" TYPES " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p" TAIL ";\n}\n" \
        : C(d[0]), C(d[1]), C(d[2]), C(d[3]), C(d[4]), C(d[5]), C(d[6]), C(d[7]), C(d[8]), C(d[9]), C(d[10]), C(d[11]), C(d[12]), C(d[13]), C(d[14]), C(d[15]), C(d[16]), C(d[17]), C(d[18]), C(d[19]), C(d[20]), C(d[21]), C(d[22]), C(d[23]), C(d[24]), C(d[25]), C(d[26]), C(d[27]), C(d[28]), C(d[29]), C(d[30]), C(d[31]), C(d[32]), C(d[33]), C(d[34]), C(d[35]), C(d[36]), C(d[37]), C(d[38]), C(d[39]), C(d[40]), C(d[41]), C(d[42]), C(d[43]), C(d[44]), C(d[45]), C(d[46]), C(d[47]), C(d[48]), C(d[49]), C(d[50]), C(d[51]), C(d[52]), C(d[53]), C(d[54]), C(d[55]), C(d[56]), C(d[57]), C(d[58]), C(d[59]), C(d[60]), C(d[61]), C(d[62]), C(d[63]), C(d[64]), C(d[65]), C(d[66]), C(d[67]), C(d[68]), C(d[69]), C(d[70]), C(d[71]), C(d[72]), C(d[73]), C(d[74]), C(d[75]), C(d[76]), C(d[77]), C(d[78]), C(d[79]), C(d[80]), C(d[81]), C(d[82]), C(d[83]), C(d[84]), C(d[85]), C(d[86]), C(d[87]), C(d[88]), C(d[89]), C(d[90]), C(d[91]), C(d[92]), C(d[93]), C(d[94]), C(d[95]) \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
}
#define WG_SS_N192(NAME, TYPES, TAIL) WG_SS_N192_C(NAME, TYPES, TAIL, "+f")
WG_SS_N192(wgmma_n192, "k16.f32.bf16.bf16", ", 1, 1, 0, 0")

#define WG_SS_N256(NAME, TYPES, TAIL) \
__device__ __forceinline__ void NAME(float* d, u64 desc_a, u64 desc_b, u32 accumulate) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n256" TYPES " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p" TAIL ";\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
}
WG_SS_N256(wgmma_n256, "k16.f32.bf16.bf16", ", 1, 1, 0, 0")

// WG_BY_QROWS(name): name##N for the wgmma width N = FM_QROWS (every
// (scorer, head) column of a tile in one instruction).
#if FM_QROWS == 64
#define WG_QROWS_N 64
#elif FM_QROWS == 128
#define WG_QROWS_N 128
#elif FM_QROWS == 192
#define WG_QROWS_N 192
#elif FM_QROWS == 256
#define WG_QROWS_N 256
#else
#error "FM_WGMMA needs FM_SCORERS * FM_HEADS in {64, 128, 192, 256}"
#endif
#define WG_PASTE_(a, b) a##b
#define WG_PASTE(a, b) WG_PASTE_(a, b)
#define WG_BY_QROWS(name) WG_PASTE(name, WG_QROWS_N)
__device__ __forceinline__ void wgmma_row(float* d, u64 a, u64 b, u32 acc) { WG_BY_QROWS(wgmma_n)(d, a, b, acc); }
// fp8 x fp8 (fm_score_wg_fp8q): one k32 step of 32 key bytes.
#if FM_QROWS == 64
WG_SS_N64(wgmma8_n64, "k32.f32.e4m3.e4m3", ", 1, 1")
#elif FM_QROWS == 128
WG_SS_N128(wgmma8_n128, "k32.f32.e4m3.e4m3", ", 1, 1")
#elif FM_QROWS == 192
WG_SS_N192(wgmma8_n192, "k32.f32.e4m3.e4m3", ", 1, 1")
// The first k-step of a tile (scale-d 0) with d as outputs only, so the
// accumulators are dead between a tile's epilogue and the next tile's MMAs
// (the wgmma head sums need those registers for their A operands).
WG_SS_N192_C(wgmma8_n192_z, "k32.f32.e4m3.e4m3", ", 1, 1", "=f")
#else
WG_SS_N256(wgmma8_n256, "k32.f32.e4m3.e4m3", ", 1, 1")
#endif
__device__ __forceinline__ void wgmma8_row(float* d, u64 a, u64 b, u32 acc) { WG_BY_QROWS(wgmma8_n)(d, a, b, acc); }


// A from registers (f16), B from shared memory (f16): the fp8-key kernel.
__device__ __forceinline__ void wgmma_rs_n64(float* d, const u32* a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_rs_n128(float* d, const u32* a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_rs_n192(float* d, const u32* a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_rs_n256(float* d, const u32* a, u64 desc_b, u32 accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_rs_row(float* d, const u32* a, u64 b, u32 acc) { WG_BY_QROWS(wgmma_rs_n)(d, a, b, acc); }

#define WG_STAGES 3                        // tiles in flight per warpgroup
#define WG_ROWS 64                         // chunks per warpgroup tile (one m64 wgmma row)
#define WG_SUB_BYTES (WG_ROWS * FM_HEAD_DIM * 2)   // one bf16 warpgroup tile
#define WG_RAW_BYTES (WG_ROWS * FM_HEAD_DIM)       // one fp8 warpgroup tile
#define WG_GROUP_THREADS 128
#define WG_ORDER_BAR (1 + WG_GROUPS)       // named barriers WG_ORDER_BAR + g: warpgroup g's turn on the tensor cores
// Named barrier ids: 0 = __syncthreads, 1 .. WG_GROUPS = one warpgroup, then the turns.
static_assert(WG_ORDER_BAR + WG_GROUPS <= 16, "16 hardware barriers");

// Raw fp8 tiles: row r's 16-byte chunk c sits at chunk c ^ raw_swz(r) (128-byte
// rows: conflict-free 16-byte loads of two rows x four columns per quarter warp).
__device__ __forceinline__ u32 raw_swz(u32 r) { return FM_HEAD_DIM == 128 ? (r & 7u) : 0u; }

__device__ __forceinline__ void cp_async_wait_stages() {
    asm volatile("cp.async.wait_group %0;" ::"n"(WG_STAGES - 2) : "memory");
}

// Barrier of one warpgroup (ids 1 .. WG_GROUPS; 0 is __syncthreads).
__device__ __forceinline__ void wg_barrier(u32 g) {
    asm volatile("bar.sync %0, %1;" ::"r"(g + 1), "n"(WG_GROUP_THREADS) : "memory");
}
// A turn barrier: the waiting warpgroup syncs, the one before it arrives.
__device__ __forceinline__ void turn_wait(u32 id) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(2 * WG_GROUP_THREADS) : "memory");
}
__device__ __forceinline__ void turn_pass(u32 id) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(2 * WG_GROUP_THREADS) : "memory");
}

// Byte offset of 16-byte chunk c of row r in a raw fp8 tile.
__device__ __forceinline__ u32 raw_at(u32 r, u32 c) { return r * FM_HEAD_DIM + ((c ^ raw_swz(r)) << 4); }

// The key stream's copies carry an L2 evict-first policy: every key is read
// once per call, so the stream should not push out what the call reads again
// (q, w, the histograms, and the sort keys fm_select reads after this
// kernel). H200, 262,144 chunks, one call per graph: score bf16 37.0 -> 36.4
// us (NOTES s30).
__device__ __forceinline__ void cp_async16_stream(u32 saddr, const void* g) {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(saddr), "l"(g), "l"(policy) : "memory");
}

// Starts the copy of rows [c0, c0 + WG_ROWS) of PER_ROW 16-byte chunks each
// by the 128 threads of a warpgroup (t0 = thread index in the group) into the
// tile at `dst`, chunk c of row r at dst + at(r, c), where at depends on r
// only through r * ROW_BYTES and r % 8. When whole passes of the group cover
// the rows 8k apart, thread t0 always copies the same chunk of rows
// t0 / PER_ROW + j * RSTEP, so its source steps by RSTEP rows and its
// destination by RSTEP * ROW_BYTES. Rows past n are zeroed. Commits nothing.
template <u32 PER_ROW, u32 ROW_BYTES, typename At>
__device__ __forceinline__ void wg_copy_rows(const u8* keys, u32 stride, u32 n, u32 t0, u32 c0, u8* dst, At at) {
    constexpr u32 RSTEP = WG_GROUP_THREADS / PER_ROW, ITEMS = WG_ROWS * PER_ROW / WG_GROUP_THREADS;
    if constexpr (WG_GROUP_THREADS % PER_ROW == 0 && RSTEP % 8 == 0) {
        const u32 r0 = t0 / PER_ROW, c = t0 % PER_ROW;
        const u8* src = keys + (u64)(c0 + r0) * stride + c * 16;
        const u64 step = (u64)RSTEP * stride;
        const u32 d0 = smem_addr(dst + at(r0, c));
        constexpr u32 dstep = RSTEP * ROW_BYTES;
        if (c0 + WG_ROWS <= n) {
#pragma unroll
            for (u32 j = 0; j < ITEMS; ++j) {
                cp_async16_stream(d0 + j * dstep, src);
                src += step;
            }
        } else {
            for (u32 j = 0; j < ITEMS; ++j) {
                if (c0 + r0 + j * RSTEP < n) cp_async16_stream(d0 + j * dstep, src);
                else *(uint4*)(dst + at(r0 + j * RSTEP, c)) = make_uint4(0, 0, 0, 0);
                src += step;
            }
        }
    } else {
        for (u32 t = t0; t < WG_ROWS * PER_ROW; t += WG_GROUP_THREADS) {
            const u32 r = t / PER_ROW, c = t % PER_ROW;
            u8* d = dst + at(r, c);
            if (c0 + r < n) cp_async16_stream(smem_addr(d), keys + (u64)(c0 + r) * stride + c * 16);
            else *(uint4*)d = make_uint4(0, 0, 0, 0);
        }
    }
}

// One tile's copy as one cp.async group (possibly empty, so counting stays
// uniform): bf16 rows straight into the swizzled compute layout, fp8 rows as
// raw bytes (converted before use).
__device__ __forceinline__ void wg_issue(const u8* keys, u32 stride, u32 n, u32 dtype, u32 t0, u32 c0, bool valid, u8* dst) {
    if (valid && dtype == FM_KEYS_BF16) wg_copy_rows<FM_CHUNKS16, 128>(keys, stride, n, t0, c0, dst, [](u32 r, u32 c) { return sw128(WG_ROWS, r, c); });
    else if (valid && dtype == FM_KEYS_FP8_E4M3) wg_copy_rows<FM_HEAD_DIM / 16, FM_HEAD_DIM>(keys, stride, n, t0, c0, dst, raw_at);
    cp_async_commit();
}

// fp8 raw tile (row-major) -> bf16 swizzled compute tile (exact).
__device__ void wg_convert_fp8(u32 t0, const u8* raw, u8* tile) {
    for (u32 t = t0; t < WG_ROWS * FM_CHUNKS16; t += WG_GROUP_THREADS) {
        const u32 r = t / FM_CHUNKS16, c = t % FM_CHUNKS16;
        const uint2 v = *(const uint2*)(raw + raw_at(r, c >> 1) + (c & 1u) * 8);
        const u32 w[2] = {v.x, v.y};
        u32 o[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = fp8x2_to_bf16x2(w[i / 2] >> (16 * (i % 2)));
        *(uint4*)(tile + sw128(WG_ROWS, r, c)) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

__device__ void wg_stage_f32(const u8* keys, u32 stride, u32 n, u32 t0, u32 c0, u8* tile) {
    for (u32 t = t0; t < WG_ROWS * FM_CHUNKS16; t += WG_GROUP_THREADS) {
        const u32 r = t / FM_CHUNKS16, c = t % FM_CHUNKS16;
        uint4 out = make_uint4(0, 0, 0, 0);
        if (c0 + r < n) out = f32x8_to_bf16x8((const float*)(keys + (u64)(c0 + r) * stride) + c * 8);
        *(uint4*)(tile + sw128(WG_ROWS, r, c)) = out;
    }
}

// The tiles of warpgroup g of this block: WG_GROUPS * blockIdx.x + g, then
// every WG_GROUPS * gridDim.x (`step`); counts never grow with g and differ
// by at most 1. After its turn i, a warpgroup passes the turn on only while
// i < next_turns, so no barrier is left half-arrived.
struct WgTiles {
    u32 step, first, mine, next, next_turns, first_turns;
};
template <u32 G>  // warpgroups per block
__device__ __forceinline__ WgTiles wg_tiles_of(u32 n, u32 g) {
    const u32 tiles = (n + WG_ROWS - 1) / WG_ROWS;
    const u32 step = G * gridDim.x;
    auto count = [&](u32 h) -> u32 {
        const u32 f = G * blockIdx.x + h;
        return f < tiles ? (tiles - f + step - 1) / step : 0u;
    };
    WgTiles t;
    t.step = step;
    t.first = G * blockIdx.x + g;
    t.mine = count(g);
    t.next = g + 1 < G ? g + 1 : 0u;
    t.first_turns = count(0);
    t.next_turns = g + 1 < G ? count(t.next) : (t.first_turns > 0 ? t.first_turns - 1 : 0u);
    return t;
}
__device__ __forceinline__ WgTiles wg_tiles(u32 n, u32 g) { return wg_tiles_of<WG_GROUPS>(n, g); }

// A row's sum over the quad holding it (lanes 4r .. 4r + 3).
__device__ __forceinline__ float quad_sum(float si) {
    si += __shfl_xor_sync(KVS_FULL_MASK, si, 1);
    return si + __shfl_xor_sync(KVS_FULL_MASK, si, 2);
}
// Scorer sc's score folded into the ensemble `ens` (max or mean).
__device__ __forceinline__ void ensemble_fold(float si, u32 sc, bool mean, float& ens, bool& finite) {
    finite &= isfinite(si);
    ens = mean ? ens + si : (sc == 0 ? si : fmaxf(ens, si));
}

// Stores sort key k at p where `pred` holds (a predicated store, no branch
// around it), evict-last: fm_select reads every sort key right after the
// scoring kernel (H200, full bf16 at 262,144 chunks: 84.2 -> 83.7 us, NOTES
// s30), and reads them evict-first, which ends the priority.
__device__ __forceinline__ void store_sort_key(u32* p, u32 k, bool pred) {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %3, 0;\n@p st.global.L2::cache_hint.u32 [%0], %1, %2;\n}\n" ::"l"(p), "r"(k), "l"(policy),
                 "r"(pred ? 1u : 0u)
                 : "memory");
}

// Files the two rows every lane of a quad holds the scores of (ens[h],
// finite[h] of chunk[h]): lane 0 of the quad row 0 and lane 1 row 1, in one
// store and one shared atomic for the warp with no branch around them; lanes
// 2 and 3, and rows past n, add to a spare word of their lane index instead
// of a bin (one per lane of the instruction: no conflict within it). With
// `report`, a filing lane records a non-finite score of its row in `bad`
// (enough where a non-finite d fills the whole row, as fp8 products do).
__device__ __forceinline__ void file_rows_per_lane(const float* ens, const bool* finite, const u32* chunk, u32 n, const ScoreSeq& S, u32* sh_hist,
                                                   u32* sh_spare, bool report, bool& bad, u32& bad_chunk) {
    const u32 lane = threadIdx.x & 31u;
    const bool h = (lane & 1u) != 0;
    const u32 c = h ? chunk[1] : chunk[0];  // selects: an indexed array would go to local memory
    const bool in = (lane & 2u) == 0 && c < n;
    const float e = h ? ens[1] : ens[0];
    const bool ok = (h ? finite[1] : finite[0]) && isfinite(e);
    if (report && !ok && in) {
        bad = true;
        bad_chunk = c;
    }
    const u32 k = sort_key(ok ? e : -3.0e38f);
    store_sort_key(S.skey + c, k, in);
    atomicAdd(in ? &sh_hist[k >> (32 - FM_HIST_BITS)] : &sh_spare[lane], 1u);
}

// Files a row's score: its sortable key (the lowest score after an error)
// and its histogram count; one lane of the quad writes.
__device__ __forceinline__ void wg_file_score(float ens, bool finite, bool in, u32 chunk, bool filer, const ScoreSeq& S, u32* sh_hist,
                                              bool& bad, u32& bad_chunk) {
    // The ensemble too: a mean of finite scorer scores can overflow f32 (as
    // fm_score checks).
    if ((!finite || !isfinite(ens)) && in) {
        bad = true;
        bad_chunk = chunk;
        ens = -3.0e38f;
    }
    const u32 k = sort_key(ens);
    if (filer && in) {  // one lane per row: a plain shared atomic beats match_any
        store_sort_key(S.skey + chunk, k, true);
        atomicAdd(&sh_hist[k >> (32 - FM_HIST_BITS)], 1u);
    }
}

// The ensemble scores of ROWS of this thread's two rows (half0, half0 + 1):
// per scorer, sum_h w[h] * relu(x(r, acc)) over the row's accumulators, in
// four independent chains (n-tiles j mod 4, to hide the FMA latency), summed
// over the quad holding the row, post(r, scorer, sum), folded into ens[r] (max or
// mean). weight(j) gives the weights of n-tile j's two columns, loaded once
// for all rows. finite[r] comes in set by the caller and turns false when a
// scorer's score is not finite.
template <u32 ROWS, typename Weight, typename X, typename Post>
__device__ __forceinline__ void head_sums(const float* d, u32 half0, Weight weight, X x, Post post, bool mean, float* ens, bool* finite) {
#pragma unroll
    for (u32 r = 0; r < ROWS; ++r) ens[r] = 0.f;
#pragma unroll
    for (u32 sc = 0; sc < FM_SCORERS; ++sc) {
        float part[ROWS][4];
#pragma unroll
        for (u32 r = 0; r < ROWS; ++r) part[r][0] = part[r][1] = part[r][2] = part[r][3] = 0.f;
#pragma unroll
        for (u32 j = sc * (FM_HEADS / 8); j < (sc + 1) * (FM_HEADS / 8); ++j) {
            const float2 w2 = weight(j);
#pragma unroll
            for (u32 r = 0; r < ROWS; ++r) {
                part[r][j & 3u] = fmaf(w2.x, fmaxf(x(r, d[4 * j + 2 * (half0 + r)]), 0.f), part[r][j & 3u]);
                part[r][j & 3u] = fmaf(w2.y, fmaxf(x(r, d[4 * j + 2 * (half0 + r) + 1]), 0.f), part[r][j & 3u]);
            }
        }
#pragma unroll
        for (u32 r = 0; r < ROWS; ++r)
            ensemble_fold(post(r, sc, quad_sum((part[r][0] + part[r][1]) + (part[r][2] + part[r][3]))), sc, mean, ens[r], finite[r]);
    }
#pragma unroll
    for (u32 r = 0; r < ROWS; ++r)
        if (mean) ens[r] *= 1.f / FM_SCORERS;
}
__device__ __forceinline__ float no_post(u32, u32, float s) { return s; }

// The ensemble scores of this thread's two rows (halves 0 and 1) from their
// accumulators, unscaled keys (bf16, f32): x = q . key. `finite` turns false
// for a non-finite key (every column of its row is then non-finite, so one
// column is checked) or a dot product overflowing to +inf (it reaches the
// scorer's sum); -inf overflow is clamped by the relu as in exact
// arithmetic. relu(NaN) is not needed: a NaN column means a non-finite key.
// Two instructions per accumulator; both rows in one pass of head_sums.
__device__ __forceinline__ void wg_rows_score(const float* d, const float (*wv)[2], bool mean, float* ens, bool* finite) {
#pragma unroll
    for (u32 half = 0; half < 2; ++half) finite[half] = isfinite(d[2 * half]);
    head_sums<2>(
        d, 0, [&](u32 j) { return make_float2(wv[j][0], wv[j][1]); }, [&](u32, float a) { return a; }, no_post, mean, ens, finite);
}

// One row (`half`) of fp8 keys converted to bf16 (fm_score_wg; see there),
// checked as wg_rows_score, and a non-finite scale too. The scale split as
// scale_split_raw: a head's scale * (q . key) may lie above the float range
// where the weighted score does not, and a head sum before a scale below 1
// too.
__device__ __forceinline__ float wg_row_score_scaled(const float* d, u32 half, const float (*wv)[2], float scale, bool mean, bool& finite) {
    finite = isfinite(d[2 * half]) && isfinite(scale);
    const float2 f = scale_split_raw(scale);
    float ens;
    head_sums<1>(
        d, half, [&](u32 j) { return make_float2(wv[j][0], wv[j][1]); }, [&](u32, float a) { return a * f.x; },
        [&](u32, u32, float si) { return si * f.y; }, mean, &ens, &finite);
    return ens;
}

// The end of a wgmma scoring kernel's loop, before its histogram flush: the
// copies drained, a non-finite score recorded (the first chunk this thread
// saw), the next kernel let in, and every thread's histogram counts in.
__device__ __forceinline__ void wg_scores_done(const ScoreBatch& B, u32* err, bool bad, u32 bad_chunk) {
    cp_async_wait_all();
    if (bad) record_error(err, FM_ERR_SCORE, bad_chunk, B.id[blockIdx.y]);
    allow_dependents();
    __syncthreads();
}

// The wgmma scoring kernels' dynamic shared memory (one declaration for all
// of them: a block-scope one per kernel conflicts in linkage between the
// templates and the extern "C" kernels).
extern __shared__ u8 wg_smem_raw[];

// Grid: (blocks per sequence, sequences), WG_GROUPS warpgroups (WG_THREADS
// threads), dynamic shared memory: Q + per warpgroup a ring of WG_STAGES
// tiles (bf16: compute tiles; fp8: raw tiles plus one compute tile; f32: one
// compute tile) + 1024 alignment slack. The warpgroups run independent
// pipelines over interleaved 64-chunk tiles and take turns on the tensor
// cores in a fixed cycle 0, 1, .., WG_GROUPS - 1 (named barriers): one issues
// its MMAs right after the one before it, so the others' epilogues overlap
// the MMAs.
//
// Two entry points: fm_score_wg_bf16 for bf16 keys (the dtype a constant:
// none of the other dtypes' staging and branches) and fm_score_wg for f32
// and converted fp8 keys (KVSWAP_FM_KERNEL=wgmma-convert, or shapes without
// fm_score_wg_fp8: head_dim other than 64 and 128, or too little shared
// memory for its extras). H200, 262,144 chunks, score bf16: 36.3 -> 35.0
// us for the bf16 entry alone (NOTES s31).
#define FM_WG_ANY_DTYPE 0xFFFFFFFFu
template <u32 DTYPE>
__device__ __forceinline__ void score_wg(const ScoreBatch& B, u32* err) {
    __shared__ __align__(16) u32 sh_hist[FM_HIST];
    __shared__ u32 sh_spare[32];  // file_rows_per_lane's spare words, one per lane
    // The swizzled layouts need 1024-byte aligned regions.
    const u32 raw_addr = smem_addr(wg_smem_raw);
    u8* base = wg_smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
    u8* sh_q = base;
    const u32 dtype = DTYPE == FM_WG_ANY_DTYPE ? B.dtype : DTYPE;
    const bool mean = B.mean != 0;
    const u32 slot_bytes = dtype == FM_KEYS_BF16 ? WG_SUB_BYTES : WG_RAW_BYTES;
    const u32 group_bytes = dtype == FM_KEYS_BF16 ? WG_STAGES * WG_SUB_BYTES : WG_STAGES * WG_RAW_BYTES + WG_SUB_BYTES;
    const ScoreSeq& S = B.seq[blockIdx.y];
    const u8* keys = (const u8*)S.keys;
    const u32 n = S.n, stride = S.stride;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    // This warpgroup, through a shuffle from lane 0: the compiler then knows
    // it is warp-uniform, and the ring addresses, barrier ids and MMA
    // descriptors derived from it live in the uniform datapath (46 -> 17
    // instructions between the turn barrier and the first MMA; score bf16
    // 36.5 -> 35.8 us, NOTES s31).
    const u32 g = __shfl_sync(KVS_FULL_MASK, warp >> 2, 0);
    const u32 t0 = threadIdx.x & (WG_GROUP_THREADS - 1u);
    u8* ring = base + WG_Q_BYTES + g * group_bytes;
    u8* conv = ring + WG_STAGES * WG_RAW_BYTES;    // fp8 / f32 compute tile

    const WgTiles T = wg_tiles(n, g);
    const u32 step = T.step, first = T.first, my_tiles = T.mine, next = T.next, next_turns = T.next_turns;
    // The first key tiles are loaded before waiting for the projection: keys
    // are inputs of the call (ready before the projection started), q and w
    // are its outputs.
    // bf16 keys issue tile 0, wait, copy Q, then issue tile 1, and the
    // prologue waits for tile 0 and Q only (tile 1 stays in flight into the
    // loop): H200, 262,144 chunks, score bf16 34.9 -> 34.1 us (NOTES s31 run
    // 6, `FM_PRO1`). The other dtypes issue both tiles first and wait for all.
    constexpr bool LATE_TILE1 = DTYPE == FM_KEYS_BF16;
    if (dtype != FM_KEYS_F32) {
        for (u32 i = 0; i < (LATE_TILE1 ? 1u : WG_STAGES - 1); ++i)
            wg_issue(keys, stride, n, dtype, t0, (first + i * step) * WG_ROWS, i < my_tiles, ring + i * slot_bytes);
    }
    wait_prerequisites();
    for (u32 t = threadIdx.x; t < FM_QROWS * FM_CHUNKS16; t += WG_THREADS) {
        const u32 r = t / FM_CHUNKS16, c = t % FM_CHUNKS16;
        cp_async16(smem_addr(sh_q + sw128(FM_QROWS, r, c)), S.q + (u64)r * FM_HEAD_DIM + c * 8);
    }
    cp_async_commit();
    if constexpr (LATE_TILE1) {
        static_assert(WG_STAGES == 3, "the bf16 prologue issues tiles 0 and 1");
        wg_issue(keys, stride, n, dtype, t0, (first + step) * WG_ROWS, 1 < my_tiles, ring + slot_bytes);
    }
    for (u32 i = threadIdx.x; i < FM_HIST; i += WG_THREADS) sh_hist[i] = 0;
    // Head weights of this thread's columns: n-tile j, columns 2*(lane%4)+{0,1}.
    float wv[FM_QROWS / 8][2];
#pragma unroll
    for (u32 j = 0; j < FM_QROWS / 8; ++j) {
        wv[j][0] = S.w[j * 8 + 2 * (lane & 3u)];
        wv[j][1] = S.w[j * 8 + 2 * (lane & 3u) + 1];
    }
    // Q and the first tiles (bf16: Q and tile 0; tile 1 is the one group
    // left in flight, waited for by the loop's first wait).
    if constexpr (LATE_TILE1) asm volatile("cp.async.wait_group 1;" ::: "memory");
    else cp_async_wait_all();
    fence_async_smem();
    __syncthreads();  // Q and the histogram are ready for every warpgroup
    bool bad = false;
    u32 bad_chunk = 0;
    const u64 db0 = gmma_desc(smem_addr(sh_q));
    if (g == WG_GROUPS - 1 && T.first_turns > 0) turn_pass(WG_ORDER_BAR);  // warpgroup 0 goes first
    for (u32 i = 0; i < my_tiles; ++i) {
        const u32 c0 = (first + i * step) * WG_ROWS;
        u8* slot = ring + (i % WG_STAGES) * slot_bytes;
        if (dtype != FM_KEYS_F32) cp_async_wait_stages();  // tile i has landed (this thread's part)
        wg_barrier(g);  // ... every thread's part; tile i - 1 is consumed
        if (dtype != FM_KEYS_F32) {
            const u32 ahead = i + WG_STAGES - 1;
            wg_issue(keys, stride, n, dtype, t0, (first + ahead * step) * WG_ROWS, ahead < my_tiles, ring + (ahead % WG_STAGES) * slot_bytes);
        }
        u8* cur_a = slot;
        if (dtype == FM_KEYS_FP8_E4M3) {
            wg_convert_fp8(t0, slot, conv);
            cur_a = conv;
        } else if (dtype == FM_KEYS_F32) {
            wg_stage_f32(keys, stride, n, t0, c0, conv);
            cur_a = conv;
        }
        fence_async_smem();  // generic-proxy writes (cp.async, stores) -> tensor-core reads
        wg_barrier(g);
        // Our turn: the warpgroup before us has issued its MMAs. (No branch
        // around the MMAs: ptxas would serialise them.)
        turn_wait(WG_ORDER_BAR + g);
        float d[FM_QROWS / 2];
#pragma unroll
        for (u32 k = 0; k < FM_QROWS / 2; ++k) d[k] = 0.f;
        // Descriptors of k-step ks: the base descriptor plus the step's byte
        // offset / 16 (the address field is in 16-byte units and the offsets
        // stay inside the 256 KiB window it covers).
        const u64 da0 = gmma_desc(smem_addr(cur_a));
        wgmma_fence();
#pragma unroll
        for (u32 ks = 0; ks < FM_KSTEPS; ++ks) {
            const u32 kb = ks >> 2, within = (ks & 3u) * 32u;
            const u64 da = da0 + ((kb * (WG_ROWS * 128u) + within) >> 4);
            const u64 db = db0 + ((kb * (FM_QROWS * 128u) + within) >> 4);
            wgmma_row(d, da, db, ks > 0 ? 1u : 0u);
        }
        wgmma_commit();
        // The next warpgroup's turn (the last one gave warpgroup 0 its first
        // before the loop).
        if (i < next_turns) turn_pass(WG_ORDER_BAR + next);
        wgmma_wait0();

        // Epilogue: this thread's rows are r and r + 8 of its warp's 16.
        // Unscaled keys (bf16, f32) score both rows in one pass: eight
        // independent sum chains and both rows' quad shuffles in flight
        // together, the same operations per row (score bf16 36.5 -> 35.9 us,
        // NOTES s31); converted fp8 keys scale per row.
        const u32 row0 = (warp & 3u) * 16 + (lane >> 2);
        if (dtype != FM_KEYS_FP8_E4M3) {
            float ens[2];
            bool finite[2];
            wg_rows_score(d, wv, mean, ens, finite);
            // Every lane checks both rows (a 16-bit dot product can overflow
            // in one column of a row, and a lane sees its own columns of d),
            // then one filing per lane, as the fp8-query kernel files: lane 0
            // of the quad files row r, lane 1 row r + 8, with one predicated
            // store and one shared atomic, no branch (H200, 262,144 chunks,
            // score bf16 34.2-34.5 -> 33.4-33.9 us, NOTES s45).
            const u32 chunks[2] = {c0 + row0, c0 + row0 + 8};
#pragma unroll
            for (u32 half = 0; half < 2; ++half) {
                if ((!finite[half] || !isfinite(ens[half])) && chunks[half] < n) {
                    bad = true;
                    bad_chunk = chunks[half];
                }
            }
            file_rows_per_lane(ens, finite, chunks, n, S, sh_hist, sh_spare, false, bad, bad_chunk);
        } else {
#pragma unroll
            for (u32 half = 0; half < 2; ++half) {
                const u32 chunk = c0 + row0 + half * 8;
                const bool in = chunk < n;
                bool finite;
                const float ens = wg_row_score_scaled(d, half, wv, in ? S.scales[chunk] : 1.f, mean, finite);
                wg_file_score(ens, finite, in, chunk, (lane & 3u) == 0, S, sh_hist, bad, bad_chunk);
            }
        }
    }
    wg_scores_done(B, err, bad, bad_chunk);
    flush_hist(sh_hist, S.hist);
}
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) fm_score_wg_bf16(ScoreBatch B, u32* err) { score_wg<FM_KEYS_BF16>(B, err); }
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) fm_score_wg(ScoreBatch B, u32* err) { score_wg<FM_WG_ANY_DTYPE>(B, err); }

#endif  // FM_WGMMA
