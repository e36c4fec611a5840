/*
 * devmem: the memory and stream adapter of the ABI tests (C and C++).
 *
 * The tests hand kvswap "device" pointers (store sources, index buffers,
 * engine-owned staging) and read staged bytes back through this adapter, so
 * the same programs run on both backends, chosen at run time by the
 * environment variable KVSWAP_TEST_BACKEND:
 *
 *   cpu (default)  host memory plays the device: malloc / memcpy; the stream
 *                  given to kvswap is NULL.
 *   cuda           device memory of the primary context of CUDA device 0
 *                  (kvswap uses the same context, so pointers are shared);
 *                  libcuda.so.1 is loaded with dlopen at dm_init(), so the
 *                  programs build and run without CUDA anywhere else.
 *
 * Ordering: uploads, memsets and downloads are issued on a stream (dm_stream()
 * unless a _s variant names another), so they are ordered with the kvswap
 * calls made on that stream, as an engine's own copies would be. Downloads
 * wait for their stream before returning. Streams are non-blocking: nothing
 * is ordered with work on other streams, so a test that mixes streams must
 * synchronise them itself (dm_stream_sync).
 *
 * Every CUDA call is checked: a failure prints the call, the CUresult and its
 * name to stderr, then exits with status 1.
 */
#ifndef KVSWAP_TEST_DEVMEM_H
#define KVSWAP_TEST_DEVMEM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Reads KVSWAP_TEST_BACKEND and sets up the backend: on cuda, loads
 * libcuda.so.1, makes the primary context of device 0 current and creates
 * the main stream. Exits with a message on any failure (status 1; status 2
 * for an unknown KVSWAP_TEST_BACKEND value). Call once, before any thread. */
void dm_init(void);

/* Synchronises, destroys the main stream, releases the primary context, and
 * fails (exit 1) if a dm_alloc'd buffer was not freed. */
void dm_fini(void);

/* KVSWAP_BACKEND_CPU or KVSWAP_BACKEND_CUDA, for KvswapConfig::backend. */
uint32_t dm_backend(void);
/* 1 on the CUDA backend, 0 on the CPU backend. */
int dm_is_cuda(void);
/* "cpu" or "cuda". */
const char *dm_backend_name(void);

/* Whether libcuda.so.1 can be loaded on this machine (a dlopen probe that
 * initialises nothing). Usable before dm_init(). */
int dm_driver_present(void);

/* `bytes` of device memory (host memory on the CPU backend); never NULL. */
void *dm_alloc(size_t bytes);
/* Frees a dm_alloc'd buffer after waiting for all device work of the
 * context (kvswap's included) that may still use it. NULL is a no-op. */
void dm_free(void *p);

/* Host -> device on the main stream. `src` may be reused on return. */
void dm_upload(void *dst, const void *src, size_t bytes);
/* Device -> host on the main stream; returns when the bytes are in `dst`. */
void dm_download(void *dst, const void *src, size_t bytes);
/* Sets `bytes` bytes at `dst` to `value`, on the main stream. */
void dm_memset(void *dst, int value, size_t bytes);

/* The same, on stream `s` (from dm_stream_new, or dm_stream()). */
void dm_upload_s(void *s, void *dst, const void *src, size_t bytes);
void dm_download_s(void *s, void *dst, const void *src, size_t bytes);
void dm_memset_s(void *s, void *dst, int value, size_t bytes);

/* The stream to pass to kvswap: NULL on the CPU backend, the main CUstream
 * (created by dm_init) on CUDA. */
void *dm_stream(void);
/* Waits for the main stream. */
void dm_sync(void);

/* A new non-blocking CUstream for one thread (NULL on the CPU backend), and
 * its destruction (after waiting for it; NULL is a no-op). */
void *dm_stream_new(void);
void dm_stream_free(void *s);
/* Waits for stream `s`: a dm_stream_new stream, dm_stream(), or
 * CU_STREAM_PER_THREAD ((void *)2). A no-op on the CPU backend. */
void dm_stream_sync(void *s);

/* CU_STREAM_PER_THREAD of the CUDA driver API. */
#define DM_STREAM_PER_THREAD ((void *)(uintptr_t)2)
/* CU_STREAM_LEGACY of the CUDA driver API. */
#define DM_STREAM_LEGACY ((void *)(uintptr_t)1)

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVSWAP_TEST_DEVMEM_H */
