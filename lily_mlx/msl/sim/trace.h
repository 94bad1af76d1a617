// Metal-compatibility prelude, part 7 (race-check builds only, LILY_MSL_TRACE): every load and store
// of the kernel is instrumented (GCC -fsanitize=thread emits the __tsan_* calls; this file defines
// them, no sanitizer runtime is linked). Accesses to threadgroup memory are checked against the
// last writer and readers of each byte within the current barrier interval: two threads, at least
// one writing, between the same two threadgroup barriers is a race, unless both are lanes of one
// simdgroup separated by a simd op or simdgroup_barrier.
#pragma once
#include "runtime.h"

extern "C" int lily_sim_launch(msl_rt::Launch* L);

namespace msl_rt {

constexpr uint32_t kManyReaders = 0xffffffffu;

struct TraceCell {
  uint32_t w_tid, w_epoch, w_sg_epoch;  // last writer (thread index + 1), its barrier interval and simd epoch
  uint32_t r_tid, r_epoch, r_sg_epoch;  // last reader, or kManyReaders
  int32_t r_sg;                          // simdgroup of all readers of this interval, -1 if several
};

#define LILY_NO_TRACE __attribute__((no_sanitize_thread, noinline))

LILY_NO_TRACE TraceCell* trace_alloc() { return new TraceCell[kThreadgroupMemory](); }
LILY_NO_TRACE void trace_free(TraceCell* t) { delete[] t; }

// A failed check at threadgroup byte `byte` (of kind `kind`, at code address `pc`): the worker fails, and the variable
// holding that byte and the offset in it are looked up for the message.
LILY_NO_TRACE static const char* trace_fail(Worker* w, int kind, size_t byte, const void* pc, size_t& off) {
  w->err_pc = (int64_t)((uintptr_t)pc - (uintptr_t)&lily_sim_launch);
  w->failed = true;
  w->err_kind = kind;
  w->err_line = 0;
  off = byte;
  for (int i = 0; i < w->n_tg; ++i) {
    const TgEntry& e = w->tg_entries[i];
    if (byte >= e.offset && byte < e.offset + e.size) { off = byte - e.offset; return e.name; }
  }
  return "?";
}

LILY_NO_TRACE static void trace_race(Worker* w, size_t byte, bool write, uint32_t other, bool other_wrote,
                                     const void* pc) {
  if (w->failed) return;
  size_t off;
  const char* name = trace_fail(w, 3, byte, pc, off);
  const ThreadAttrs& a = w->fibers[w->cur_index].at;
  char other_s[64];
  if (other == kManyReaders) std::snprintf(other_s, sizeof(other_s), "several other threads");
  else std::snprintf(other_s, sizeof(other_s), "thread %u", other - 1);
  std::snprintf(w->err, sizeof(w->err),
                "race: thread %u (lane %u of simdgroup %u) of threadgroup (%u,%u,%u) %s byte %zu of threadgroup "
                "`%s` that %s %s between the same two barriers (missing threadgroup_barrier?)",
                a.thread_index_in_threadgroup, a.thread_index_in_simdgroup, a.simdgroup_index_in_threadgroup,
                a.threadgroup_position_in_grid.x, a.threadgroup_position_in_grid.y, a.threadgroup_position_in_grid.z,
                write ? "writes" : "reads", off, name, other_s, other_wrote ? "wrote" : "read");
}

// A threadgroup-memory access of a 2-, 4-, 8- or 16-byte type at an address that is not a multiple of its size (a
// uint4 store through reinterpret_cast at a 4-byte offset, say): Metal requires the alignment and the CUDA bridge
// faults ("misaligned address"). Only accesses the compiler emits as aligned (the __tsan_unaligned_* hooks are the
// code's own unaligned accesses, such as packed types). Device buffers are checked in every build (runtime.h).
LILY_NO_TRACE static void trace_misaligned(Worker* w, size_t byte, size_t size, bool write, const void* pc) {
  size_t off;
  const char* name = trace_fail(w, 5, byte, pc, off);
  const ThreadAttrs& a = w->fibers[w->cur_index].at;
  std::snprintf(w->err, sizeof(w->err),
                "misaligned: thread %u of threadgroup (%u,%u,%u) %s %zu bytes at byte %zu of threadgroup `%s` "
                "(threadgroup offset %zu, not a multiple of %zu), as a GPU would not",
                a.thread_index_in_threadgroup, a.threadgroup_position_in_grid.x, a.threadgroup_position_in_grid.y,
                a.threadgroup_position_in_grid.z, write ? "writes" : "reads", size, off, name, byte, size);
}

LILY_NO_TRACE static inline void trace_access(const volatile void* addr, size_t size, bool write, const void* pc,
                                              bool aligned = false) {
  Worker* w = tw;
  if (!w || !w->cur || !w->trace || w->failed) return;
  uintptr_t rel = (uintptr_t)addr - (uintptr_t)w->arena;
  if (rel >= w->arena_used) return;
  if (aligned && (rel & (size - 1))) { trace_misaligned(w, rel, size, write, pc); return; }
  const uint32_t me = (uint32_t)w->cur_index + 1;
  const int32_t sg = (int32_t)(w->cur_index / 32);
  const uint32_t sg_epoch = (uint32_t)w->simd[sg].gen;
  const uint32_t ep = w->epoch;
  // Is an earlier access by `tid` at simd epoch `sge` unordered with this one?
  auto unordered = [&](uint32_t tid, uint32_t sge) {
    return tid != me && !((int32_t)((tid - 1) / 32) == sg && sge != sg_epoch);
  };
  size_t end = rel + size < w->arena_used ? rel + size : w->arena_used;
  for (size_t b = rel; b < end; ++b) {
    TraceCell& c = w->trace[b];
    if (c.w_epoch == ep && unordered(c.w_tid, c.w_sg_epoch)) { trace_race(w, b, write, c.w_tid, true, pc); return; }
    if (write) {
      if (c.r_epoch == ep) {
        bool race = c.r_tid == kManyReaders ? !(c.r_sg == sg && c.r_sg_epoch != sg_epoch)
                                            : unordered(c.r_tid, c.r_sg_epoch);
        if (race) { trace_race(w, b, true, c.r_tid, false, pc); return; }
      }
      c.w_tid = me; c.w_epoch = ep; c.w_sg_epoch = sg_epoch;
    } else {
      if (c.r_epoch == ep && c.r_tid != me) {
        if (c.r_sg != sg) c.r_sg = -1;
        c.r_tid = kManyReaders;
        c.r_sg_epoch = sg_epoch;  // the latest read's simd epoch
      } else if (c.r_epoch != ep) {
        c.r_tid = me; c.r_epoch = ep; c.r_sg_epoch = sg_epoch; c.r_sg = sg;
      } else {
        c.r_sg_epoch = sg_epoch;
      }
    }
  }
}
LILY_NO_TRACE void trace_vec_align(const volatile void* p, size_t align, bool write) {
  Worker* w = tw;
  if (!w || !w->cur || !w->trace || w->failed) return;
  uintptr_t rel = (uintptr_t)p - (uintptr_t)w->arena;
  if (rel < w->arena_used && (rel & (align - 1))) trace_misaligned(w, rel, align, write, __builtin_return_address(0));
}
}  // namespace msl_rt

