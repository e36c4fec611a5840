#!/usr/bin/env python3
"""Does a driver call made in relaxed capture mode beside another stream's
global-mode capture invalidate that capture? (kvswap makes its waits,
allocations, loads and launches on other streams that way.) Plain driver API
through ctypes, no kvswap: prints cuStreamEndCapture's result for each kind
of call, on the capturing thread and on another. Run it plainly and under
compute-sanitizer (GPU machine):

  python3 .ci/capture-probe.py
  compute-sanitizer --tool memcheck python3 .ci/capture-probe.py

H200, driver 580 (benches/NOTES.md s43): every case ends its capture intact
when run plainly; under memcheck a kernel launched on the other stream
invalidates it (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED), so the GPU tests
that launch beside a global capture are skipped under the sanitizer
(.ci/gpu-run.sh sanitize)."""
import ctypes, threading, sys
cu = ctypes.CDLL("libcuda.so.1")
def ok(r, what):
    if r != 0:
        s = ctypes.c_char_p(); cu.cuGetErrorName(r, ctypes.byref(s)); print(f"  {what}: {s.value.decode()}"); return False
    return True
assert ok(cu.cuInit(0), "init")
dev = ctypes.c_int(); cu.cuDeviceGet(ctypes.byref(dev), 0)
ctx = ctypes.c_void_p(); cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev); cu.cuCtxSetCurrent(ctx)
def stream():
    s = ctypes.c_void_p(); ok(cu.cuStreamCreate(ctypes.byref(s), 1), "stream"); return s
a, b = stream(), stream()
GLOBAL, RELAXED = 0, 2
def relaxed(f):
    m = ctypes.c_int(RELAXED); cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(m))
    try: return f()
    finally: cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(m))
def alloc_free():
    p = ctypes.c_uint64(); ok(cu.cuMemAlloc_v2(ctypes.byref(p), 1 << 20), "alloc"); ok(cu.cuMemFree_v2(p), "free")
def sync_b():
    ok(cu.cuStreamSynchronize(b), "sync b")
def memset_b():
    p = ctypes.c_uint64(); ok(cu.cuMemAlloc_v2(ctypes.byref(p), 64), "alloc"); ok(cu.cuMemsetD8Async(p, 0, 64, b), "memset b"); ok(cu.cuStreamSynchronize(b), "sync b"); ok(cu.cuMemFree_v2(p), "free")
def dtoh_b():
    p = ctypes.c_uint64(); ok(cu.cuMemAlloc_v2(ctypes.byref(p), 64), "alloc"); h = (ctypes.c_char * 64)(); ok(cu.cuMemcpyDtoHAsync_v2(h, p, 64, b), "dtoh b"); ok(cu.cuStreamSynchronize(b), "sync b"); ok(cu.cuMemFree_v2(p), "free")
PTX = b'''.version 8.0
.target sm_90
.address_size 64
.visible .entry k(.param .u64 p) { .reg .b64 %rd<2>; .reg .b32 %r<2>; ld.param.u64 %rd1, [p]; mov.u32 %r1, 7; st.global.u32 [%rd1], %r1; ret; }
'''
def module_load():
    m = ctypes.c_void_p(); ok(cu.cuModuleLoadData(ctypes.byref(m), PTX), "module load"); ok(cu.cuModuleUnload(m), "unload")
def launch_b():
    m = ctypes.c_void_p(); ok(cu.cuModuleLoadData(ctypes.byref(m), PTX), "module load")
    f = ctypes.c_void_p(); ok(cu.cuModuleGetFunction(ctypes.byref(f), m, b"k"), "getfn")
    p = ctypes.c_uint64(); ok(cu.cuMemAlloc_v2(ctypes.byref(p), 64), "alloc")
    arg = ctypes.c_uint64(p.value); params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(arg), ctypes.c_void_p))
    ok(cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, b, params, None), "launch b"); ok(cu.cuStreamSynchronize(b), "sync b")
    ok(cu.cuMemFree_v2(p), "free"); ok(cu.cuModuleUnload(m), "unload")
def events_b():
    e = ctypes.c_void_p(); ok(cu.cuEventCreate(ctypes.byref(e), 2), "event create")
    ok(cu.cuEventRecord(e, b), "record b"); ok(cu.cuEventSynchronize(e), "event sync"); ok(cu.cuStreamWaitEvent(b, e, 0), "wait event"); ok(cu.cuEventDestroy_v2(e), "event destroy")
def stream_cd():
    s = ctypes.c_void_p(); ok(cu.cuStreamCreate(ctypes.byref(s), 1), "stream create"); ok(cu.cuStreamDestroy_v2(s), "stream destroy")
def host_alloc():
    h = ctypes.c_void_p(); ok(cu.cuMemHostAlloc(ctypes.byref(h), 1 << 20, 3), "host alloc"); ok(cu.cuMemFreeHost(h), "free host")
def retain():
    c = ctypes.c_void_p(); ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev), "retain"); ok(cu.cuDevicePrimaryCtxRelease_v2(dev), "release")
def case(name, body, other_thread=False):
    x = ctypes.c_uint64(); ok(cu.cuMemAlloc_v2(ctypes.byref(x), 64), "x")
    ok(cu.cuStreamBeginCapture_v2(a, GLOBAL), "begin")
    ok(cu.cuMemsetD8Async(x, 1, 64, a), "captured memset")
    if other_thread:
        t = threading.Thread(target=lambda: (cu.cuCtxSetCurrent(ctx), relaxed(body))); t.start(); t.join()
    else:
        relaxed(body)
    g = ctypes.c_void_p(); r = cu.cuStreamEndCapture(a, ctypes.byref(g))
    print(f"{name:40s} end capture: {'ok' if r == 0 else r}", flush=True)
    if r == 0: cu.cuGraphDestroy(g)
    cu.cuStreamSynchronize(a); cu.cuMemFree_v2(x)
for ot in (False, True):
    w = " (other thread)" if ot else ""
    case("nothing" + w, lambda: None, ot)
    case("alloc+free" + w, alloc_free, ot)
    case("sync stream b" + w, sync_b, ot)
    case("memset b + sync" + w, memset_b, ot)
    case("dtoh b + sync" + w, dtoh_b, ot)
    case("module load+unload" + w, module_load, ot)
    case("launch on b + sync" + w, launch_b, ot)
    case("event record/sync/wait" + w, events_b, ot)
    case("stream create/destroy" + w, stream_cd, ot)
    case("pinned host alloc/free" + w, host_alloc, ot)
    case("primary ctx retain/release" + w, retain, ot)
