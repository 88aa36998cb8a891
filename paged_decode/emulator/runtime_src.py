"""C++ sources of the dialect-neutral emulator runtime (fibers, barriers, warp collectives,
shared-memory arenas, guarded buffers, fault reports).

``RUNTIME_HEADER`` is included by every kernel translation unit (through a dialect
prelude); ``RUNTIME_CPP`` is compiled once into a shared library loaded with
``RTLD_GLOBAL`` so kernel libraries resolve its symbols. x86_64 System V only.
"""

RUNTIME_HEADER = r"""
#pragma once
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <utility>

namespace pd_emu {

constexpr std::size_t STACK_SIZE = 64 * 1024;        // per fiber, aligned to its size
// Dynamic shared memory starts 16 bytes past a 128-byte boundary where it starts at its
// lower guard: CUDA promises 16 bytes only (on an H100 the dynamic base was off 128
// bytes), so a kernel that assumes more fails here too.
constexpr std::size_t DYN_SMEM_OFFSET = 16;
// Guard regions around each block's shared memory: past the largest shared window of a
// CTA (227 KiB), so any index a kernel can form from a shared offset faults.
constexpr std::size_t SMEM_GUARD = 256 * 1024;
constexpr std::size_t STACK_HEADER = 64;             // Fiber* at the top of each stack
constexpr std::size_t STATIC_SMEM_CAP = 48 * 1024;   // CUDA's static __shared__ limit
constexpr int WARP = 32;

enum State : int { RUNNABLE = 0, WAIT_COLLECTIVE = 1, WAIT_BARRIER = 2, DONE = 3,
                   WAIT_CLUSTER = 4 };
// the most CTAs of a thread-block cluster (CUDA's portable limit)
constexpr int MAX_CLUSTER = 8;
// Fiber orders between synchronization points (launch.py names them).
enum Schedule : int { S_FORWARD = 0, S_REVERSE = 1, S_RANDOM = 2, S_RUNAHEAD = 3 };
enum Collective : int { C_SHFL_XOR = 1, C_SHFL_IDX = 2, C_SHFL_DOWN = 3, C_SHFL_UP = 4,
                        C_SYNCWARP = 5,
                        // reductions over every lane of the warp (Metal simd_sum & co.),
                        // in lane order; every lane gets the result
                        C_SUM_F32 = 6, C_MAX_F32 = 7, C_MIN_F32 = 8,
                        // a Metal SIMD-group matrix operation (the Metal prelude): a
                        // barrier of the warp whose param names the operation (M_* below)
                        C_MATRIX = 9 };
// C_MATRIX params: the operation in bits 0-3, the element types in bits 4-8 (the Metal
// prelude's encoding), the call's source line (mod 2048) in bits 9-19, M_LEAVE on the
// second of an operation's two meetings, M_HEADER when the call is in the header: lanes
// at different calls of one operation do not meet.
enum MatrixOp : int { M_FILL = 1, M_DIAGONAL = 2, M_LOAD = 3, M_STORE = 4, M_MULTIPLY = 5,
                      M_MULTIPLY_ACCUMULATE = 6, M_LINE_SHIFT = 9, M_LINE_MASK = 2047,
                      M_LEAVE = 1 << 20, M_HEADER = 1 << 21 };

struct U3 { unsigned x, y, z; };

struct Block;
struct Warp;
struct Cluster;

struct Fiber {
  void* sp;
  int state;
  int lane;
  int linear;            // linear thread index in the block
  U3 tid;
  Block* block;
  Warp* warp;
  int fence_phase;       // the block's barrier phase at this thread's last __threadfence
  unsigned fence_event;  // the block's event count at this thread's last __threadfence
};

struct Warp {
  std::uint64_t vals[WARP];
  std::uint64_t res[WARP];
  int op[WARP];
  int param[WARP];
  int width[WARP];
  unsigned mask[WARP];
  // what each lane publishes to the others for a two-meeting collective (the Metal
  // prelude's SIMD-group matrices): written before the first meeting, read between the
  // two, so no lane rewrites its slot before every lane has read it
  const void* slot[WARP];
  int arrived;
  int nlanes;
  int index;
};

// A kernel library's static shared memory (see shared_var): its variables, their red
// zones, and CUDA's count of their bytes (to which its cap applies).
constexpr std::size_t STATIC_REDZONE = 64;
constexpr int STATIC_SITES = 256;
// arena bytes for static variables: the cap, red zones and alignment padding
constexpr std::size_t STATIC_ARENA = 2 * STATIC_SMEM_CAP + STATIC_SITES * STATIC_REDZONE;
struct StaticSite { std::size_t off, size; const char* name; };
struct StaticSmem {
  std::mutex mu;                        // reservations (first use of a site)
  std::size_t cuda = 0;                 // the variables' bytes as CUDA counts them
  std::atomic<std::size_t> end{0};      // arena bytes reserved, red zones included
  StaticSite sites[STATIC_SITES];
  std::atomic<int> nsites{0};
};

struct Block {
  U3 bid, bdim, gdim;
  unsigned char* dyn_smem;
  unsigned char* static_smem;
  const StaticSmem* statics;
  Fiber* fibers;
  void (*thunk)(void**);
  void** args;
  void* sched_sp;
  int nthreads;
  int arrived;           // threads waiting at the block barrier
  int exited;
  unsigned phase;        // block barriers released so far
  // acquire bookkeeping (check_acquire): fences and atomics counted in the order they
  // ran, the count at the block's last atomic (0: none yet), and the barrier phase of
  // the first fence after it (-1: none)
  unsigned events;
  unsigned atomic_event;
  int acquire_phase;
  // thread-block clusters: the block's cluster (nullptr outside a cluster launch) and its
  // rank there
  Cluster* cluster;
  int rank;
};

// Launch description, filled by the Python driver (ctypes mirrors these layouts).
struct BufferDesc {
  const char* name;
  std::uintptr_t data;
  std::uint64_t nbytes;
  std::uint64_t itemsize;
  std::uintptr_t map_base;   // whole mapping, guards included
  std::uint64_t map_len;
  std::uint64_t guard;       // guard bytes at each end of the mapping
  std::uint64_t skew;        // bytes past a 16-byte boundary the data starts at on a GPU
};

struct LaunchDesc {
  const char* kernel;
  unsigned grid[3];
  unsigned block[3];
  std::uint64_t dyn_smem;
  int schedule;              // a Schedule
  int cp_async_deferred;     // cp.async lands at its wait (1) or at once (0)
  std::uint64_t seed;        // S_RANDOM's permutations; shifts S_RUNAHEAD's leaders
  int threads;               // OS threads
  int nbuffers;
  const BufferDesc* buffers;
  int end_aligned;           // dynamic shared memory ends at its upper guard (else starts
                             // DYN_SMEM_OFFSET past its lower one), like the buffers
  unsigned cluster;          // CTAs per thread-block cluster along x (1: no clusters)
  double timeout_s;          // the watchdog stops a launch running longer (0: never)
};

// The running fiber, found from the stack pointer (no thread-local storage).
inline Fiber* self() {
  std::uintptr_t sp;
  asm("mov %%rsp, %0" : "=r"(sp));
  return *reinterpret_cast<Fiber**>((sp & ~(std::uintptr_t)(STACK_SIZE - 1)) + STACK_SIZE
                                    - STACK_HEADER);
}

// Out of line, in the runtime library.
void collective_arrive(Fiber* f);
void barrier_arrive(Fiber* f);
// cp.async (the host branch of kernels/common.py): a 16-byte copy (zeros when !pred), the
// commit of the copies issued since the last one as a group, and wait_group n (every
// group but the newest n has landed). Deferred, a copy reads its source at the issue,
// its destination holds poison (0xff) until a wait lands it, in issue order.
void cp_async16(void* dst, const void* src, bool pred);
// ``n`` bytes at ``p`` inside the running block's shared memory, ``n``-byte aligned, or the
// launch fails naming ``what`` (a cp.async destination, an ldmatrix row)
void check_shared(const void* p, std::size_t n, const char* what);
// A load of ``n`` bytes (a power of two) at ``p`` from a launch buffer (``__ldg``) must be
// aligned to ``n`` where the buffer would sit on a GPU (MISALIGN's skew), or the launch
// fails; an address outside every buffer is left to the load itself to fault on.
void check_load(const void* p, std::size_t n);
// An access of ``n`` bytes at ``p`` through a pointer cast to a type of that size
// (``what``: the cast's target) must be ``n``-aligned where the bytes sit on a GPU: in a
// launch buffer (MISALIGN's skew) or the running block's shared memory. Other addresses
// (a thread's locals, registers on a GPU) and null are not checked.
void check_cast(const void* p, std::size_t n, const char* what);
// ``reinterpret_cast<P>(s)`` / ``static_cast<P>(s)`` with check_cast on the result when
// P points to a type whose size is a power of two from 2 to 16 (a GPU access of it must
// be aligned to its size): rewrite.py turns the kernels' pointer casts into these, so a
// vector access the GPU would fault on (a float4 at an 8-byte offset) fails here too;
// g++'s instruction for it may or may not. ``pretty`` names P in the message.
template <typename P>
inline P checked_cast(P p, const char* pretty) {
  using E = std::remove_cv_t<std::remove_pointer_t<P>>;
  if constexpr (std::is_pointer_v<P> && !std::is_void_v<E>) {
    constexpr std::size_t n = sizeof(E);
    if constexpr (n >= 2 && n <= 16 && (n & (n - 1)) == 0)
      if (p != nullptr) check_cast(p, n, pretty);
  }
  return p;
}
template <typename P, typename S>
inline P vector_cast(S s) { return checked_cast<P>(reinterpret_cast<P>(s), __PRETTY_FUNCTION__); }
template <typename P, typename S>
inline P vector_static_cast(S s) { return checked_cast<P>(static_cast<P>(s), __PRETTY_FUNCTION__); }
// __threadfence: the fence itself, and the barrier phase it ran in
void thread_fence();
// An atomic that publishes the block's global writes to other blocks (``what``): every
// live thread of the block must have fenced in the phase before the barrier that
// precedes it (the caller may fence in its own phase), or the launch fails.
void check_release(const char* what);
// A coherent load (``what``: __ldcg) after the block's atomic reads what other blocks
// published: the running thread must have fenced after the atomic, or a thread of the
// block fenced after it and a barrier followed, or the launch fails (the acquire half of
// the publication check_release checks).
void check_acquire(const char* what);
void cp_async_commit();
void cp_async_wait(int n);
// Thread-block clusters: the running block's rank in its cluster (0 outside one); a
// barrier of every thread of the cluster (shared-memory writes before it are visible to
// the whole cluster after it); the address of the same shared byte in CTA ``rank`` of the
// cluster (``p`` must lie in the running block's shared memory).
unsigned cluster_rank();
void cluster_sync();
const void* cluster_map(const void* p, unsigned rank);
[[noreturn]] void fail(const char* fmt, ...);
// ``fail`` with the running thread's place (kernel, block, thread) in front
[[noreturn]] void fail_here(const char* fmt, ...);
// what a lane waits in, for reports: "a shuffle (xor)", "simdgroup_load", ...
const char* collective_name(int op, int param);
// the same with the call's line where the collective carries one
void describe_collective(char* out, std::size_t n, int op, int param);
int run_launch(const LaunchDesc* d, void (*thunk)(void**), void** args,
               const StaticSmem* statics, char* err, std::size_t errlen);

template <typename T>
inline T collective(unsigned mask, T v, int op, int param, int width) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                "warp collectives move values of at most 8 bytes");
  Fiber* f = self();
  Warp* w = f->warp;
  const int lane = f->lane;
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  w->vals[lane] = bits;
  w->op[lane] = op;
  w->param[lane] = param;
  w->width[lane] = width;
  w->mask[lane] = mask;
  collective_arrive(f);
  T r;
  std::memcpy(&r, &w->res[lane], sizeof(T));
  return r;
}

// Static shared memory: every declaration site (and every template instantiation of the
// function holding it: ``Site`` is a local class) reserves an offset once per kernel
// library; the storage lives in the running block's per-OS-thread arena. Each variable
// is followed by a red zone that every block poisons (0xff: a read gives NaN) and checks
// when it ends: a write past one variable, or before the next, fails the launch.
namespace {
StaticSmem g_static_smem;

// The offset of a variable of ``size`` bytes, or STATIC_SMEM_OVER when CUDA's count would
// pass ``cap``: the caller fails after its static initializer has finished (a fail()
// inside one would leave its guard held, and every other thread reaching the site would
// wait on it for ever).
constexpr std::size_t STATIC_SMEM_OVER = ~std::size_t(0);
inline std::size_t reserve_static(std::size_t size, std::size_t align, std::size_t cap,
                                  const char* name) {
  StaticSmem& s = g_static_smem;
  std::lock_guard<std::mutex> g(s.mu);
  const std::size_t cuda_off = (s.cuda + align - 1) / align * align;
  if (cuda_off + size > cap) return STATIC_SMEM_OVER;
  const std::size_t off = (s.end.load() + align - 1) / align * align;
  const int n = s.nsites.load();
  const std::size_t zone = n < STATIC_SITES ? STATIC_REDZONE : 0;
  if (off + size + zone > STATIC_ARENA) return STATIC_SMEM_OVER;
  s.cuda = cuda_off + size;
  if (zone) {
    s.sites[n] = StaticSite{off, size, name};
    s.nsites.store(n + 1);
  }
  s.end.store(off + size + zone);
  return off;
}

template <typename T, typename Site>
inline T& shared_var(const char* name) {
  static const std::size_t off =
      reserve_static(sizeof(T), alignof(T) < 16 ? 16 : alignof(T), STATIC_SMEM_CAP, name);
  if (off == STATIC_SMEM_OVER)
    fail("static __shared__ memory exceeds %zu bytes", (std::size_t)STATIC_SMEM_CAP);
  return *reinterpret_cast<T*>(self()->block->static_smem + off);
}

template <typename... A, std::size_t... I>
inline void invoke_impl(void (*fn)(A...), void** a, std::index_sequence<I...>) {
  fn(*reinterpret_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(a[I])...);
}
template <typename... A>
inline void invoke(void (*fn)(A...), void** a) {
  invoke_impl(fn, a, std::index_sequence_for<A...>{});
}
}  // namespace

// ``extern __shared__ T name[]`` becomes an object of this type: it converts to the
// running block's dynamic shared memory.
template <typename T>
struct DynamicShared {
  operator T*() const { return reinterpret_cast<T*>(self()->block->dyn_smem); }
};

}  // namespace pd_emu
"""

