// Part of the FlashMemory scorer's CUDA source: the files of kernels/scorer/
// are concatenated in the order of src/kernels.rs (after kernels/common.cuh)
// and compiled by NVRTC as one unit.

// ------------------------------------------- training-free (Quest-style) scorer

// score(c) = sum_d max(q_d * min[c][d], q_d * max[c][d]); bounds f32, rows of
// `dim` floats. One warp per chunk.
extern "C" __global__ void fm_bounds_score(const float* q, const float* bmin, const float* bmax, u32 dim, u32 n,
                                           u32* skey, u32* hist, u32* err) {
    __shared__ __align__(16) u32 sh_hist[FM_HIST];
    for (u32 i = threadIdx.x; i < FM_HIST; i += blockDim.x) sh_hist[i] = 0;
    __syncthreads();
    const u32 lane = threadIdx.x & 31u;
    const u32 warps = gridDim.x * (blockDim.x >> 5);
    for (u32 c = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); c < n; c += warps) {
        const float* lo = bmin + (u64)c * dim;
        const float* hi = bmax + (u64)c * dim;
        float s = 0.f;
        bool ok = true;
        for (u32 d = lane; d < dim; d += 32) {
            ok &= lo[d] <= hi[d] && isfinite(lo[d]) && isfinite(hi[d]);  // also false for NaN
            s += fmaxf(q[d] * lo[d], q[d] * hi[d]);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(KVS_FULL_MASK, s, off);
        ok = __all_sync(KVS_FULL_MASK, ok);
        if (lane == 0) {
            if (!ok) {
                record_error(err, FM_ERR_BOUNDS, c, 0);
                s = -3.0e38f;
            } else if (!isfinite(s)) {
                record_error(err, FM_ERR_SCORE, c, 0);
                s = -3.0e38f;
            }
            const u32 k = sort_key(s);
            skey[c] = k;
            atomicAdd(&sh_hist[k >> (32 - FM_HIST_BITS)], 1u);
        }
    }
    __syncthreads();
    flush_hist(sh_hist, hist);
}
