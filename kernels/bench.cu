// Benchmark probes (`kvswap bench`), not used by the library's calls.

// Reads n 16-byte items at p once, as a streaming kernel would: every thread
// keeps four loads in flight (grid-stride), and the items are folded by XOR
// into a value written only if it equals `never` (the caller passes one no
// buffer folds to in practice), so the loads stay live and the kernel writes
// (almost) nothing: its time is the device's read rate.
extern "C" __global__ void __launch_bounds__(256) kvswap_read_probe(const uint4* __restrict__ p, unsigned long long n, u32 never, u32* out) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    u32 acc = 0;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
        acc ^= (a.x ^ a.y ^ a.z ^ a.w) ^ (b.x ^ b.y ^ b.z ^ b.w) ^ (c.x ^ c.y ^ c.z ^ c.w) ^ (d.x ^ d.y ^ d.z ^ d.w);
    }
    for (; i < n; i += stride) {
        const uint4 a = p[i];
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == never) out[blockIdx.x] = acc;
}
