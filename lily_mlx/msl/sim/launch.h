// Metal-compatibility prelude, part 5: MLX's indexing helpers and the dispatch loop
// (dispatchThreads semantics: edge threadgroups are partial, no padding threads).
#pragma once
#include <algorithm>
#include "simd.h"
#ifdef LILY_MSL_TRACE
#include "trace.h"
#else
namespace msl_rt {
struct TraceCell {};
inline TraceCell* trace_alloc() { return nullptr; }
inline void trace_free(TraceCell*) {}
}  // namespace msl_rt
#endif

// MLX utils.h indexing helpers (int64 strides, MLX >= 0.2x).
template <class IdxT = int64_t, class S, class St>
inline IdxT elem_to_loc(IdxT elem, S shape, St strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += IdxT(elem % IdxT(shape[i])) * IdxT(strides[i]);
    elem /= IdxT(shape[i]);
  }
  return loc;
}
template <class IdxT = int64_t, class S, class St>
inline IdxT elem_to_loc(uint3 elem, S shape, St strides, int ndim) {
  IdxT loc = IdxT(elem.x) * IdxT(strides[ndim - 1]) + IdxT(elem.y) * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += IdxT(elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}
template <class IdxT = int64_t, class St> inline IdxT elem_to_loc_1(uint elem, St stride) { return IdxT(elem) * IdxT(stride); }
template <class IdxT = int64_t, class St> inline IdxT elem_to_loc_2(uint2 elem, St strides) {
  return IdxT(elem.x) * IdxT(strides[1]) + IdxT(elem.y) * IdxT(strides[0]);
}
template <class IdxT = int64_t, class St> inline IdxT elem_to_loc_3(uint3 elem, St strides) {
  return IdxT(elem.x) * IdxT(strides[2]) + IdxT(elem.y) * IdxT(strides[1]) + IdxT(elem.z) * IdxT(strides[0]);
}

namespace msl_rt {

// Attribute threadgroup-memory bytes changed since the snapshot to the running thread; two
// different threads changing a byte within one barrier interval is a write-write race.
LILY_NO_INSTRUMENT inline void race_scan(Worker* w) {
  int me = w->cur_index + 1;
  for (size_t b = 0; b < w->snap_used; ++b) {
    if (w->arena[b] == w->snap[b]) continue;
    if (w->shadow_epoch[b] == w->epoch && w->shadow_w[b] != (uint32_t)me && !w->failed) {
      const ThreadAttrs& a = w->fibers[me - 1].at;
      const ThreadAttrs& o = w->fibers[w->shadow_w[b] - 1].at;
      w->failed = true;
      w->err_kind = 3;
      w->err_line = 0;
      std::snprintf(w->err, sizeof(w->err),
                    "race: threads %u and %u of threadgroup (%u,%u,%u) both wrote byte %zu of threadgroup memory "
                    "between the same two barriers (missing threadgroup_barrier?)",
                    o.thread_index_in_threadgroup, a.thread_index_in_threadgroup, a.threadgroup_position_in_grid.x,
                    a.threadgroup_position_in_grid.y, a.threadgroup_position_in_grid.z, b);
    }
    w->shadow_epoch[b] = w->epoch;
    w->shadow_w[b] = (uint32_t)me;
  }
}
LILY_NO_INSTRUMENT inline void race_snapshot(Worker* w) {
  std::memcpy(w->snap, w->arena, w->arena_used);
  w->snap_used = w->arena_used;
}

inline void deadlock_report(Worker* w) {
  // Every live thread waits and no rendezvous can complete: name who waits where, who finished.
  char msg[1900];
  int n = 0, line = 0;
  int waiting = 0, done = 0;
  const Fiber* first_wait = nullptr;
  const Fiber* first_done = nullptr;
  for (int i = 0; i < w->n; ++i) {
    const Fiber& f = w->fibers[i];
    if (f.state == kDone) { done++; if (!first_done) first_done = &f; }
    else { waiting++; if (!first_wait) first_wait = &f; }
  }
  const ThreadAttrs& a = first_wait->at;
  line = first_wait->wait_line;
  n += std::snprintf(msg + n, sizeof(msg) - n,
                     "divergence: threadgroup (%u,%u,%u) cannot make progress: %d thread(s) wait (first: lane %u of "
                     "simdgroup %u at %s at line %d)",
                     a.threadgroup_position_in_grid.x, a.threadgroup_position_in_grid.y, a.threadgroup_position_in_grid.z,
                     waiting, a.thread_index_in_simdgroup, a.simdgroup_index_in_threadgroup, first_wait->wait_what, line);
  if (first_done) {
    n += std::snprintf(msg + n, sizeof(msg) - n, ", %d thread(s) already returned (first: lane %u of simdgroup %u)",
                       done, first_done->at.thread_index_in_simdgroup, first_done->at.simdgroup_index_in_threadgroup);
  }
  // Also name a second distinct wait site if there is one.
  for (int i = 0; i < w->n && n < (int)sizeof(msg) - 200; ++i) {
    const Fiber& f = w->fibers[i];
    if (f.state != kDone && (f.wait_line != line || f.wait_what != first_wait->wait_what)) {
      n += std::snprintf(msg + n, sizeof(msg) - n, ", while lane %u of simdgroup %u waits at %s at line %d",
                         f.at.thread_index_in_simdgroup, f.at.simdgroup_index_in_threadgroup, f.wait_what, f.wait_line);
      break;
    }
  }
  w->failed = true;
  w->err_kind = 2;
  w->err_line = line;
  std::snprintf(w->err, sizeof(w->err), "%s", msg);
}

inline uint3 u3(uint x, uint y, uint z) { uint3 r; r.x = x; r.y = y; r.z = z; return r; }

inline void run_group(Worker* w, uint gx, uint gy, uint gz) {
  Launch* L = w->L;
  const uint* G = L->grid;
  const uint* TG = L->tg;
  uint3 gpos = u3(gx, gy, gz);
  uint3 tgs_per_grid = u3((G[0] + TG[0] - 1) / TG[0], (G[1] + TG[1] - 1) / TG[1], (G[2] + TG[2] - 1) / TG[2]);
  // Actual size of this (possibly partial, edge) threadgroup.
  uint ax = std::min(TG[0], G[0] - gx * TG[0]);
  uint ay = std::min(TG[1], G[1] - gy * TG[1]);
  uint az = std::min(TG[2], G[2] - gz * TG[2]);
  int n = (int)(ax * ay * az);
  int nominal = (int)(TG[0] * TG[1] * TG[2]);
  w->n = n;
  int nsg = (n + 31) / 32;
  w->barrier = SyncPoint{};
  w->barrier.participants = n;
  for (int s = 0; s < nsg; ++s) {
    SimdSlot& sl = w->simd[s];
    sl.arrived = 0;
    sl.gen = 0;
    int lanes = std::min(32, n - s * 32);
    sl.participants = lanes;
    sl.present = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  }
  w->arena_used = 0;
  w->n_tg = 0;
  const bool track = (L->race_check & 1) != 0;
  const bool reverse = (L->race_check & 2) != 0;
  w->epoch++;
  int i = 0;
  for (uint z = 0; z < az; ++z)
    for (uint y = 0; y < ay; ++y)
      for (uint x = 0; x < ax; ++x, ++i) {
        Fiber* f = &w->fibers[i];
        fiber_init(w, f, w->stacks + (size_t)i * w->stack_bytes);
        ThreadAttrs& t = f->at;
        t.thread_position_in_threadgroup = u3(x, y, z);
        t.threadgroup_position_in_grid = gpos;
        t.thread_position_in_grid = u3(gx * TG[0] + x, gy * TG[1] + y, gz * TG[2] + z);
        t.threads_per_threadgroup = u3(ax, ay, az);
        t.dispatch_threads_per_threadgroup = u3(TG[0], TG[1], TG[2]);
        t.threadgroups_per_grid = tgs_per_grid;
        t.threads_per_grid = u3(G[0], G[1], G[2]);
        t.grid_size = t.threads_per_grid;
        t.grid_origin = u3(0, 0, 0);
        t.thread_index_in_threadgroup = (uint)i;
        t.simdgroup_index_in_threadgroup = (uint)i / 32;
        t.thread_index_in_simdgroup = (uint)i % 32;
        t.simdgroups_per_threadgroup = (uint)nsg;
        t.dispatch_simdgroups_per_threadgroup = (uint)((nominal + 31) / 32);
        t.threads_per_simdgroup = 32;
        t.thread_execution_width = 32;
        t.quadgroup_index_in_threadgroup = (uint)i / 4;
        t.thread_index_in_quadgroup = (uint)i % 4;
        t.quadgroups_per_threadgroup = (uint)((n + 3) / 4);
        t.dispatch_quadgroups_per_threadgroup = (uint)((nominal + 3) / 4);
      }
  // Round-robin over the group's fibers; a waiting fiber runs again once its rendezvous completed.
  while (true) {
    bool progress = false;
    int alive = 0;
    for (int kk = 0; kk < n; ++kk) {
      int k = reverse ? n - 1 - kk : kk;
      Fiber* f = &w->fibers[k];
      if (f->state == kDone) continue;
      alive++;
      if (f->state == kWaiting && *f->wait_gen_ptr == f->wait_gen) continue;
      w->cur_index = k;
      if (track) race_snapshot(w);
      switch_to(w, f);
      if (track && !w->failed) race_scan(w);
      progress = true;
      if (w->failed) {
        // Let the other fibers unwind is unnecessary: their stacks are simply reused.
        return;
      }
    }
    if (alive == 0) return;
    if (!progress) { deadlock_report(w); return; }
  }
}

struct WorkerArgs { Launch* L; Body body; int index; int count; Worker* w; };

inline void* worker_main(void* p) {
  WorkerArgs* a = (WorkerArgs*)p;
  Worker* w = a->w;
  tw = w;
  Launch* L = a->L;
  uint nx = (L->grid[0] + L->tg[0] - 1) / L->tg[0];
  uint ny = (L->grid[1] + L->tg[1] - 1) / L->tg[1];
  uint nz = (L->grid[2] + L->tg[2] - 1) / L->tg[2];
  uint64_t total = (uint64_t)nx * ny * nz;
  for (uint64_t g = a->index; g < total; g += a->count) {
    uint gx = (uint)(g % nx), gy = (uint)((g / nx) % ny), gz = (uint)(g / ((uint64_t)nx * ny));
    run_group(w, gx, gy, gz);
    if (w->failed) break;
    // Another worker failed: stop early.
    if (__atomic_load_n(&L->err_kind, __ATOMIC_RELAXED) != 0) break;
  }
  if (w->failed) {
    pthread_mutex_lock(&g_err_mu);
    if (L->err_kind == 0) {
      std::snprintf(L->err, (size_t)L->err_len, "%s", w->err);
      L->err_line = w->err_line;
      L->err_pc = w->err_pc;
      __atomic_store_n(&L->err_kind, w->err_kind, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&g_err_mu);
  }
  tw = nullptr;
  return nullptr;
}

inline int run(Launch* L, Body body) {
  int tgn = (int)(L->tg[0] * L->tg[1] * L->tg[2]);
  uint64_t ngroups = (uint64_t)((L->grid[0] + L->tg[0] - 1) / L->tg[0]) * ((L->grid[1] + L->tg[1] - 1) / L->tg[1]) *
                     ((L->grid[2] + L->tg[2] - 1) / L->tg[2]);
  int nw = (int)std::min<uint64_t>((uint64_t)std::max(1, L->n_workers), ngroups);
  if (nw < 1) return 0;
  L->err_kind = 0;
  Worker* workers = new Worker[nw];
  WorkerArgs* args = new WorkerArgs[nw];
  size_t stack_bytes = (size_t)L->stack_bytes;
  for (int i = 0; i < nw; ++i) {
    Worker* w = &workers[i];
    w->L = L;
    w->body = body;
    w->capacity = tgn;
    w->stack_bytes = stack_bytes;
    w->fibers = new Fiber[tgn];
    w->stacks = (char*)mmap(nullptr, stack_bytes * tgn, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (w->stacks == (char*)MAP_FAILED) {
      w->stacks = nullptr;
      std::snprintf(L->err, (size_t)L->err_len, "cannot map %zu bytes of fiber stacks (LILY_MSL_STACK_KB)",
                    stack_bytes * tgn);
      L->err_kind = 4;
      break;
    }
    // A guard page below each fiber stack: an overflow faults instead of corrupting a neighbour.
    for (int f = 0; f < tgn; ++f) mprotect(w->stacks + (size_t)f * stack_bytes, 4096, PROT_NONE);
    w->simd = new SimdSlot[32];
    w->arena = (unsigned char*)std::aligned_alloc(64, kThreadgroupMemory);
    if (L->race_check & 4) w->trace = trace_alloc();
    if (L->race_check & 1) {
      w->shadow_w = new uint32_t[kThreadgroupMemory]();
      w->shadow_epoch = new uint32_t[kThreadgroupMemory]();
      w->snap = new unsigned char[kThreadgroupMemory];
    }
    args[i] = WorkerArgs{L, body, i, nw, w};
  }
  if (L->err_kind != 0) {
    // setup failed: nothing runs
  } else if (nw == 1) {
    worker_main(&args[0]);
  } else {
    pthread_t* th = new pthread_t[nw];
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 8 << 20);
    for (int i = 0; i < nw; ++i) pthread_create(&th[i], &attr, worker_main, &args[i]);
    for (int i = 0; i < nw; ++i) pthread_join(th[i], nullptr);
    pthread_attr_destroy(&attr);
    delete[] th;
  }
  for (int i = 0; i < nw; ++i) {
    Worker* w = &workers[i];
    if (w->stacks) munmap(w->stacks, stack_bytes * tgn);
    delete[] w->fibers;
    delete[] w->simd;
    std::free(w->arena);
    delete[] w->shadow_w;
    delete[] w->shadow_epoch;
    delete[] w->snap;
    trace_free(w->trace);
  }
  delete[] args;
  delete[] workers;
  return L->err_kind;
}

// Called by the thread completing a threadgroup barrier: its writes so far belong to the interval
// that just ended.
inline void race_new_epoch(Worker* w) {
  const int flags = w->L->race_check;
  if (flags & 1) race_scan(w);
  w->epoch++;
  if (flags & 1) race_snapshot(w);
  if (w->failed) throw Error{3, 0};
}

}  // namespace msl_rt

using namespace metal;