RUNTIME_CPP = r"""
#include "pd_emu_rt.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <dlfcn.h>
#include <link.h>
#include <mutex>
#include <pthread.h>
#include <string>
#include <sys/mman.h>
#include <thread>
#include <ucontext.h>
#include <unistd.h>
#include <vector>

extern "C" void pd_emu_switch(void** save_sp, void* to_sp);
extern "C" void pd_emu_fiber_entry();

// Save the callee-saved registers and the stack pointer, switch stacks, restore.
asm(R"(
  .text
  .globl pd_emu_switch
  .hidden pd_emu_switch
  .type pd_emu_switch, @function
pd_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size pd_emu_switch, .-pd_emu_switch

  .globl pd_emu_fiber_entry
  .hidden pd_emu_fiber_entry
  .type pd_emu_fiber_entry, @function
pd_emu_fiber_entry:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size pd_emu_fiber_entry, .-pd_emu_fiber_entry
)");

namespace pd_emu {
namespace {

// A deferred cp.async: the 16 bytes read at the issue, landed by a later wait.
struct Pending {
  unsigned char* dst;
  unsigned char data[16];
  unsigned group;        // the commit group it belongs to (== committed: not committed yet)
};
struct CpQueue {
  std::vector<Pending> items;   // in issue order
  unsigned committed = 0;
};

struct Worker {
  sigjmp_buf jb;
  Block block{};
  std::uint64_t rng = 0;                // the random schedule's state, per (seed, block)
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<CpQueue> cpq;             // per fiber
  std::vector<int> order;               // the sweep order of the current schedule
  unsigned char* stacks = nullptr;      // aligned pool
  unsigned char* stacks_map = nullptr;
  std::size_t stacks_map_len = 0;
  unsigned char* arena = nullptr;        // guard, dynamic shared memory, guard, static
  std::size_t arena_len = 0;             // shared memory, guard (one mapping)
  unsigned char* dyn = nullptr;          // the block's dynamic shared memory
  std::size_t dyn_len = 0;               // the launch's bytes, rounded up to 16
  unsigned char* stat = nullptr;         // the block's static variables and red zones
  unsigned char* smem_split = nullptr;   // the middle of the guard between the two: a
                                         // fault below is the dynamic region's, above
                                         // the static one's
  struct Body { unsigned char* at; std::size_t len; };
  Body bodies[2] = {};                   // the arena's accessible parts, guards between
  Fiber* cur = nullptr;
  volatile bool in_block = false;
  const LaunchDesc* launch = nullptr;
  // where a failure lands: this worker, or the first worker of its cluster group (whose
  // OS thread runs the whole group and holds the jump buffer)
  Worker* home = this;
  // the OS thread running this worker's blocks, while ``alive`` (the watchdog's lock)
  pthread_t os_thread{};
  bool alive = false;
  char msg[2048];
};

}  // namespace

// A thread-block cluster being run: its blocks' workers (one per CTA, all on the home
// worker's OS thread) and the cluster barrier's count.
struct Cluster {
  int size = 1;
  int nthreads = 0;        // of the whole cluster
  int arrived = 0;         // threads waiting at the cluster barrier
  Worker* workers[MAX_CLUSTER] = {};
  bool gone[MAX_CLUSTER] = {};   // the block has exited (its shared memory is unmapped)
};

namespace {

thread_local Worker* t_worker = nullptr;
std::mutex g_launch_mutex;               // one launch at a time per process
// the signals a kernel's fault raises, and the actions in place before a launch took them
constexpr int FAULT_SIGNALS[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE};
constexpr int NUM_FAULT_SIGNALS = sizeof FAULT_SIGNALS / sizeof FAULT_SIGNALS[0];
struct sigaction g_old_actions[NUM_FAULT_SIGNALS];
struct sigaction* old_action(int sig) {
  for (int i = 0; i < NUM_FAULT_SIGNALS; ++i)
    if (FAULT_SIGNALS[i] == sig) return &g_old_actions[i];
  return nullptr;
}

std::size_t page_size() { return (std::size_t)sysconf(_SC_PAGESIZE); }

// Make the worker's shared memory (both regions, not the guards) accessible or not.
void protect_smem(Worker* w, int prot) {
  for (const Worker::Body& b : w->bodies) mprotect(b.at, b.len, prot);
}

// Leave the block (or cluster) with the message in ``w->msg``: to the jump buffer of the
// worker whose OS thread runs it.
[[noreturn]] void bail(Worker* w) {
  Worker* h = w->home;
  if (h != w) std::memcpy(h->msg, w->msg, sizeof h->msg);
  w->in_block = false;
  siglongjmp(h->jb, 1);
}

void where(Worker* w, char* out, std::size_t n) {
  const Block& b = w->block;
  if (w->cur)
    std::snprintf(out, n, "%s: block (%u,%u,%u) thread (%u,%u,%u)", w->launch->kernel,
                  b.bid.x, b.bid.y, b.bid.z, w->cur->tid.x, w->cur->tid.y, w->cur->tid.z);
  else
    std::snprintf(out, n, "%s: block (%u,%u,%u)", w->launch->kernel, b.bid.x, b.bid.y,
                  b.bid.z);
}

// Which region of the block's shared-memory arena (guards included) holds ``a``:
// "dynamic" below smem_split, "static" from it on, with ``*off`` the byte offset from
// that region's start; nullptr outside the arena.
const char* smem_region(const Worker* w, std::uintptr_t a, long long* off) {
  const std::uintptr_t arena = (std::uintptr_t)w->arena;
  if (w->arena == nullptr || a < arena || a >= arena + w->arena_len) return nullptr;
  const bool dyn = a < (std::uintptr_t)w->smem_split;
  *off = (long long)(a - (std::uintptr_t)(dyn ? w->dyn : w->stat));
  return dyn ? "dynamic" : "static";
}

void describe_fault(Worker* w, std::uintptr_t a, bool write) {
  char loc[512];
  where(w, loc, sizeof loc);
  const char* kind = write ? "write" : "read";
  const LaunchDesc* d = w->launch;
  long long off;
  if (const char* region = smem_region(w, a, &off)) {
    if (region[0] == 'd')
      std::snprintf(w->msg, sizeof w->msg,
                    "%s: out-of-bounds %s of dynamic shared memory at byte offset %lld (the "
                    "launch gave %llu bytes)", loc, kind, off, (unsigned long long)d->dyn_smem);
    else
      std::snprintf(w->msg, sizeof w->msg,
                    "%s: out-of-bounds %s of static shared memory at byte offset %lld (outside "
                    "every variable's storage)", loc, kind, off);
    return;
  }
  if (const Cluster* cl = w->block.cluster) {
    for (int k = 0; k < cl->size; ++k) {
      const Worker* m = cl->workers[k];
      if (m == w || smem_region(m, a, &off) == nullptr) continue;
      if (cl->gone[k])
        std::snprintf(w->msg, sizeof w->msg,
                      "%s: %s of the shared memory of CTA %d of its cluster, which has exited: "
                      "a CTA must not leave while another reads its shared memory (a cluster "
                      "barrier before it exits)", loc, kind, k);
      else
        std::snprintf(w->msg, sizeof w->msg,
                      "%s: out-of-bounds %s of the shared memory of CTA %d of its cluster", loc,
                      kind, k);
      return;
    }
  }
  for (int i = 0; i < d->nbuffers; ++i) {
    const BufferDesc& b = d->buffers[i];
    if (a < b.map_base || a >= b.map_base + b.map_len) continue;
    const long long off = (long long)(a - b.data);
    const long long isz = (long long)b.itemsize;
    const long long elem = off >= 0 ? off / isz : -((-off + isz - 1) / isz);
    std::snprintf(w->msg, sizeof w->msg,
                  "%s: out-of-bounds %s of buffer '%s' at element %lld (byte offset %lld; "
                  "the buffer holds %llu elements of %llu bytes)", loc, kind, b.name, elem,
                  off, (unsigned long long)(b.nbytes / b.itemsize),
                  (unsigned long long)b.itemsize);
    return;
  }
  if (w->stacks && a >= (std::uintptr_t)w->stacks &&
      a < (std::uintptr_t)w->stacks + w->fibers.size() * STACK_SIZE) {
    std::snprintf(w->msg, sizeof w->msg, "%s: fiber stack overflow (%zu bytes per thread)",
                  loc, (std::size_t)STACK_SIZE);
    return;
  }
  // far past every guard (a wild index): name the buffer it is nearest to, by element
  const BufferDesc* near = nullptr;
  unsigned long long dist = ~0ull;
  for (int i = 0; i < d->nbuffers; ++i) {
    const BufferDesc& b = d->buffers[i];
    const unsigned long long m = a < b.data ? b.data - a : a - b.data;
    if (m < dist) dist = m, near = &b;
  }
  if (near) {
    const long long off = (long long)(a - near->data), isz = (long long)near->itemsize;
    std::snprintf(w->msg, sizeof w->msg,
                  "%s: out-of-bounds %s at address %#lx, outside every launch buffer and its "
                  "guard pages (nearest: buffer '%s', element %lld of %llu)", loc, kind,
                  (unsigned long)a, near->name, off >= 0 ? off / isz : -((-off + isz - 1) / isz),
                  (unsigned long long)(near->nbytes / near->itemsize));
    return;
  }
  std::snprintf(w->msg, sizeof w->msg,
                "%s: invalid memory %s at address %#lx (not inside any launch buffer or its "
                "guard pages)", loc, kind, (unsigned long)a);
}

// The launch buffer holding all of [a, a + n), or nullptr.
const BufferDesc* buffer_holding(const LaunchDesc* d, std::uintptr_t a, std::size_t n) {
  for (int i = 0; i < d->nbuffers; ++i) {
    const BufferDesc& b = d->buffers[i];
    if (a >= b.data && a + n <= b.data + b.nbytes) return &b;
  }
  return nullptr;
}

// Whether ``a`` inside ``b`` is ``n``-byte aligned where ``b`` would sit on a GPU: its
// start there is 16-byte aligned unless the launch skews it (MISALIGN).
bool gpu_aligned(const BufferDesc& b, std::uintptr_t a, std::size_t n) {
  return (a - b.data + b.skew) % n == 0;
}

// A copy's source must lie inside one launch buffer: an index far past the guard regions
// would otherwise read whatever memory is mapped there, where a GPU reads out of bounds.
// It must also be aligned to the copy's size where the buffer sits on a GPU: PTX
// requires it.
void check_source(Worker* w, std::uintptr_t a, std::size_t n) {
  if (const BufferDesc* b = buffer_holding(w->launch, a, n)) {
    if (!gpu_aligned(*b, a, n))
      fail_here("misaligned cp.async source: buffer '%s' byte offset %llu (the buffer "
                "starts %llu bytes past a 16-byte boundary); a %zu-byte copy needs a "
                "%zu-byte aligned address", b->name, (unsigned long long)(a - b->data),
                (unsigned long long)b->skew, n, n);
    return;
  }
  describe_fault(w, a, false);
  bail(w);
}

void on_fault(int sig, siginfo_t* si, void* uctx) {
  Worker* w = t_worker;
  if (w == nullptr || !w->in_block) {
    // not ours: put the previous handler back and let the access fault again
    sigaction(sig, old_action(sig), nullptr);
    return;
  }
  if (sig == SIGFPE)
    // an integer division by zero (or INT_MIN / -1): a GPU gives an undefined value and
    // goes on, so the kernel's answer would be wrong there; x86 traps
    fail_here("arithmetic fault: integer division by zero or overflow at %#lx",
              (unsigned long)si->si_addr);
  if (sig == SIGILL)
    // kernels are compiled with g++'s array bounds and object-size checks, which trap
    // (ud2) on an index past a fixed-size array's bound: a thread's local array (an
    // element one past it stored through a struct's assignment too), or one dimension of
    // a static shared one. A GPU gives such an index as a wrong answer or a fault elsewhere.
    fail_here("out-of-bounds index of a fixed-size array (a thread's local array or a "
              "dimension of a static shared one; the bounds check trapped at %#lx)",
              (unsigned long)si->si_addr);
  const ucontext_t* uc = static_cast<const ucontext_t*>(uctx);
  const bool write = (uc->uc_mcontext.gregs[REG_ERR] & 2) != 0;
  describe_fault(w, (std::uintptr_t)si->si_addr, write);
  bail(w);
}

// Land the copies of ``q`` whose group is below ``upto``, in issue order. A destination
// no longer all poison was written while its copy was in flight (a plain store, or
// another copy landed there): on a GPU the two race, so the launch fails.
void land(CpQueue& q, unsigned upto) {
  static const unsigned char poison[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                           0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  std::size_t keep = 0;
  for (std::size_t i = 0; i < q.items.size(); ++i) {
    Pending& p = q.items[i];
    if (p.group < upto) {
      if (std::memcmp(p.dst, poison, sizeof poison) != 0) {
        long long off = 0;
        const char* region = smem_region(t_worker, (std::uintptr_t)p.dst, &off);
        fail_here("shared memory written while a cp.async into it was in flight (%s byte "
                  "offset %lld, this thread's copy of 16 bytes): on a GPU the copy and the "
                  "other write race", region, off);
      }
      std::memcpy(p.dst, p.data, sizeof p.data);
    } else {
      q.items[keep++] = p;
    }
  }
  q.items.resize(keep);
}

void fiber_main(Fiber* f) {
  Block* b = f->block;
  b->thunk(b->args);
  land(t_worker->cpq[f->linear], UINT_MAX);   // the hardware completes what is in flight
  f->state = DONE;
  b->exited++;
  pd_emu_switch(&f->sp, b->sched_sp);
  __builtin_unreachable();
}

void setup_worker(Worker* w, const LaunchDesc* d) {
  const int n = (int)(d->block[0] * d->block[1] * d->block[2]);
  const std::size_t pg = page_size();
  w->fibers.assign(n, Fiber{});
  w->warps.assign((n + WARP - 1) / WARP, Warp{});
  w->cpq.assign(n, CpQueue{});
  w->order.assign(n, 0);
  w->stacks_map_len = (std::size_t)(n + 1) * STACK_SIZE;
  w->stacks_map = (unsigned char*)mmap(nullptr, w->stacks_map_len, PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (w->stacks_map == MAP_FAILED) { w->stacks_map = nullptr; return; }
  w->stacks = (unsigned char*)(((std::uintptr_t)w->stacks_map + STACK_SIZE - 1)
                               & ~(std::uintptr_t)(STACK_SIZE - 1));
  for (int i = 0; i < n; ++i) mprotect(w->stacks + (std::size_t)i * STACK_SIZE, pg, PROT_NONE);
  // [guard][dynamic, whole pages][guard][static cap, whole pages][guard]: an access past
  // either end of the dynamic region (by the end-aligned schedules' placement, past the
  // launch's bytes rounded up to 16) or past the static cap faults
  w->dyn_len = (d->dyn_smem + 15) / 16 * 16;
  const std::size_t guard = (SMEM_GUARD + pg - 1) / pg * pg;
  const std::size_t dyn_body = (DYN_SMEM_OFFSET + w->dyn_len + pg - 1) / pg * pg;
  const std::size_t stat_body = (STATIC_ARENA + pg - 1) / pg * pg;
  w->arena_len = 3 * guard + dyn_body + stat_body;
  w->arena = (unsigned char*)mmap(nullptr, w->arena_len, PROT_NONE,
                                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (w->arena == MAP_FAILED) { w->arena = nullptr; return; }
  unsigned char* dyn_at = w->arena + guard;
  unsigned char* stat_at = dyn_at + dyn_body + guard;
  if (mprotect(dyn_at, dyn_body, PROT_READ | PROT_WRITE) != 0 ||
      mprotect(stat_at, stat_body, PROT_READ | PROT_WRITE) != 0) {
    munmap(w->arena, w->arena_len);
    w->arena = nullptr;
    return;
  }
  w->dyn = d->end_aligned ? dyn_at + dyn_body - w->dyn_len : dyn_at + DYN_SMEM_OFFSET;
  w->stat = stat_at;
  w->bodies[0] = {dyn_at, dyn_body};
  w->bodies[1] = {stat_at, stat_body};
  w->smem_split = stat_at - guard / 2;
  std::memset(dyn_at, 0xff, dyn_body);   // NaN-poisoned, like uninitialized smem
  std::memset(stat_at, 0xff, stat_body);
}

void teardown_worker(Worker* w) {
  if (w->stacks_map) munmap(w->stacks_map, w->stacks_map_len);
  if (w->arena) munmap(w->arena, w->arena_len);
  w->stacks_map = w->stacks = w->arena = w->dyn = w->stat = w->smem_split = nullptr;
}

// splitmix64: the random schedule's permutations, reproducible per (seed, block)
std::uint64_t splitmix(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void diagnose_deadlock(Worker* w) {
  char loc[512];
  w->cur = nullptr;
  where(w, loc, sizeof loc);
  Block& b = w->block;
  for (Warp& wp : w->warps) {
    int at_coll = 0, exited = 0, at_bar = 0;
    for (int l = 0; l < wp.nlanes; ++l) {
      const Fiber& f = w->fibers[wp.index * WARP + l];
      at_coll += f.state == WAIT_COLLECTIVE;
      exited += f.state == DONE;
      at_bar += f.state == WAIT_BARRIER;
    }
    if (at_coll > 0) {
      int first = 0;
      while (w->fibers[wp.index * WARP + first].state != WAIT_COLLECTIVE) ++first;
      char what[256];
      describe_collective(what, sizeof what, wp.op[first], wp.param[first]);
      fail("%s: divergent warp collective: %d of %d lanes of warp %d wait in %s while %d "
           "lanes exited and %d wait at __syncthreads", loc, at_coll, wp.nlanes, wp.index,
           what, exited, at_bar);
    }
  }
  fail("%s: divergent barrier: __syncthreads reached by %d of %d threads; %d threads exited "
       "without reaching it", loc, b.arrived, b.nthreads, b.exited);
}

// After a block: every static variable's red zone must still hold its poison.
void check_red_zones(Worker* w) {
  const StaticSmem* st = w->block.statics;
  const int nsites = st->nsites.load();
  for (int i = 0; i < nsites; ++i) {
    const StaticSite& v = st->sites[i];
    const unsigned char* z = w->stat + v.off + v.size;
    for (std::size_t k = 0; k < STATIC_REDZONE; ++k) {
      if (z[k] == 0xff) continue;
      char loc[512];
      w->cur = nullptr;
      where(w, loc, sizeof loc);
      fail("%s: out-of-bounds write of static __shared__ '%s' (%zu bytes) at byte %zu past "
           "its end (a write past it, or before the variable after it)", loc, v.name,
           v.size, k);
    }
  }
}

// The block's index in the grid's linear order (x fastest).
std::uint64_t block_linear(const LaunchDesc* d, U3 bid) {
  return bid.x + (std::uint64_t)d->grid[0] * (bid.y + (std::uint64_t)d->grid[1] * bid.z);
}

// Make block (bx, by, bz) ready to run on ``w``: its fibers at their entry, its shared
// memory poisoned, its barrier and acquire bookkeeping reset.
void init_block(Worker* w, unsigned bx, unsigned by, unsigned bz) {
  const LaunchDesc* d = w->launch;
  Block& b = w->block;
  b.bid = U3{bx, by, bz};
  b.arrived = 0;
  b.exited = 0;
  b.phase = 0;
  b.events = 0;
  b.atomic_event = 0;
  b.acquire_phase = -1;
  std::memset(w->dyn, 0xff, w->dyn_len);
  std::memset(w->stat, 0xff, b.statics->end.load());
  const int n = b.nthreads;
  for (int i = 0; i < n; ++i) {
    Fiber& f = w->fibers[i];
    f.state = RUNNABLE;
    f.linear = i;
    f.fence_phase = -1;
    f.fence_event = 0;
    f.lane = i % WARP;
    f.tid = U3{i % d->block[0], (i / d->block[0]) % d->block[1],
               i / (d->block[0] * d->block[1])};
    f.block = &b;
    f.warp = &w->warps[i / WARP];
    unsigned char* base = w->stacks + (std::size_t)i * STACK_SIZE;
    unsigned char* top = base + STACK_SIZE - STACK_HEADER;
    *reinterpret_cast<Fiber**>(top) = &f;
    void** sp = reinterpret_cast<void**>(top - 16 - 56);
    sp[0] = nullptr;                                   // r15
    sp[1] = nullptr;                                   // r14
    sp[2] = reinterpret_cast<void*>(&fiber_main);      // r13: entry
    sp[3] = &f;                                        // r12: argument
    sp[4] = nullptr;                                   // rbx
    sp[5] = nullptr;                                   // rbp
    sp[6] = reinterpret_cast<void*>(&pd_emu_fiber_entry);
    f.sp = sp;
    w->cpq[i].items.clear();
    w->cpq[i].committed = 0;
  }
  for (std::size_t k = 0; k < w->warps.size(); ++k) {
    Warp& wp = w->warps[k];
    wp.arrived = 0;
    wp.index = (int)k;
    wp.nlanes = n - (int)k * WARP < WARP ? n - (int)k * WARP : WARP;
  }
  const std::uint64_t blin = block_linear(d, b.bid);
  w->rng = d->seed * 0x2545f4914f6cdd1dull + blin;
  for (int i = 0; i < n; ++i) w->order[i] = d->schedule == S_REVERSE ? n - 1 - i : i;
}

// One sweep of the block's runnable fibers in the schedule's order, each until it waits
// or exits; whether any ran.
bool sweep(Worker* w) {
  const LaunchDesc* d = w->launch;
  Block& b = w->block;
  const int n = b.nthreads;
  const int sched = d->schedule;
  const std::uint64_t blin = block_linear(d, b.bid);
  std::uint64_t& rng = w->rng;
  std::vector<int>& order = w->order;
  const std::uint64_t nw = w->warps.size();
  auto run = [&](Fiber& f) {
    w->cur = &f;
    pd_emu_switch(&b.sched_sp, f.sp);
    w->cur = nullptr;
  };
  bool progressed = false;
  if (sched == S_RUNAHEAD) {
    // The leader's lanes run until each waits at a block barrier (or exited); only then
    // do the others move, until the barrier releases and the next warp leads.
    const int lead = (int)((b.phase + blin + d->seed) % nw);
    const int hi = std::min(n, (lead + 1) * WARP);
    for (int i = lead * WARP; i < hi; ++i)
      if (w->fibers[i].state == RUNNABLE) { run(w->fibers[i]); progressed = true; }
    if (!progressed) {
      const unsigned ph = b.phase;
      for (int i = 0; i < n; ++i) {
        if (w->fibers[i].state != RUNNABLE) continue;
        run(w->fibers[i]);
        progressed = true;
        if (b.phase != ph) break;          // released: the next leader goes first
      }
    }
  } else {
    if (sched == S_RANDOM)
      for (int i = n - 1; i > 0; --i) std::swap(order[i], order[(int)(splitmix(rng) % (i + 1))]);
    for (int k = 0; k < n; ++k) {
      Fiber& f = w->fibers[order[k]];
      if (f.state != RUNNABLE) continue;
      run(f);
      progressed = true;
    }
  }
  return progressed;
}

void run_block(Worker* w, unsigned bx, unsigned by, unsigned bz) {
  init_block(w, bx, by, bz);
  for (;;) {
    const bool progressed = sweep(w);
    if (w->block.exited == w->block.nthreads) { check_red_zones(w); return; }
    if (!progressed) diagnose_deadlock(w);
  }
}

// Run cluster ``i`` (clusters of d->cluster CTAs along x, in linear order) on the home
// worker ``h``'s group: its CTAs' fibers interleave, sweep by sweep, block by block (in
// reverse under the reverse schedule, in a fresh order every sweep under the random
// one), so a CTA can wait at the cluster barrier for the others. A CTA that has exited
// has its shared memory unmapped: another CTA's read of it faults, as a read of a
// departed CTA's memory is undefined on a GPU.
void run_cluster(Worker* h, long long i) {
  const LaunchDesc* d = h->launch;
  Cluster& cl = *h->block.cluster;
  const int k_n = cl.size;
  const unsigned gx = d->grid[0] / (unsigned)k_n, gy = d->grid[1];
  const unsigned qx = (unsigned)(i % gx), by = (unsigned)((i / gx) % gy),
                 bz = (unsigned)(i / gx / gy);
  cl.arrived = 0;
  for (int k = 0; k < k_n; ++k) {
    Worker* m = cl.workers[k];
    if (cl.gone[k]) {              // accessible again for this cluster
      protect_smem(m, PROT_READ | PROT_WRITE);
      cl.gone[k] = false;
    }
    m->in_block = true;
    init_block(m, qx * (unsigned)k_n + (unsigned)k, by, bz);
  }
  // the CTAs' order within a sweep: forward, reversed, or (random) a fresh permutation
  // every sweep, reproducible per (seed, cluster)
  int ctas[MAX_CLUSTER];
  for (int j = 0; j < k_n; ++j) ctas[j] = d->schedule == S_REVERSE ? k_n - 1 - j : j;
  std::uint64_t rng = d->seed * 0x9e3779b97f4a7c15ull + (std::uint64_t)i;
  for (;;) {
    bool progressed = false, live = false;
    if (d->schedule == S_RANDOM)
      for (int j = k_n - 1; j > 0; --j) std::swap(ctas[j], ctas[(int)(splitmix(rng) % (j + 1))]);
    for (int j = 0; j < k_n; ++j) {
      const int k = ctas[j];
      Worker* m = cl.workers[k];
      if (cl.gone[k]) continue;
      t_worker = m;
      progressed |= sweep(m);
      if (m->block.exited == m->block.nthreads) {
        check_red_zones(m);
        protect_smem(m, PROT_NONE);
        cl.gone[k] = true;
        m->in_block = false;
      } else {
        live = true;
      }
    }
    t_worker = h;
    if (!live) return;
    if (!progressed) {
      int waiting = 0, exited = 0;
      for (int k = 0; k < k_n; ++k) {
        const Worker* m = cl.workers[k];
        for (int t = 0; t < m->block.nthreads; ++t) {
          waiting += m->fibers[t].state == WAIT_CLUSTER;
          exited += m->fibers[t].state == DONE;
        }
      }
      if (waiting > 0) {
        char loc[512];
        h->cur = nullptr;
        where(h, loc, sizeof loc);
        fail("%s: divergent cluster barrier: %d of the cluster's %d threads wait at it, %d "
             "exited without reaching it", loc, waiting, cl.nthreads, exited);
      }
      for (int k = 0; k < k_n; ++k)
        if (!cl.gone[k]) { t_worker = cl.workers[k]; diagnose_deadlock(cl.workers[k]); }
    }
  }
}

std::mutex g_err_mutex;

// The watchdog. A kernel that never ends (a loop whose step is zero, a spin on a value no
// thread writes) hangs a GPU, and would hang the process. Past the launch's timeout the
// watchdog signals every OS thread still running blocks, each millisecond. A thread the
// signal finds in the kernel library's own code leaves its block with a report; one it
// finds in the runtime or the C library (a lock or the heap may be half-updated there)
// lets it pass and takes the next. The handler stays installed after the launch, as a
// signal sent just before a thread left may arrive after it; outside a timed-out
// launch it does nothing. Each timed launch installs it again if something replaced it
// (the default action of the signal ends the process).
int watchdog_signal() { return SIGRTMIN + 3; }
std::atomic<bool> g_watchdog_expired{false};
std::uintptr_t g_kernel_lo = 0, g_kernel_hi = 0;   // the running kernel library's code

// [*lo, *hi): the executable segment of the loaded object that holds ``fn``.
void code_range(const void* fn, std::uintptr_t* lo, std::uintptr_t* hi) {
  struct Query { std::uintptr_t at, lo, hi; } q{(std::uintptr_t)fn, 0, 0};
  dl_iterate_phdr([](dl_phdr_info* info, std::size_t, void* data) -> int {
    Query* r = static_cast<Query*>(data);
    for (int i = 0; i < info->dlpi_phnum; ++i) {
      const ElfW(Phdr)& ph = info->dlpi_phdr[i];
      if (ph.p_type != PT_LOAD || !(ph.p_flags & PF_X)) continue;
      const std::uintptr_t a = info->dlpi_addr + ph.p_vaddr;
      if (r->at >= a && r->at < a + ph.p_memsz) {
        r->lo = a;
        r->hi = a + ph.p_memsz;
        return 1;
      }
    }
    return 0;
  }, &q);
  *lo = q.lo;
  *hi = q.hi;
}

void on_watchdog(int, siginfo_t*, void* uctx) {
  Worker* w = t_worker;
  if (w == nullptr || !w->in_block || w->cur == nullptr || !g_watchdog_expired.load())
    return;
  const ucontext_t* uc = static_cast<const ucontext_t*>(uctx);
  const std::uintptr_t pc = (std::uintptr_t)uc->uc_mcontext.gregs[REG_RIP];
  if (pc < g_kernel_lo || pc >= g_kernel_hi) return;
  fail_here("did not finish within %g s (an endless loop, or a wait for a value no thread "
            "writes; a GPU would hang here): stopped by the emulator's watchdog "
            "(PAGED_DECODE_EMULATOR_TIMEOUT)", w->launch->timeout_s);
}

class Watchdog {
 public:
  // ``homes``: the workers whose OS threads run blocks (a cluster's first worker)
  Watchdog(double seconds, std::vector<Worker*> homes) : homes_(std::move(homes)) {
    if (!(seconds > 0)) return;
    struct sigaction now{};
    sigaction(watchdog_signal(), nullptr, &now);
    if (!(now.sa_flags & SA_SIGINFO) || now.sa_sigaction != on_watchdog) {
      struct sigaction sa{};
      sa.sa_sigaction = on_watchdog;
      sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
      sigemptyset(&sa.sa_mask);
      sigaction(watchdog_signal(), &sa, nullptr);
    }
    deadline_ = std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(seconds));
    thread_ = std::thread([this] { run(); });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> g(m_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  // the calling OS thread runs ``w``'s blocks from now on / no longer
  void enter(Worker* w) {
    std::lock_guard<std::mutex> g(m_);
    w->os_thread = pthread_self();
    w->alive = true;
  }
  void leave(Worker* w) {
    std::lock_guard<std::mutex> g(m_);
    w->alive = false;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lk(m_);
    if (cv_.wait_until(lk, deadline_, [this] { return done_; })) return;
    g_watchdog_expired = true;
    while (!done_) {
      for (Worker* w : homes_)
        if (w->alive) pthread_kill(w->os_thread, watchdog_signal());
      cv_.wait_for(lk, std::chrono::milliseconds(1), [this] { return done_; });
    }
  }
  std::vector<Worker*> homes_;
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::chrono::steady_clock::time_point deadline_;
  std::thread thread_;
};

struct Shared {
  const LaunchDesc* d;
  std::atomic<long long> next{0};
  std::atomic<bool> abort{false};
  long long total = 0;
  std::string error;
  Watchdog* watchdog = nullptr;
};

void worker_main(Worker* w, Shared* s) {
  t_worker = w;
  s->watchdog->enter(w);
  stack_t alt{}, old_alt{};
  std::vector<unsigned char> altmem(256 * 1024);
  alt.ss_sp = altmem.data();
  alt.ss_size = altmem.size();
  sigaltstack(&alt, &old_alt);
  const LaunchDesc* d = s->d;
  bool ready = w->stacks != nullptr && w->arena != nullptr;
  if (const Cluster* cl = w->block.cluster)
    for (int k = 0; k < cl->size; ++k)
      ready = ready && cl->workers[k]->stacks != nullptr && cl->workers[k]->arena != nullptr;
  if (!ready) {
    std::lock_guard<std::mutex> g(g_err_mutex);
    if (s->error.empty()) s->error = std::string(d->kernel) + ": out of memory for fibers";
    s->abort = true;
  }
  while (!s->abort.load()) {
    const long long i = s->next.fetch_add(1);
    if (i >= s->total) break;
    if (sigsetjmp(w->jb, 1) != 0) {
      t_worker = w;                // a cluster's failure may come from another CTA's worker
      if (Cluster* cl = w->block.cluster)
        for (int k = 0; k < cl->size; ++k) cl->workers[k]->in_block = false;
      w->in_block = false;
      std::lock_guard<std::mutex> g(g_err_mutex);
      if (s->error.empty()) s->error = w->msg;
      s->abort = true;
      break;
    }
    w->in_block = true;
    if (w->block.cluster != nullptr) {
      run_cluster(w, i);
    } else {
      const unsigned gx = d->grid[0], gy = d->grid[1];
      run_block(w, (unsigned)(i % gx), (unsigned)((i / gx) % gy), (unsigned)(i / gx / gy));
    }
    w->in_block = false;
  }
  s->watchdog->leave(w);
  sigaltstack(&old_alt, nullptr);
  t_worker = nullptr;
}

}  // namespace

void fail(const char* fmt, ...) {
  Worker* w = t_worker;
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(w->msg, sizeof w->msg, fmt, ap);
  va_end(ap);
  bail(w);
}

void fail_here(const char* fmt, ...) {
  Worker* w = t_worker;
  char loc[512], body[1536];
  where(w, loc, sizeof loc);
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(body, sizeof body, fmt, ap);
  va_end(ap);
  std::snprintf(w->msg, sizeof w->msg, "%s: %s", loc, body);
  bail(w);
}

const char* collective_name(int op, int param) {
  switch (op) {
    case C_SHFL_XOR: return "a shuffle (xor)";
    case C_SHFL_IDX: return "a shuffle (indexed)";
    case C_SHFL_DOWN: return "a shuffle (down)";
    case C_SHFL_UP: return "a shuffle (up)";
    case C_SYNCWARP: return "__syncwarp / simdgroup_barrier";
    case C_SUM_F32: return "simd_sum";
    case C_MAX_F32: return "simd_max";
    case C_MIN_F32: return "simd_min";
    case C_MATRIX:
      switch (param & 15) {
        case M_FILL: return "make_filled_simdgroup_matrix";
        case M_DIAGONAL: return "a diagonal simdgroup_matrix constructor";
        case M_LOAD: return "simdgroup_load";
        case M_STORE: return "simdgroup_store";
        case M_MULTIPLY: return "simdgroup_multiply";
        case M_MULTIPLY_ACCUMULATE: return "simdgroup_multiply_accumulate";
        default: return "a simdgroup_matrix operation";
      }
    default: return "an unknown collective";
  }
}

void describe_collective(char* out, std::size_t n, int op, int param) {
  const int line = param >> M_LINE_SHIFT & M_LINE_MASK;
  if (op == C_MATRIX && line != 0)
    std::snprintf(out, n, "%s at line %d of the %s", collective_name(op, param), line,
                  (param & M_HEADER) ? "header" : "body");
  else
    std::snprintf(out, n, "%s", collective_name(op, param));
}

static void resolve_collective(Warp* w) {
  const int n = w->nlanes;
  Worker* wk = t_worker;   // error paths only
  char loc[512];
  for (int l = 0; l < n; ++l) {
    if (w->op[l] != w->op[0] || w->width[l] != w->width[0] ||
        (w->op[l] != C_SHFL_IDX && w->param[l] != w->param[0])) {
      wk->cur = nullptr;
      where(wk, loc, sizeof loc);
      char first[256], other[256];
      describe_collective(first, sizeof first, w->op[0], w->param[0]);
      describe_collective(other, sizeof other, w->op[l], w->param[l]);
      fail("%s: lanes of warp %d meet in different collectives (lane 0: %s, op %d param "
           "%d width %d; lane %d: %s, op %d param %d width %d): divergent warp collectives",
           loc, w->index, first, w->op[0], w->param[0], w->width[0], l, other, w->op[l],
           w->param[l], w->width[l]);
    }
    const unsigned full = n == WARP ? 0xffffffffu : (1u << n) - 1u;
    if ((w->mask[l] & full) != full) {
      wk->cur = nullptr;
      where(wk, loc, sizeof loc);
      fail("%s: warp %d lane %d uses member mask %#x: partial masks are not emulated", loc,
           w->index, l, w->mask[l]);
    }
  }
  const int width = w->width[0];
  if (width <= 0 || width > WARP || (width & (width - 1)) != 0) {
    wk->cur = nullptr;
    where(wk, loc, sizeof loc);
    fail("%s: shuffle width %d is not a power of two <= 32", loc, width);
  }
  const int op0 = w->op[0];
  if (op0 == C_SUM_F32 || op0 == C_MAX_F32 || op0 == C_MIN_F32) {
    float acc;
    std::memcpy(&acc, &w->vals[0], 4);
    for (int l = 1; l < n; ++l) {
      float x;
      std::memcpy(&x, &w->vals[l], 4);
      acc = op0 == C_SUM_F32 ? acc + x : (op0 == C_MAX_F32 ? std::fmax(acc, x)
                                                            : std::fmin(acc, x));
    }
    std::uint64_t bits = 0;
    std::memcpy(&bits, &acc, 4);
    for (int l = 0; l < n; ++l) w->res[l] = bits;
    return;
  }
  for (int l = 0; l < n; ++l) {
    const int seg = l & ~(width - 1);
    int src = l;
    switch (w->op[l]) {
      case C_SHFL_XOR: src = l ^ w->param[l]; if ((src & ~(width - 1)) != seg) src = l; break;
      case C_SHFL_IDX: src = seg + (w->param[l] & (width - 1)); break;
      case C_SHFL_DOWN: src = (l - seg) + w->param[l] < width ? l + w->param[l] : l; break;
      case C_SHFL_UP: src = (l - seg) - w->param[l] >= 0 ? l - w->param[l] : l; break;
      default: break;
    }
    w->res[l] = src < n ? w->vals[src] : w->vals[l];
  }
}

void collective_arrive(Fiber* f) {
  Warp* w = f->warp;
  Block* b = f->block;
  if (++w->arrived == w->nlanes) {
    resolve_collective(w);
    w->arrived = 0;
    Fiber* lanes = b->fibers + w->index * WARP;
    for (int l = 0; l < w->nlanes; ++l) lanes[l].state = RUNNABLE;
  } else {
    f->state = WAIT_COLLECTIVE;
  }
  pd_emu_switch(&f->sp, b->sched_sp);   // the schedule, not the arrival, orders lanes
}

void barrier_arrive(Fiber* f) {
  Block* b = f->block;
  if (++b->arrived == b->nthreads) {
    b->arrived = 0;
    b->phase++;
    for (int i = 0; i < b->nthreads; ++i) b->fibers[i].state = RUNNABLE;
  } else {
    f->state = WAIT_BARRIER;
  }
  pd_emu_switch(&f->sp, b->sched_sp);
}

// ``n`` bytes at ``p`` must lie inside the running block's shared memory (its dynamic
// region or its static variables) and be ``n``-byte aligned: a cp.async destination, an
// ldmatrix row.
void check_shared(const void* p, std::size_t n, const char* what) {
  Worker* w = t_worker;
  const std::uintptr_t a = (std::uintptr_t)p;
  const std::uintptr_t dyn = (std::uintptr_t)w->dyn, stat = (std::uintptr_t)w->stat;
  const bool in_dyn = a >= dyn && a + n <= dyn + w->launch->dyn_smem;
  bool in_stat = false;
  const StaticSmem* st = w->block.statics;
  const int nsites = st->nsites.load();
  for (int i = 0; i < nsites && !in_stat; ++i)
    in_stat = a >= stat + st->sites[i].off && a + n <= stat + st->sites[i].off + st->sites[i].size;
  if (!in_stat && nsites >= STATIC_SITES)   // sites past the table: any reserved byte
    in_stat = a >= stat && a + n <= stat + st->end.load();
  if ((in_dyn || in_stat) && a % n == 0) return;
  long long off = 0;
  const char* region = smem_region(w, a, &off);   // named as describe_fault names a guard hit
  if (!in_dyn && !in_stat) {
    if (region == nullptr)
      fail_here("%s at %#lx is not in shared memory", what, (unsigned long)a);
    if (region[0] == 's')
      fail_here("%s outside shared memory: static byte offset %lld, %zu bytes, in no "
                "variable", what, off, n);
    fail_here("%s outside shared memory: dynamic byte offset %lld, %zu bytes (the launch "
              "gave %llu bytes of dynamic shared memory)", what, off, n,
              (unsigned long long)w->launch->dyn_smem);
  }
  fail_here("misaligned %s: %s shared byte offset %lld is not a multiple of %zu", what,
            region, off, n);
}

void cp_async16(void* dst, const void* src, bool pred) {
  Worker* w = t_worker;
  Pending p;
  check_shared(dst, sizeof p.data, "cp.async destination");
  if (pred) {
    check_source(w, (std::uintptr_t)src, sizeof p.data);
    std::memcpy(p.data, src, sizeof p.data);
  } else {
    std::memset(p.data, 0, sizeof p.data);
  }
  if (!w->launch->cp_async_deferred) {
    std::memcpy(dst, p.data, sizeof p.data);
    return;
  }
  CpQueue& q = w->cpq[w->cur->linear];
  p.dst = static_cast<unsigned char*>(dst);
  p.group = q.committed;
  std::memset(dst, 0xff, sizeof p.data);   // undefined until it lands: NaN to a reader
  q.items.push_back(p);
}

void check_load(const void* p, std::size_t n) {
  const std::uintptr_t a = (std::uintptr_t)p;
  const BufferDesc* b = buffer_holding(t_worker->launch, a, n);
  if (b != nullptr && !gpu_aligned(*b, a, n))
    fail_here("misaligned %zu-byte load (__ldg) of buffer '%s' at byte offset %llu (the "
              "buffer starts %llu bytes past a 16-byte boundary)", n, b->name,
              (unsigned long long)(a - b->data), (unsigned long long)b->skew);
}

// The cast's target type out of vector_cast's __PRETTY_FUNCTION__ ("... [with P = T*; ...")
void cast_target(const char* pretty, char* out, std::size_t n) {
  const char* s = std::strstr(pretty, "P = ");
  s = s ? s + 4 : pretty;
  std::size_t len = std::strcspn(s, ";]");
  if (len >= n) len = n - 1;
  std::memcpy(out, s, len);
  out[len] = 0;
}

void check_cast(const void* p, std::size_t n, const char* what) {
  Worker* w = t_worker;
  const std::uintptr_t a = (std::uintptr_t)p;
  char target[160];
  if (const BufferDesc* b = buffer_holding(w->launch, a, 1)) {
    if (gpu_aligned(*b, a, n)) return;
    cast_target(what, target, sizeof target);
    fail_here("misaligned %zu-byte access through a cast to %s: buffer '%s' byte offset "
              "%llu (the buffer starts %llu bytes past a 16-byte boundary)", n, target,
              b->name, (unsigned long long)(a - b->data), (unsigned long long)b->skew);
  }
  long long off = 0;
  const char* region = smem_region(w, a, &off);
  if (region == nullptr || a % n == 0) return;
  cast_target(what, target, sizeof target);
  fail_here("misaligned %zu-byte access through a cast to %s: %s shared byte offset %lld "
            "is not a multiple of %zu", n, target, region, off, n);
}

void thread_fence() {
  Fiber* f = t_worker->cur;
  Block* b = f->block;
  f->fence_phase = (int)b->phase;
  f->fence_event = ++b->events;
  if (b->atomic_event != 0 && b->acquire_phase < 0) b->acquire_phase = (int)b->phase;
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

void check_acquire(const char* what) {
  Fiber* f = t_worker->cur;
  const Block* b = f->block;
  if (b->atomic_event == 0 || f->fence_event > b->atomic_event) return;
  if (b->acquire_phase >= 0 && (int)b->phase > b->acquire_phase) return;
  fail_here("%s after the block's atomic (which tells it other blocks' writes are "
            "published) with no __threadfence() between: this thread must fence after the "
            "atomic, or one thread fence and the block meet at __syncthreads(), before it "
            "reads them, or it may read stale data", what);
}

void check_release(const char* what) {
  Fiber* f = t_worker->cur;
  Block* b = f->block;
  const int phase = (int)b->phase;
  for (int i = 0; i < b->nthreads; ++i) {
    const Fiber& u = b->fibers[i];
    if (u.state == DONE) continue;
    const bool ok = &u == f ? u.fence_phase >= 0 && u.fence_phase + 1 >= phase
                            : u.fence_phase >= 0 && u.fence_phase + 1 == phase;
    if (!ok)
      fail_here("%s publishes the block's global writes, but thread %d %s: each thread "
                "must __threadfence() and then meet the others at __syncthreads() before "
                "the atomic", what, i,
                u.fence_phase < 0 ? "never ran __threadfence()"
                                  : "ran its __threadfence() before an earlier barrier");
  }
  b->atomic_event = ++b->events;
  b->acquire_phase = -1;
}

unsigned cluster_rank() {
  const Block* b = t_worker->cur->block;
  return b->cluster != nullptr ? (unsigned)b->rank : 0u;
}

void cluster_sync() {
  Fiber* f = t_worker->cur;
  Block* b = f->block;
  Cluster* cl = b->cluster;
  if (cl == nullptr) {            // a cluster of one: the block's barrier
    barrier_arrive(f);
    return;
  }
  if (++cl->arrived == cl->nthreads) {
    cl->arrived = 0;
    for (int k = 0; k < cl->size; ++k) {
      Block& o = cl->workers[k]->block;
      for (int i = 0; i < o.nthreads; ++i) o.fibers[i].state = RUNNABLE;
    }
  } else {
    f->state = WAIT_CLUSTER;
  }
  pd_emu_switch(&f->sp, b->sched_sp);
}

const void* cluster_map(const void* p, unsigned rank) {
  Worker* w = t_worker;
  const Cluster* cl = w->block.cluster;
  const int size = cl != nullptr ? cl->size : 1;
  if (rank >= (unsigned)size)
    fail_here("cluster_map to CTA %u of a cluster of %d", rank, size);
  const std::uintptr_t a = (std::uintptr_t)p, arena = (std::uintptr_t)w->arena;
  long long off = 0;
  if (smem_region(w, a, &off) == nullptr)
    fail_here("cluster_map of %#lx, which is not in this block's shared memory",
              (unsigned long)a);
  const Worker* peer = cl != nullptr ? cl->workers[rank] : w;
  return peer->arena + (a - arena);
}

void cp_async_commit() {
  Worker* w = t_worker;
  if (w->launch->cp_async_deferred) w->cpq[w->cur->linear].committed++;
}

void cp_async_wait(int n) {
  Worker* w = t_worker;
  if (!w->launch->cp_async_deferred) return;
  CpQueue& q = w->cpq[w->cur->linear];
  if (n < 0) n = 0;
  if (q.committed > (unsigned)n) land(q, q.committed - (unsigned)n);
}

int run_launch(const LaunchDesc* d, void (*thunk)(void**), void** args,
               const StaticSmem* statics, char* err, std::size_t errlen) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  const long long nthreads = (long long)d->block[0] * d->block[1] * d->block[2];
  const long long total = (long long)d->grid[0] * d->grid[1] * d->grid[2];
  if (nthreads <= 0 || nthreads > 1024) {
    std::snprintf(err, errlen, "%s: %lld threads per block (must be 1..1024)", d->kernel,
                  nthreads);
    return 1;
  }
  if (d->dyn_smem + STATIC_SMEM_CAP > 227 * 1024 + STATIC_SMEM_CAP) {
    std::snprintf(err, errlen, "%s: %llu bytes of dynamic shared memory (at most 227 KiB)",
                  d->kernel, (unsigned long long)d->dyn_smem);
    return 1;
  }
  if (total == 0) return 0;
  const int k_n = d->cluster < 1 ? 1 : (int)d->cluster;
  if (k_n > MAX_CLUSTER || d->grid[0] % (unsigned)k_n != 0) {
    std::snprintf(err, errlen, "%s: clusters of %d CTAs along x over a grid of %u (at most "
                  "%d, dividing the grid's x)", d->kernel, k_n, d->grid[0], MAX_CLUSTER);
    return 1;
  }
  struct sigaction sa{};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < NUM_FAULT_SIGNALS; ++i) sigaction(FAULT_SIGNALS[i], &sa, &g_old_actions[i]);
  Shared s;
  s.d = d;
  s.total = total / k_n;          // blocks, or clusters of k_n blocks
  int nw = d->threads < 1 ? 1 : d->threads;
  if (nw > s.total) nw = (int)s.total;
  // one worker per CTA: a cluster's k_n workers run on their first one's OS thread
  std::vector<Worker> workers((std::size_t)nw * k_n);
  std::vector<Cluster> clusters(k_n > 1 ? nw : 0);
  for (Worker& w : workers) {
    w.launch = d;
    w.block.bdim = U3{d->block[0], d->block[1], d->block[2]};
    w.block.gdim = U3{d->grid[0], d->grid[1], d->grid[2]};
    w.block.nthreads = (int)nthreads;
    w.block.thunk = thunk;
    w.block.args = args;
    w.block.statics = statics;
    setup_worker(&w, d);
    w.block.fibers = w.fibers.data();
    w.block.dyn_smem = w.dyn;
    w.block.static_smem = w.stat;
  }
  for (int g = 0; g < (int)clusters.size(); ++g) {
    Cluster& cl = clusters[g];
    cl.size = k_n;
    cl.nthreads = k_n * (int)nthreads;
    for (int k = 0; k < k_n; ++k) {
      Worker& m = workers[(std::size_t)g * k_n + k];
      cl.workers[k] = &m;
      m.home = &workers[(std::size_t)g * k_n];
      m.block.cluster = &cl;
      m.block.rank = k;
    }
  }
  code_range(reinterpret_cast<const void*>(thunk), &g_kernel_lo, &g_kernel_hi);
  g_watchdog_expired = false;
  {
    std::vector<Worker*> homes;
    for (int i = 0; i < nw; ++i) homes.push_back(&workers[(std::size_t)i * k_n]);
    Watchdog watchdog(d->timeout_s, homes);
    s.watchdog = &watchdog;
    if (nw == 1) {
      worker_main(&workers[0], &s);
    } else {
      std::vector<std::thread> ts;
      for (int i = 0; i < nw; ++i)
        ts.emplace_back(worker_main, &workers[(std::size_t)i * k_n], &s);
      for (std::thread& t : ts) t.join();
    }
  }
  for (Worker& w : workers) teardown_worker(&w);
  for (int i = 0; i < NUM_FAULT_SIGNALS; ++i)
    sigaction(FAULT_SIGNALS[i], &g_old_actions[i], nullptr);
  if (!s.error.empty()) {
    std::snprintf(err, errlen, "%s", s.error.c_str());
    return 1;
  }
  return 0;
}

}  // namespace pd_emu

extern "C" {

// A buffer between guard regions of ``guard`` bytes. ``end_aligned``: the data ends where
// the upper guard begins (overruns fault at once); otherwise it starts right after the
// lower guard (underruns fault at once).
int pd_emu_alloc(std::uint64_t nbytes, std::uint64_t align, int end_aligned,
                 std::uint64_t guard, pd_emu::BufferDesc* out) {
  const std::size_t pg = pd_emu::page_size();
  guard = (guard + pg - 1) / pg * pg;
  const std::size_t body = (nbytes + align + pg - 1) / pg * pg + pg;
  const std::size_t len = body + 2 * guard;
  unsigned char* m = (unsigned char*)mmap(nullptr, len, PROT_NONE,
                                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return 1;
  if (mprotect(m + guard, body, PROT_READ | PROT_WRITE) != 0) { munmap(m, len); return 1; }
  std::uintptr_t data = (std::uintptr_t)(m + guard);
  if (end_aligned)
    data = ((std::uintptr_t)(m + guard + body) - nbytes) & ~(std::uintptr_t)(align - 1);
  out->data = data;
  out->nbytes = nbytes;
  out->map_base = (std::uintptr_t)m;
  out->map_len = len;
  out->guard = guard;
  return 0;
}

void pd_emu_free(std::uintptr_t base, std::uint64_t len) { munmap((void*)base, len); }

}  // extern "C"
"""
