// Metal-compatibility prelude, part 3: the execution model. Each threadgroup's threads run as
// cooperative fibers on one OS thread; barriers and simd ops are rendezvous points (the last
// participant to arrive completes the operation for all). Device buffers are checked pointers.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <new>
#include <source_location>
#include <sys/mman.h>
#include <pthread.h>
#include "metal_math.h"
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace msl_rt {

// ---- launch description shared with the Python driver (ctypes mirror in sim/launch.py) ----
struct Launch {
  void** ptrs;          // per buffer: the pointer the kernel receives
  char** bases;         // per buffer: start of its valid bytes
  int64_t* nbytes;      // per buffer: number of valid bytes
  uint32_t grid[3];
  uint32_t tg[3];
  int32_t n_workers;
  int32_t race_check;   // bit 0: write tracking by diff, bit 1: reverse thread order, bit 2: traced accesses
  int64_t stack_bytes;
  char* err;            // message out
  int32_t err_len;
  int32_t err_kind;     // 0 ok, 1 out of bounds, 2 divergence, 3 race, 4 other, 5 misaligned
  int32_t err_line;     // kernel-text line of the error (0 if unknown)
  int32_t allow_oob_reads;  // out-of-bounds reads of inputs yield zeros (counted) instead of an error
  int64_t oob_reads;        // number of such reads
  int64_t err_pc;           // traced builds: code address of a racing access, relative to lily_sim_launch
};

struct ThreadAttrs {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_threadgroup, dispatch_threads_per_threadgroup, threadgroups_per_grid, threads_per_grid;
  uint3 grid_origin, grid_size;
  uint thread_index_in_threadgroup, simdgroup_index_in_threadgroup, thread_index_in_simdgroup;
  uint simdgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width;
  uint quadgroup_index_in_threadgroup, thread_index_in_quadgroup, quadgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

struct Error { int kind; int line; };

constexpr int kSimdWidth = 32;
constexpr int kSlotBytes = 64;  // largest value a simd op exchanges per lane
constexpr size_t kThreadgroupMemory = 32768;

struct SyncPoint {
  int arrived = 0;
  int participants = 0;
  uint64_t gen = 0;
  int line = 0;
  const char* what = nullptr;
};
struct SimdSlot : SyncPoint {
  uint32_t present = 0;  // lanes that exist in this simdgroup
  alignas(64) unsigned char in[kSimdWidth * kSlotBytes];
  alignas(64) unsigned char aux[kSimdWidth * 8];
  alignas(64) unsigned char out[kSimdWidth * kSlotBytes];
};
struct TgEntry { const void* key; size_t offset; size_t size; const char* name; };

enum FiberState { kReady, kWaiting, kDone };
struct Fiber {
  void* sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t ctx;
#endif
  char* stack = nullptr;
  FiberState state = kReady;
  const uint64_t* wait_gen_ptr = nullptr;
  uint64_t wait_gen = 0;
  int wait_line = 0;
  const char* wait_what = nullptr;
  ThreadAttrs at;
};

using Body = void (*)(Launch*, const ThreadAttrs&);

struct Worker {
  Launch* L = nullptr;
  Body body = nullptr;
#if defined(__x86_64__)
  void* sched_sp = nullptr;
#else
  ucontext_t sched_ctx;
#endif
  Fiber* fibers = nullptr;
  int capacity = 0;
  char* stacks = nullptr;
  size_t stack_bytes = 0;
  Fiber* cur = nullptr;
  // the current threadgroup
  int n = 0;
  SyncPoint barrier;
  SimdSlot* simd = nullptr;  // [32]
  unsigned char* arena = nullptr;
  size_t arena_used = 0;
  TgEntry tg_entries[64];
  int n_tg = 0;
  // error state
  bool failed = false;
  int err_kind = 0, err_line = 0;
  int64_t err_pc = 0;
  char err[2048];
  // race detection: per threadgroup-memory byte, the thread (index + 1) that last wrote it and the
  // barrier interval (epoch) of that write; `snap` is the arena as the running fiber found it.
  uint32_t* shadow_w = nullptr;
  uint32_t* shadow_epoch = nullptr;
  unsigned char* snap = nullptr;
  size_t snap_used = 0;
  uint32_t epoch = 1;
  int cur_index = -1;
  struct TraceCell* trace = nullptr;  // traced builds (LILY_MSL_TRACE): one cell per threadgroup byte
};

inline thread_local Worker* tw = nullptr;
inline pthread_mutex_t g_err_mu = PTHREAD_MUTEX_INITIALIZER;

inline void format_thread(char* buf, size_t len) {
  if (!tw || !tw->cur) { std::snprintf(buf, len, "(host)"); return; }
  const ThreadAttrs& a = tw->cur->at;
  std::snprintf(buf, len, "thread_position_in_grid=(%u,%u,%u) threadgroup=(%u,%u,%u) lane %u of simdgroup %u",
                a.thread_position_in_grid.x, a.thread_position_in_grid.y, a.thread_position_in_grid.z,
                a.threadgroup_position_in_grid.x, a.threadgroup_position_in_grid.y, a.threadgroup_position_in_grid.z,
                a.thread_index_in_simdgroup, a.simdgroup_index_in_threadgroup);
}

[[noreturn]] inline void raise(int kind, int line, const char* msg) {
  Worker* w = tw;
  if (w && !w->failed) {
    w->failed = true;
    w->err_kind = kind;
    w->err_line = line;
    std::snprintf(w->err, sizeof(w->err), "%s", msg);
  }
  throw Error{kind, line};
}
[[noreturn]] inline void fail(const char* kind, const char* msg) {
  char buf[1024];
  std::snprintf(buf, sizeof(buf), "%s: %s", kind, msg);
  raise(4, 0, buf);
}

// ---------------------------------------------------------------------------------------------
// Fibers: a minimal context switch (x86-64: callee-saved registers + mxcsr/x87 control word).
#if defined(__x86_64__)
extern "C" void lily_fiber_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.p2align 4
.globl lily_fiber_switch
.hidden lily_fiber_switch
.type lily_fiber_switch,@function
lily_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size lily_fiber_switch,.-lily_fiber_switch
.p2align 4
.globl lily_fiber_trampoline
.hidden lily_fiber_trampoline
.type lily_fiber_trampoline,@function
lily_fiber_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
.size lily_fiber_trampoline,.-lily_fiber_trampoline
)");
extern "C" void lily_fiber_trampoline();
#endif

inline void fiber_main(Fiber* f) {
  Worker* w = tw;
  try {
    w->body(w->L, f->at);
  } catch (const Error&) {
  }
  f->state = kDone;
#if defined(__x86_64__)
  lily_fiber_switch(&f->sp, w->sched_sp);
#else
  swapcontext(&f->ctx, &w->sched_ctx);
#endif
  __builtin_unreachable();
}

#if !defined(__x86_64__)
inline void fiber_entry_uc(unsigned hi, unsigned lo) {
  fiber_main((Fiber*)(((uintptr_t)hi << 32) | (uintptr_t)lo));
}
#endif

inline void fiber_init(Worker* w, Fiber* f, char* stack) {
  f->stack = stack;
  f->state = kReady;
  f->wait_gen_ptr = nullptr;
#if defined(__x86_64__)
  uintptr_t top = ((uintptr_t)(stack + w->stack_bytes)) & ~(uintptr_t)15;
  uint64_t* sp = (uint64_t*)top;
  sp[-1] = (uint64_t)(uintptr_t)&lily_fiber_trampoline;  // ret target
  sp[-2] = 0;                                             // rbp
  sp[-3] = 0;                                             // rbx
  sp[-4] = (uint64_t)(uintptr_t)f;                        // r12: argument
  sp[-5] = (uint64_t)(uintptr_t)&fiber_main;              // r13: entry
  sp[-6] = 0;                                             // r14
  sp[-7] = 0;                                             // r15
  sp[-8] = 0x1F80ull | (0x037Full << 32);                 // mxcsr, x87 control word
  f->sp = &sp[-8];
#else
  getcontext(&f->ctx);
  f->ctx.uc_stack.ss_sp = stack;
  f->ctx.uc_stack.ss_size = w->stack_bytes;
  f->ctx.uc_link = nullptr;
  uintptr_t p = (uintptr_t)f;
  makecontext(&f->ctx, (void (*)())fiber_entry_uc, 2, (unsigned)(p >> 32), (unsigned)(p & 0xffffffffu));
#endif
}

inline void switch_to(Worker* w, Fiber* f) {
  w->cur = f;
#if defined(__x86_64__)
  lily_fiber_switch(&w->sched_sp, f->sp);
#else
  swapcontext(&w->sched_ctx, &f->ctx);
#endif
  w->cur = nullptr;
}
inline void yield(Worker* w, Fiber* f) {
#if defined(__x86_64__)
  lily_fiber_switch(&f->sp, w->sched_sp);
#else
  swapcontext(&f->ctx, &w->sched_ctx);
#endif
  w->cur = f;
}

// ---------------------------------------------------------------------------------------------
// Rendezvous. Arrive at `sp` from site (what, line); returns true for the last arriver (which
// completes the operation) and false for the others after the operation completed.
inline void divergence_at_arrival(const SyncPoint& sp, const char* what, int line) {
  char who[256], msg[1024];
  format_thread(who, sizeof(who));
  std::snprintf(msg, sizeof(msg),
                "divergence: %s reached %s at line %d while other threads of its %s wait at %s at line %d",
                who, what, line, (&sp == &tw->barrier) ? "threadgroup" : "simdgroup", sp.what, sp.line);
  raise(2, line, msg);
}

inline void wait_for(Worker* w, SyncPoint& sp, const char* what, int line) {
  Fiber* f = w->cur;
  uint64_t g = sp.gen;
  f->state = kWaiting;
  f->wait_gen_ptr = &sp.gen;
  f->wait_gen = g;
  f->wait_line = line;
  f->wait_what = what;
  while (sp.gen == g) {
    yield(w, f);
    if (w->failed) throw Error{0, 0};
  }
  f->state = kReady;
  f->wait_gen_ptr = nullptr;
}

inline bool arrive(Worker* w, SyncPoint& sp, const char* what, int line) {
  if (sp.arrived == 0) {
    sp.what = what;
    sp.line = line;
  } else if (sp.line != line || sp.what != what) {
    divergence_at_arrival(sp, what, line);
  }
  return ++sp.arrived == sp.participants;
}
inline void complete(SyncPoint& sp) {
  sp.arrived = 0;
  sp.gen++;
}

void race_new_epoch(Worker* w);

// ---------------------------------------------------------------------------------------------
// Checked device pointers: bounds and alignment of every access to a kernel buffer. Raw (threadgroup,
// thread) pointers are unchecked and do not convert to them.
[[noreturn]] inline void oob(const char* base, int64_t nbytes, int buf, const void* at, size_t elem, bool is_const,
                             int line) {
  char who[256], msg[1024];
  format_thread(who, sizeof(who));
  int64_t off = (const char*)at - base;
  std::snprintf(msg, sizeof(msg),
                "out-of-bounds %s of buffer %d at byte offset %lld (element %lld of %lld, element size %zu) by %s",
                is_const ? "read" : "access (read or write)", buf, (long long)off,
                (long long)(off >= 0 ? off / (int64_t)elem : -((-off + (int64_t)elem - 1) / (int64_t)elem)),
                (long long)(nbytes / (int64_t)elem), elem, who);
  raise(1, line, msg);
}

// A load or store of a T whose address is not a multiple of alignof(T) (a uint4 read through
// reinterpret_cast at a 4-byte offset, say): Metal requires the alignment (and the CUDA bridge faults).
[[noreturn]] inline void misaligned(int buf, int64_t off, size_t align, int line) {
  char who[256], msg[1024];
  format_thread(who, sizeof(who));
  std::snprintf(msg, sizeof(msg),
                "misaligned access to buffer %d at byte offset %lld: the element type needs %zu-byte alignment, "
                "as on a GPU, by %s", buf, (long long)off, align, who);
  raise(5, line, msg);
}

// An index that remembers the kernel-text line it was written on (for bounds reports).
struct Index {
  int64_t v;
  int line;
  template <class I, std::enable_if_t<std::is_integral_v<I> || std::is_enum_v<I>, int> = 0>
  Index(I i, int l = __builtin_LINE()) : v((int64_t)i), line(l) {}
};

// Address spaces of kernel-buffer pointers, kept apart as in Metal: a `constant T*` (MLX passes
// inputs of fewer than 8 elements there) does not convert to a `device T*` parameter and back.
enum : int { kDevice = 0, kConstant = 1 };
template <class T, int AS = kDevice> struct dptr;
// Storage of a checked pointer (always through a pointer to const; the non-const dptr casts).
template <class C> struct dptr_root {
  C* p = nullptr;
  const char* base = nullptr;
  int64_t nbytes = -1;
  int buf = -1;  // < 0: unchecked
};
// dptr<T> derives from dptr<const T>, so a `device T*` argument deduces a helper's `const device U*`
// parameter (U = T) as in Metal.
template <class T, int AS>
using dptr_parent_t = std::conditional_t<std::is_const_v<T>, dptr_root<T>, dptr<const T, AS>>;

template <class T, int AS> struct dptr : dptr_parent_t<T, AS> {
  using element_type = T;
  static constexpr int address_space = AS;

  dptr() = default;
  dptr(std::nullptr_t) {}
  explicit dptr(T* raw) { this->p = raw; }  // explicit: a threadgroup or thread pointer is no device pointer
  dptr(T* p_, const char* base_, int64_t nbytes_, int buf_) {
    this->p = p_; this->base = base_; this->nbytes = nbytes_; this->buf = buf_;
  }
  template <class U, std::enable_if_t<!std::is_same_v<std::remove_const_t<U>, std::remove_const_t<T>>, int> = 0>
  explicit dptr(const dptr<U, AS>& o) {
    this->p = (T*)o.p; this->base = o.base; this->nbytes = o.nbytes; this->buf = o.buf;
  }

  T* ptr() const { return const_cast<T*>(this->p); }
  T* at(int64_t i, int line = __builtin_LINE()) const {
    T* q = ptr() + i;
    if (this->buf >= 0) {
      const char* c = (const char*)q;
      if (c < this->base || c + sizeof(T) > this->base + this->nbytes) {
        if constexpr (std::is_const_v<T> && sizeof(T) <= 256) {
          if (tw && tw->L->allow_oob_reads) {
            alignas(64) static const char zeros[256] = {};
            __atomic_add_fetch(&tw->L->oob_reads, 1, __ATOMIC_RELAXED);
            return (T*)zeros;
          }
        }
        oob(this->base, this->nbytes, this->buf, q, sizeof(T), std::is_const_v<T>, line);
      }
      if constexpr (alignof(T) > 1) {
        if (((const char*)q - this->base) & (int64_t)(alignof(T) - 1)) {
          misaligned(this->buf, (const char*)q - this->base, alignof(T), line);
        }
      }
    }
    return q;
  }
  T& operator[](Index i) const { return *at(i.v, i.line); }
  T& operator*() const { return *at(0); }
  T* operator->() const { return at(0); }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  dptr operator+(I i) const { dptr r = *this; r.p = ptr() + (int64_t)i; return r; }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  friend dptr operator+(I i, const dptr& d) { return d + i; }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  dptr operator-(I i) const { dptr r = *this; r.p = ptr() - (int64_t)i; return r; }
  ptrdiff_t operator-(const dptr& o) const { return this->p - o.p; }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  dptr& operator+=(I i) { this->p = ptr() + (int64_t)i; return *this; }
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  dptr& operator-=(I i) { this->p = ptr() - (int64_t)i; return *this; }
  dptr& operator++() { this->p = ptr() + 1; return *this; }
  dptr& operator--() { this->p = ptr() - 1; return *this; }
  dptr operator++(int) { dptr r = *this; ++*this; return r; }
  dptr operator--(int) { dptr r = *this; --*this; return r; }
  bool operator==(const dptr& o) const { return this->p == o.p; }
  bool operator!=(const dptr& o) const { return this->p != o.p; }
  bool operator<(const dptr& o) const { return this->p < o.p; }
  bool operator>(const dptr& o) const { return this->p > o.p; }
  bool operator<=(const dptr& o) const { return this->p <= o.p; }
  bool operator>=(const dptr& o) const { return this->p >= o.p; }
  explicit operator bool() const { return this->p != nullptr; }
  explicit operator T*() const { return ptr(); }
};

// reinterpret_cast<> on kernel pointers: keeps the bounds of checked pointers.
template <class To, class From> inline To ptr_cast(From f) {
  if constexpr (requires { To::address_space; From::address_space; }) {
    static_assert(To::address_space == From::address_space,
                  "reinterpret_cast between the device and constant address spaces (Metal refuses it)");
  }
  if constexpr (requires { typename To::element_type; f.base; }) {
    return To((typename To::element_type*)f.p, f.base, f.nbytes, f.buf);
  } else if constexpr (requires { typename To::element_type; }) {
    return To((typename To::element_type*)f);
  } else if constexpr (requires { f.base; }) {
    return reinterpret_cast<To>(const_cast<void*>((const void*)f.p));
  } else {
    return reinterpret_cast<To>(f);
  }
}

template <class T> inline T* raw(T* p) { return p; }
template <class T, int AS> inline T* raw(const dptr<T, AS>& p) { return p.at(0); }

// ---------------------------------------------------------------------------------------------
// Threadgroup memory: one block per declaration site (and type) per threadgroup, poisoned.
template <int Site, class T> struct site_tag { static inline const char tag = 0; };

// Runtime code that touches threadgroup memory on the kernel's behalf is not instrumented in
// race-check builds (its poisoning store is not a kernel write).
#define LILY_NO_INSTRUMENT __attribute__((no_sanitize_thread))

template <class T> LILY_NO_INSTRUMENT inline T& tg_shared(const void* key, const char* name = "?") {
  Worker* w = tw;
  for (int i = 0; i < w->n_tg; ++i)
    if (w->tg_entries[i].key == key) return *reinterpret_cast<T*>(w->arena + w->tg_entries[i].offset);
  size_t off = (w->arena_used + alignof(T) - 1) & ~(alignof(T) - 1);
  if (off + sizeof(T) > kThreadgroupMemory)
    fail("threadgroup memory", "more than 32 KiB of threadgroup memory declared");
  if (w->n_tg == 64) fail("threadgroup memory", "more than 64 threadgroup declarations");
  w->tg_entries[w->n_tg++] = TgEntry{key, off, sizeof(T), name};
  w->arena_used = off + sizeof(T);
  std::memset(w->arena + off, 0xFF, sizeof(T));  // uninitialised on a GPU: poison (NaN / -1)
  return *reinterpret_cast<T*>(w->arena + off);
}

}  // namespace msl_rt

// ---------------------------------------------------------------------------------------------
// Barriers.
namespace metal {
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8 };
inline constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags((uint)a | (uint)b); }
inline constexpr mem_flags operator&(mem_flags a, mem_flags b) { return mem_flags((uint)a & (uint)b); }

inline void threadgroup_barrier(mem_flags = mem_flags::mem_none, std::source_location loc = std::source_location::current()) {
  msl_rt::Worker* w = msl_rt::tw;
  int line = (int)loc.line();
  if (msl_rt::arrive(w, w->barrier, "threadgroup_barrier", line)) {
    msl_rt::complete(w->barrier);
    if (w->L->race_check) msl_rt::race_new_epoch(w);
  } else {
    msl_rt::wait_for(w, w->barrier, "threadgroup_barrier", line);
  }
}
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none, std::source_location loc = std::source_location::current()) {
  msl_rt::Worker* w = msl_rt::tw;
  int line = (int)loc.line();
  msl_rt::SimdSlot& s = w->simd[w->cur->at.simdgroup_index_in_threadgroup];
  if (msl_rt::arrive(w, s, "simdgroup_barrier", line)) msl_rt::complete(s);
  else msl_rt::wait_for(w, s, "simdgroup_barrier", line);
}
}  // namespace metal