// Hooks called by -fsanitize=thread instrumentation.
// The instrumented access is just before the return address (the call to the hook).
#define LILY_CALLER ((const char*)__builtin_return_address(0) - 1)
extern "C" {
#define LILY_TSAN_RW(N)                                                                                 \
  LILY_NO_TRACE void __tsan_read##N(void* a) { msl_rt::trace_access(a, N, false, LILY_CALLER, true); } \
  LILY_NO_TRACE void __tsan_write##N(void* a) { msl_rt::trace_access(a, N, true, LILY_CALLER, true); } \
  LILY_NO_TRACE void __tsan_unaligned_read##N(void* a) { msl_rt::trace_access(a, N, false, LILY_CALLER); } \
  LILY_NO_TRACE void __tsan_unaligned_write##N(void* a) { msl_rt::trace_access(a, N, true, LILY_CALLER); }
LILY_TSAN_RW(1)
LILY_TSAN_RW(2)
LILY_TSAN_RW(4)
LILY_TSAN_RW(8)
LILY_TSAN_RW(16)
LILY_NO_TRACE void __tsan_read_range(void* a, unsigned long n) { msl_rt::trace_access(a, n, false, LILY_CALLER); }
LILY_NO_TRACE void __tsan_write_range(void* a, unsigned long n) { msl_rt::trace_access(a, n, true, LILY_CALLER); }
LILY_NO_TRACE void __tsan_func_entry(void*) {}
LILY_NO_TRACE void __tsan_func_exit() {}
LILY_NO_TRACE void __tsan_init() {}
LILY_NO_TRACE void __tsan_vptr_update(void**, void*) {}
LILY_NO_TRACE void __tsan_vptr_read(void**) {}
LILY_NO_TRACE void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
LILY_NO_TRACE void __tsan_atomic_signal_fence(int) {}

// Atomics are not races: perform them, do not record them.
#define LILY_TSAN_ATOMIC(N, T)                                                                                     \
  LILY_NO_TRACE T __tsan_atomic##N##_load(const volatile T* a, int) { return __atomic_load_n(a, __ATOMIC_SEQ_CST); } \
  LILY_NO_TRACE void __tsan_atomic##N##_store(volatile T* a, T v, int) { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); } \
  LILY_NO_TRACE T __tsan_atomic##N##_exchange(volatile T* a, T v, int) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); } \
  LILY_NO_TRACE T __tsan_atomic##N##_fetch_add(volatile T* a, T v, int) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); } \
  LILY_NO_TRACE T __tsan_atomic##N##_fetch_sub(volatile T* a, T v, int) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); } \
  LILY_NO_TRACE T __tsan_atomic##N##_fetch_and(volatile T* a, T v, int) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); } \
  LILY_NO_TRACE T __tsan_atomic##N##_fetch_or(volatile T* a, T v, int) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); } \
  LILY_NO_TRACE T __tsan_atomic##N##_fetch_xor(volatile T* a, T v, int) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); } \
  LILY_NO_TRACE T __tsan_atomic##N##_fetch_nand(volatile T* a, T v, int) { return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST); } \
  LILY_NO_TRACE int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {               \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                        \
  }                                                                                                               \
  LILY_NO_TRACE int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {                 \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                         \
  }                                                                                                               \
  LILY_NO_TRACE T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {                     \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                              \
    return c;                                                                                                     \
  }
LILY_TSAN_ATOMIC(8, uint8_t)
LILY_TSAN_ATOMIC(16, uint16_t)
LILY_TSAN_ATOMIC(32, uint32_t)
LILY_TSAN_ATOMIC(64, uint64_t)
}
