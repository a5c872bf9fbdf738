/* Stand-in CUDA driver and NCCL library for attn-ring's tests on machines without a
 * GPU. Built by tests/nccl_stand_in.rs into one shared object that is reached as both
 * libcuda.so and libnccl.so.2 (symlinks: the loader maps it once, so both share state),
 * it lets the real NcclComm code (cudarc's driver loading, nccl_library and nccl_handle)
 * run end to end with ranks on threads.
 *
 * What it models:
 * - "Device" memory is host memory; copies and memsets run when issued.
 * - A stream holds NCCL operations that stay pending until matched; an event is
 *   complete once every operation issued on its stream before it is done. A copy to
 *   the host issued behind pending NCCL work is refused (real CUDA would order it; the
 *   stand-in cannot), which checks that callers wait for their round first.
 * - NCCL communicators must be non-blocking (config.blocking == 0; the stand-in
 *   refuses blocking ones): creation returns ncclInProgress and completes when every
 *   rank has joined; ncclGroupEnd returns ncclInProgress for two polls of
 *   ncclCommGetAsyncError. Two ranks on one device are refused, as NCCL does.
 * - Sends and receives of an ordered pair of ranks match in issue order; a send
 *   completes only when its receive is posted. Matched counts must agree.
 * - ncclCommAbort cancels the rank's pending operations (their stream events
 *   complete) and frees it; its peers see nothing and wait, as with a dead process.
 * - A network failure that NCCL notices: in a world whose unique id is the text
 *   "remote-error-after N", every rank's (N+1)-th ncclGroupEnd leaves
 *   ncclRemoteError as its asynchronous error.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef uint64_t CUdeviceptr;
enum { CU_OK = 0, CU_INVALID_VALUE = 1, CU_NOT_READY = 600, CU_LAUNCH_TIMEOUT = 702, CU_NOT_SUPPORTED = 801 };
enum { nccl_ok = 0, nccl_invalid_argument = 4, nccl_invalid_usage = 5, nccl_remote_error = 6, nccl_in_progress = 7 };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char last_error[256] = "";

static int gpu_count(void) {
  const char *e = getenv("ATTN_STAND_IN_GPUS");
  return e ? atoi(e) : 8;
}

static void say(const char *what) { snprintf(last_error, sizeof last_error, "stand-in: %s", what); }

/* ---- contexts and streams ---- */
typedef struct { int device; } Context;
static Context contexts[64];
static __thread Context *current;

typedef struct {
  uint64_t issued;  /* NCCL operations issued on this stream so far */
  uint64_t first_open; /* lowest sequence number not known to be done */
  unsigned char *done; /* done[seq] for seq in 1..=issued */
  uint64_t cap;
} Stream;

typedef struct {
  Stream *stream;
  uint64_t upto;
} Event;

static uint64_t stream_issue(Stream *s) {
  if (s->issued + 2 > s->cap) {
    s->cap = s->cap ? 2 * s->cap : 64;
    s->done = realloc(s->done, s->cap);
  }
  s->issued += 1;
  s->done[s->issued] = 0;
  return s->issued;
}

static int stream_reached(Stream *s, uint64_t upto) {
  while (s->first_open <= s->issued && s->done[s->first_open]) s->first_open += 1;
  return s->first_open > upto;
}

CUresult cuInit(unsigned flags) { (void)flags; return CU_OK; }
CUresult cuDeviceGetCount(int *n) { *n = gpu_count(); return CU_OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
  if (ordinal < 0 || ordinal >= gpu_count() || ordinal >= 64) return CU_INVALID_VALUE;
  *d = ordinal;
  return CU_OK;
}
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) { (void)attr; (void)d; *v = 0; return CU_OK; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
  contexts[d].device = d;
  *ctx = &contexts[d];
  return CU_OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return CU_OK; }
CUresult cuCtxSetCurrent(void *ctx) { current = ctx; return CU_OK; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current; return CU_OK; }
CUresult cuCtxSynchronize(void) { return CU_OK; }
CUresult cuGetErrorString(CUresult r, const char **s) { (void)r; *s = "stand-in CUDA error"; return CU_OK; }
CUresult cuGetErrorName(CUresult r, const char **s) { (void)r; *s = "CUDA_ERROR_STAND_IN"; return CU_OK; }

