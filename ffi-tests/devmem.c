/*
 * devmem: see devmem.h. C11; the CUDA driver is loaded with dlopen, so this
 * file needs no CUDA header or library to build: the few driver types and
 * prototypes it uses are declared below, with the exported symbol names
 * (the _v2 names are what cuda.h maps the plain names to).
 */
#define _POSIX_C_SOURCE 200809L

#include "devmem.h"

#include "kvswap.h"

#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the CUDA driver API, as much as the tests need ---- */

typedef int CUresult; /* CUDA_SUCCESS == 0 */
typedef unsigned long long CUdeviceptr;
typedef void *CUstream;
typedef void *CUcontext;
typedef int CUdevice;

#define DM_CU_STREAM_NON_BLOCKING 0x1u

typedef CUresult (*PFN_cuInit)(unsigned int flags);
typedef CUresult (*PFN_cuDeviceGet)(CUdevice *device, int ordinal);
typedef CUresult (*PFN_cuDevicePrimaryCtxRetain)(CUcontext *pctx, CUdevice dev);
typedef CUresult (*PFN_cuDevicePrimaryCtxRelease)(CUdevice dev);
typedef CUresult (*PFN_cuCtxSetCurrent)(CUcontext ctx);
typedef CUresult (*PFN_cuCtxSynchronize)(void);
typedef CUresult (*PFN_cuMemAlloc)(CUdeviceptr *dptr, size_t bytesize);
typedef CUresult (*PFN_cuMemFree)(CUdeviceptr dptr);
typedef CUresult (*PFN_cuMemcpyHtoDAsync)(CUdeviceptr dst, const void *src, size_t bytes, CUstream s);
typedef CUresult (*PFN_cuMemcpyDtoHAsync)(void *dst, CUdeviceptr src, size_t bytes, CUstream s);
typedef CUresult (*PFN_cuMemsetD8Async)(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s);
typedef CUresult (*PFN_cuStreamCreate)(CUstream *ps, unsigned int flags);
typedef CUresult (*PFN_cuStreamSynchronize)(CUstream s);
typedef CUresult (*PFN_cuStreamDestroy)(CUstream s);
typedef CUresult (*PFN_cuGetErrorName)(CUresult error, const char **pstr);

static struct {
    PFN_cuInit Init;
    PFN_cuDeviceGet DeviceGet;
    PFN_cuDevicePrimaryCtxRetain DevicePrimaryCtxRetain;
    PFN_cuDevicePrimaryCtxRelease DevicePrimaryCtxRelease;
    PFN_cuCtxSetCurrent CtxSetCurrent;
    PFN_cuCtxSynchronize CtxSynchronize;
    PFN_cuMemAlloc MemAlloc;
    PFN_cuMemFree MemFree;
    PFN_cuMemcpyHtoDAsync MemcpyHtoDAsync;
    PFN_cuMemcpyDtoHAsync MemcpyDtoHAsync;
    PFN_cuMemsetD8Async MemsetD8Async;
    PFN_cuStreamCreate StreamCreate;
    PFN_cuStreamSynchronize StreamSynchronize;
    PFN_cuStreamDestroy StreamDestroy;
    PFN_cuGetErrorName GetErrorName;
} cu;

#define LIBCUDA "libcuda.so.1"

/* ---- state ---- */

enum { DM_UNSET = 0, DM_CPU = 1, DM_CUDA = 2 };
static int g_backend = DM_UNSET;
static void *g_lib;          /* dlopen handle of libcuda */
static CUdevice g_dev;       /* device 0 */
static CUcontext g_ctx;      /* its primary context */
static CUstream g_stream;    /* the main stream (CUDA) */
static atomic_long g_live;   /* dm_alloc'd buffers not yet freed */
static _Thread_local int tl_bound; /* g_ctx is current on this thread */

static void die(const char *what) {
    fprintf(stderr, "devmem: %s\n", what);
    fflush(stderr);
    exit(1);
}

static void need_init(const char *fn) {
    if (g_backend == DM_UNSET) {
        fprintf(stderr, "devmem: %s called before dm_init()\n", fn);
        exit(1);
    }
}

