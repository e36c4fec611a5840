// Shared by every kernel file (prepended to each source before NVRTC
// compiles it; see src/kernels.rs): types, the block-wide scan, the error
// record, and programmatic dependent launch.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef unsigned short u16;
typedef unsigned char u8;

#define KVS_FULL_MASK 0xFFFFFFFFu

// Records the first error of a launch sequence: code, then two words of
// context (position, id). Later errors leave it unchanged.
__device__ __forceinline__ void record_error(u32* err, u32 code, u32 pos, u32 id) {
    if (atomicCAS(&err[0], 0u, code) == 0u) {
        err[1] = pos;
        err[2] = id;
    }
}
// As record_error, with a third detail word (err[3]).
__device__ __forceinline__ void record_error3(u32* err, u32 code, u32 pos, u32 id, u32 extra) {
    if (atomicCAS(&err[0], 0u, code) == 0u) {
        err[1] = pos;
        err[2] = id;
        err[3] = extra;
    }
}

// Inclusive prefix sum of one value per lane over a whole warp.
__device__ __forceinline__ u32 warp_inclusive_sum(u32 x) {
    const u32 lane = threadIdx.x & 31u;
#pragma unroll
    for (u32 off = 1; off < 32; off <<= 1) {
        const u32 y = __shfl_up_sync(KVS_FULL_MASK, x, off);
        if (lane >= off) x += y;
    }
    return x;
}

// Exclusive prefix sum of one value per thread over the block; *total gets the
// sum. Every thread of the block must call it.
__device__ u32 block_exclusive_sum(u32 v, u32* total) {
    __shared__ u32 warp_sums[32];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 nwarps = (blockDim.x + 31u) >> 5;
    const u32 x = warp_inclusive_sum(v);
    if (lane == 31u) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) warp_sums[lane] = warp_inclusive_sum(lane < nwarps ? warp_sums[lane] : 0u);
    __syncthreads();
    const u32 base = warp > 0 ? warp_sums[warp - 1] : 0u;
    *total = warp_sums[nwarps - 1];
    __syncthreads();
    return base + x - v;
}

// Lets the next kernel in the stream (launched with programmatic stream
// serialization) start its blocks now; they wait in griddepcontrol.wait
// (wait_prerequisites) until this grid has completed. No-ops before Hopper.
__device__ __forceinline__ void allow_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_prerequisites() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