CUresult cuStreamCreate(void **s, unsigned flags) {
  (void)flags;
  Stream *st = calloc(1, sizeof(Stream));
  st->first_open = 1;
  *s = st;
  return CU_OK;
}
CUresult cuStreamCreateWithPriority(void **s, unsigned flags, int prio) { (void)prio; return cuStreamCreate(s, flags); }
CUresult cuStreamDestroy_v2(void *s) {
  Stream *st = s;
  if (st) { free(st->done); free(st); }
  return CU_OK;
}
CUresult cuStreamIsCapturing(void *s, int *status) { (void)s; *status = 0; return CU_OK; }
CUresult cuStreamWaitEvent(void *s, void *e, unsigned flags) { (void)s; (void)e; (void)flags; return CU_OK; }
/* Real CUDA would wait forever on NCCL work that never completes; the stand-in gives
 * up after SYNC_LIMIT_US and says so, so a test fails instead of hanging. */
#define SYNC_LIMIT_US 20000000L
static CUresult gave_up(const char *what) {
  say(what);
  fprintf(stderr, "%s\n", last_error);
  return CU_LAUNCH_TIMEOUT;
}

CUresult cuStreamSynchronize(void *s) {
  Stream *st = s;
  for (long waited = 0;; waited += 50) {
    pthread_mutex_lock(&mu);
    int reached = !st || stream_reached(st, st->issued);
    pthread_mutex_unlock(&mu);
    if (reached) return CU_OK;
    if (waited > SYNC_LIMIT_US) return gave_up("stream synchronize: NCCL work on the stream never completed nor was aborted");
    usleep(50);
  }
}

CUresult cuEventCreate(void **e, unsigned flags) { (void)flags; *e = calloc(1, sizeof(Event)); return CU_OK; }
CUresult cuEventDestroy_v2(void *e) { free(e); return CU_OK; }
CUresult cuEventRecord(void *e, void *s) {
  Event *ev = e;
  pthread_mutex_lock(&mu);
  ev->stream = s;
  ev->upto = s ? ((Stream *)s)->issued : 0;
  pthread_mutex_unlock(&mu);
  return CU_OK;
}
CUresult cuEventQuery(void *e) {
  Event *ev = e;
  pthread_mutex_lock(&mu);
  int reached = !ev->stream || stream_reached(ev->stream, ev->upto);
  pthread_mutex_unlock(&mu);
  return reached ? CU_OK : CU_NOT_READY;
}
CUresult cuEventSynchronize(void *e) {
  for (long waited = 0; cuEventQuery(e) == CU_NOT_READY; waited += 50) {
    if (waited > SYNC_LIMIT_US) return gave_up("event synchronize: NCCL work never completed nor was aborted");
    usleep(50);
  }
  return CU_OK;
}

static CUdeviceptr device_alloc(size_t n) { return (CUdeviceptr)(uintptr_t)calloc(1, n ? n : 1); }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { *p = device_alloc(n); return CU_OK; }
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, void *s) { (void)s; *p = device_alloc(n); return CU_OK; }
CUresult cuMemFree_v2(CUdeviceptr p) { free((void *)(uintptr_t)p); return CU_OK; }
CUresult cuMemFreeAsync(CUdeviceptr p, void *s) { (void)s; return cuMemFree_v2(p); }
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
  memcpy((void *)(uintptr_t)dst, src, n);
  return CU_OK;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) {
  (void)s;
  return cuMemcpyHtoD_v2(dst, src, n);
}
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  memcpy(dst, (void *)(uintptr_t)src, n);
  return CU_OK;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *s) {
  Stream *st = s;
  pthread_mutex_lock(&mu);
  int reached = !st || stream_reached(st, st->issued);
  pthread_mutex_unlock(&mu);
  if (!reached) {
    say("a copy to the host was issued behind NCCL work still pending on its stream");
    fprintf(stderr, "%s\n", last_error);
    return CU_NOT_SUPPORTED;
  }
  return cuMemcpyDtoH_v2(dst, src, n);
}
CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) {
  memset((void *)(uintptr_t)p, v, n);
  return CU_OK;
}
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void *s) { (void)s; return cuMemsetD8_v2(p, v, n); }

/* ---- NCCL ---- */
typedef struct {
  size_t size;
  unsigned magic, version;
  int blocking;
} ConfigHead;

struct Comm;
typedef struct Pending {
  struct Pending *next;
  struct Comm *owner;
  Stream *stream;
  uint64_t seq;
  size_t count;
  int is_send;
  unsigned char *data; /* send: a copy of the bytes; receive: where they go */
} Pending;