static void cu_check(CUresult r, const char *call, int line) {
    if (r == 0) return;
    const char *name = NULL;
    if (cu.GetErrorName == NULL || cu.GetErrorName(r, &name) != 0 || name == NULL) name = "unknown CUresult";
    fprintf(stderr, "devmem.c:%d: %s failed: %s (CUresult %d)\n", line, call, name, r);
    fflush(stderr);
    exit(1);
}
#define CU(call) cu_check((call), #call, __LINE__)

/* Makes the primary context current on the calling thread (once per thread;
 * kvswap pushes and pops its own binding, which leaves ours in place). */
static void bind_ctx(void) {
    if (!tl_bound) {
        CU(cu.CtxSetCurrent(g_ctx));
        tl_bound = 1;
    }
}

static CUdeviceptr dptr(const void *p) { return (CUdeviceptr)(uintptr_t)p; }

/* ---- set-up ---- */

static void load_symbol(void *fn_ptr_out, const char *name) {
    dlerror();
    void *sym = dlsym(g_lib, name);
    if (sym == NULL) {
        const char *e = dlerror();
        fprintf(stderr, "devmem: %s has no symbol %s (%s): driver too old?\n", LIBCUDA, name, e ? e : "NULL");
        exit(1);
    }
    /* A data pointer to a function pointer, without type punning. */
    memcpy(fn_ptr_out, &sym, sizeof sym);
}