typedef struct World {
  struct World *next;
  char id[128];
  int nranks, joined, alive;
  int fail_after; /* groups each rank completes before ncclRemoteError; -1: never */
  struct Comm **ranks;
  Pending **sends, **recvs; /* per ordered pair src * nranks + dst, issue order */
} World;

typedef struct Comm {
  World *world;
  int rank, device, launch_polls, async_error, groups;
} Comm;

/* ncclUniqueId: 128 bytes, passed by value to ncclCommInitRankConfig. */
typedef struct { char internal[128]; } UniqueId;

static World *worlds;
static uint64_t id_counter;

int ncclGetVersion(int *v) { *v = 23000; return nccl_ok; }
const char *ncclGetErrorString(int r) { (void)r; return "stand-in NCCL error"; }
const char *ncclGetLastError(Comm *c) { (void)c; return last_error; }

int ncclGetUniqueId(UniqueId *id) {
  pthread_mutex_lock(&mu);
  memset(id->internal, 0, 128);
  snprintf(id->internal, 128, "stand-in %d %llu", (int)getpid(), (unsigned long long)++id_counter);
  pthread_mutex_unlock(&mu);
  return nccl_ok;
}

static void push(Pending **q, Pending *p) {
  while (*q) q = &(*q)->next;
  p->next = NULL;
  *q = p;
}

static void match_pair(World *w, int pair) {
  while (w->sends[pair] && w->recvs[pair]) {
    Pending *s = w->sends[pair], *r = w->recvs[pair];
    w->sends[pair] = s->next;
    w->recvs[pair] = r->next;
    if (s->count == r->count) {
      memcpy(r->data, s->data, s->count);
    } else {
      say("a send and its receive disagree on the byte count");
      s->owner->async_error = r->owner->async_error = nccl_invalid_usage;
    }
    s->stream->done[s->seq] = 1;
    r->stream->done[r->seq] = 1;
    free(s->data);
    free(s);
    free(r);
  }
}

int ncclCommInitRankConfig(Comm **out, int nranks, UniqueId id, int rank, void *config) {
  ConfigHead *head = config;
  if (!head || head->magic != 0xcafebeef || head->size < sizeof(ConfigHead)) {
    say("config not made by NCCL_CONFIG_INITIALIZER");
    return nccl_invalid_argument;
  }
  if (head->blocking != 0) {
    say("the stand-in only models non-blocking communicators (config.blocking = 0)");
    return nccl_invalid_usage;
  }
  if (nranks < 1 || rank < 0 || rank >= nranks || !current) {
    say("bad rank, world size, or no current CUDA context");
    return nccl_invalid_argument;
  }
  pthread_mutex_lock(&mu);
  World *w = worlds;
  while (w && memcmp(w->id, id.internal, 128) != 0) w = w->next;
  if (!w) {
    w = calloc(1, sizeof(World));
    memcpy(w->id, id.internal, 128);
    w->nranks = nranks;
    w->fail_after = strncmp(id.internal, "remote-error-after ", 19) == 0 ? atoi(id.internal + 19) : -1;
    w->ranks = calloc((size_t)nranks, sizeof(Comm *));
    w->sends = calloc((size_t)nranks * (size_t)nranks, sizeof(Pending *));
    w->recvs = calloc((size_t)nranks * (size_t)nranks, sizeof(Pending *));
    w->next = worlds;
    worlds = w;
  }
  int bad = w->nranks != nranks || w->ranks[rank] != NULL;
  for (int i = 0; i < w->nranks && !bad; i++) bad = w->ranks[i] && w->ranks[i]->device == current->device;
  if (bad) {
    pthread_mutex_unlock(&mu);
    say("rank joined twice, world sizes disagree, or two ranks share a GPU");
    return nccl_invalid_usage;
  }
  Comm *c = calloc(1, sizeof(Comm));
  c->world = w;
  c->rank = rank;
  c->device = current->device;
  w->ranks[rank] = c;
  w->joined += 1;
  w->alive += 1;
  *out = c;
  pthread_mutex_unlock(&mu);
  return nccl_in_progress;
}

int ncclCommGetAsyncError(Comm *c, int *state) {
  pthread_mutex_lock(&mu);
  if (c->async_error) *state = c->async_error;
  else if (c->world->joined < c->world->nranks) *state = nccl_in_progress;
  else if (c->launch_polls > 0) { c->launch_polls -= 1; *state = nccl_in_progress; }
  else *state = nccl_ok;
  pthread_mutex_unlock(&mu);
  return nccl_ok;
}

/* Operations of the current group, issued at ncclGroupEnd. */
typedef struct { int send; Comm *comm; int peer; size_t count; CUdeviceptr buf; Stream *stream; } Queued;
static __thread int group_depth;
static __thread Queued *queued;
static __thread size_t n_queued, cap_queued;

int ncclGroupStart(void) { group_depth += 1; return nccl_ok; }

static int enqueue(int send, const void *buf, size_t count, int dtype, int peer, Comm *c, void *stream) {
  if (dtype != 0 && dtype != 1) { say("the stand-in moves bytes only (ncclInt8, ncclUint8)"); return nccl_invalid_argument; }
  if (group_depth == 0) { say("point-to-point call outside a group"); return nccl_invalid_usage; }
  if (peer < 0 || peer >= c->world->nranks || !stream) { say("bad peer or stream"); return nccl_invalid_argument; }
  if (n_queued == cap_queued) {
    cap_queued = cap_queued ? 2 * cap_queued : 16;
    queued = realloc(queued, cap_queued * sizeof(Queued));
  }
  queued[n_queued++] = (Queued){send, c, peer, count, (CUdeviceptr)(uintptr_t)buf, stream};
  return nccl_ok;
}

int ncclSend(const void *buf, size_t count, int dtype, int peer, Comm *c, void *stream) {
  return enqueue(1, buf, count, dtype, peer, c, stream);
}
int ncclRecv(void *buf, size_t count, int dtype, int peer, Comm *c, void *stream) {
  return enqueue(0, buf, count, dtype, peer, c, stream);
}

int ncclGroupEnd(void) {
  if (group_depth == 0) { say("ncclGroupEnd without ncclGroupStart"); return nccl_invalid_usage; }
  if (--group_depth > 0) return nccl_ok;
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < n_queued; i++) {
    Queued q = queued[i];
    Pending *p = calloc(1, sizeof(Pending));
    p->owner = q.comm;
    p->stream = q.stream;
    p->seq = stream_issue(q.stream);
    p->count = q.count;
    int n = q.comm->world->nranks, pair;
    p->is_send = q.send;
    if (q.send) {
      p->data = malloc(q.count ? q.count : 1);
      memcpy(p->data, (void *)(uintptr_t)q.buf, q.count);
      pair = q.comm->rank * n + q.peer;
      push(&q.comm->world->sends[pair], p);
    } else {
      p->data = (unsigned char *)(uintptr_t)q.buf;
      pair = q.peer * n + q.comm->rank;
      push(&q.comm->world->recvs[pair], p);
    }
    q.comm->launch_polls = 2;
    match_pair(q.comm->world, pair);
  }
  for (size_t i = 0; i < n_queued; i++) {
    Comm *c = queued[i].comm;
    if (i > 0 && queued[i - 1].comm == c) continue;
    c->groups += 1;
    if (c->world->fail_after >= 0 && c->groups > c->world->fail_after) {
      c->async_error = nccl_remote_error;
      say("remote-error-after: a peer's connection failed (injected)");
    }
  }
  n_queued = 0;
  free(queued); /* thread-local: freed here, or each rank thread would leak it at exit */
  queued = NULL;
  cap_queued = 0;
  pthread_mutex_unlock(&mu);
  return nccl_in_progress;
}

/* Drop this rank's pending operations from one queue, completing them on their streams. */
static void cancel(Pending **q, Comm *c) {
  while (*q) {
    Pending *p = *q;
    if (p->owner == c) {
      *q = p->next;
      p->stream->done[p->seq] = 1;
      if (p->is_send) free(p->data);
      free(p);
    } else {
      q = &p->next;
    }
  }
}

int ncclCommAbort(Comm *c) {
  if (!c) return nccl_ok;
  pthread_mutex_lock(&mu);
  World *w = c->world;
  int n = w->nranks;
  for (int i = 0; i < n * n; i++) {
    cancel(&w->sends[i], c);
    cancel(&w->recvs[i], c);
  }
  w->ranks[c->rank] = NULL;
  w->alive -= 1;
  free(c);
  pthread_mutex_unlock(&mu);
  return nccl_ok;
}

int ncclCommDestroy(Comm *c) { return ncclCommAbort(c); }