static void cuda_init(void) {
    g_lib = dlopen(LIBCUDA, RTLD_NOW | RTLD_LOCAL);
    if (g_lib == NULL) {
        const char *e = dlerror();
        fprintf(stderr,
                "devmem: KVSWAP_TEST_BACKEND=cuda, but cannot load %s (%s).\n"
                "devmem: the CUDA run needs the NVIDIA driver; unset KVSWAP_TEST_BACKEND (or set it to cpu) "
                "for the CPU run.\n",
                LIBCUDA, e ? e : "no reason given");
        fflush(stderr);
        exit(1);
    }
    load_symbol(&cu.GetErrorName, "cuGetErrorName");
    load_symbol(&cu.Init, "cuInit");
    load_symbol(&cu.DeviceGet, "cuDeviceGet");
    load_symbol(&cu.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    load_symbol(&cu.DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    load_symbol(&cu.CtxSetCurrent, "cuCtxSetCurrent");
    load_symbol(&cu.CtxSynchronize, "cuCtxSynchronize");
    load_symbol(&cu.MemAlloc, "cuMemAlloc_v2");
    load_symbol(&cu.MemFree, "cuMemFree_v2");
    load_symbol(&cu.MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    load_symbol(&cu.MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    load_symbol(&cu.MemsetD8Async, "cuMemsetD8Async");
    load_symbol(&cu.StreamCreate, "cuStreamCreate");
    load_symbol(&cu.StreamSynchronize, "cuStreamSynchronize");
    load_symbol(&cu.StreamDestroy, "cuStreamDestroy_v2");

    CU(cu.Init(0));
    CU(cu.DeviceGet(&g_dev, 0));
    CU(cu.DevicePrimaryCtxRetain(&g_ctx, g_dev));
    CU(cu.CtxSetCurrent(g_ctx));
    tl_bound = 1;
    CU(cu.StreamCreate(&g_stream, DM_CU_STREAM_NON_BLOCKING));
}

void dm_init(void) {
    if (g_backend != DM_UNSET) return;
    const char *b = getenv("KVSWAP_TEST_BACKEND");
    if (b == NULL || b[0] == 0 || strcmp(b, "cpu") == 0) {
        g_backend = DM_CPU;
    } else if (strcmp(b, "cuda") == 0) {
        cuda_init();
        g_backend = DM_CUDA;
    } else {
        fprintf(stderr, "devmem: KVSWAP_TEST_BACKEND=%s is not cpu or cuda\n", b);
        exit(2);
    }
}

void dm_fini(void) {
    need_init("dm_fini");
    if (g_backend == DM_CUDA) {
        bind_ctx();
        CU(cu.CtxSynchronize());
        CU(cu.StreamDestroy(g_stream));
        g_stream = NULL;
        CU(cu.DevicePrimaryCtxRelease(g_dev));
    }
    long live = atomic_load(&g_live);
    if (live != 0) {
        fprintf(stderr, "devmem: %ld dm_alloc'd buffer(s) were never freed\n", live);
        exit(1);
    }
}

uint32_t dm_backend(void) {
    need_init("dm_backend");
    return g_backend == DM_CUDA ? KVSWAP_BACKEND_CUDA : KVSWAP_BACKEND_CPU;
}

int dm_is_cuda(void) {
    need_init("dm_is_cuda");
    return g_backend == DM_CUDA;
}

const char *dm_backend_name(void) {
    need_init("dm_backend_name");
    return g_backend == DM_CUDA ? "cuda" : "cpu";
}

int dm_driver_present(void) {
    void *h = dlopen(LIBCUDA, RTLD_LAZY | RTLD_LOCAL);
    if (h == NULL) return 0;
    dlclose(h);
    return 1;
}

/* ---- memory ---- */

void *dm_alloc(size_t bytes) {
    need_init("dm_alloc");
    size_t n = bytes ? bytes : 1;
    void *p;
    if (g_backend == DM_CUDA) {
        bind_ctx();
        CUdeviceptr d = 0;
        CU(cu.MemAlloc(&d, n));
        p = (void *)(uintptr_t)d;
    } else {
        p = malloc(n);
    }
    if (p == NULL) die("dm_alloc: out of memory");
    atomic_fetch_add(&g_live, 1);
    return p;
}

void dm_free(void *p) {
    need_init("dm_free");
    if (p == NULL) return;
    atomic_fetch_sub(&g_live, 1);
    if (g_backend == DM_CUDA) {
        bind_ctx();
        /* Work still in flight on any stream (kvswap's included) may use it. */
        CU(cu.CtxSynchronize());
        CU(cu.MemFree(dptr(p)));
    } else {
        free(p);
    }
}

void dm_upload_s(void *s, void *dst, const void *src, size_t bytes) {
    need_init("dm_upload");
    if (bytes == 0) return;
    if (g_backend == DM_CUDA) {
        bind_ctx();
        /* From pageable memory: returns once `src` has been staged. */
        CU(cu.MemcpyHtoDAsync(dptr(dst), src, bytes, (CUstream)s));
    } else {
        memcpy(dst, src, bytes);
    }
}

void dm_download_s(void *s, void *dst, const void *src, size_t bytes) {
    need_init("dm_download");
    if (bytes == 0) return;
    if (g_backend == DM_CUDA) {
        bind_ctx();
        CU(cu.MemcpyDtoHAsync(dst, dptr(src), bytes, (CUstream)s));
        CU(cu.StreamSynchronize((CUstream)s));
    } else {
        memcpy(dst, src, bytes);
    }
}

void dm_memset_s(void *s, void *dst, int value, size_t bytes) {
    need_init("dm_memset");
    if (bytes == 0) return;
    if (g_backend == DM_CUDA) {
        bind_ctx();
        CU(cu.MemsetD8Async(dptr(dst), (unsigned char)value, bytes, (CUstream)s));
    } else {
        memset(dst, value, bytes);
    }
}

void dm_upload(void *dst, const void *src, size_t bytes) { dm_upload_s(dm_stream(), dst, src, bytes); }
void dm_download(void *dst, const void *src, size_t bytes) { dm_download_s(dm_stream(), dst, src, bytes); }
void dm_memset(void *dst, int value, size_t bytes) { dm_memset_s(dm_stream(), dst, value, bytes); }

/* ---- streams ---- */

void *dm_stream(void) {
    need_init("dm_stream");
    return g_backend == DM_CUDA ? (void *)g_stream : NULL;
}

void dm_stream_sync(void *s) {
    need_init("dm_stream_sync");
    if (g_backend != DM_CUDA) return;
    bind_ctx();
    CU(cu.StreamSynchronize((CUstream)s));
}

void dm_sync(void) { dm_stream_sync(dm_stream()); }

void *dm_stream_new(void) {
    need_init("dm_stream_new");
    if (g_backend != DM_CUDA) return NULL;
    bind_ctx();
    CUstream s = NULL;
    CU(cu.StreamCreate(&s, DM_CU_STREAM_NON_BLOCKING));
    if (s == NULL) die("cuStreamCreate returned a NULL stream");
    return s;
}

void dm_stream_free(void *s) {
    need_init("dm_stream_free");
    if (g_backend != DM_CUDA || s == NULL) return;
    bind_ctx();
    CU(cu.StreamSynchronize((CUstream)s));
    CU(cu.StreamDestroy((CUstream)s));
}
