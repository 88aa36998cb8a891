"""The CPU kernel emulator itself, on tiny CUDA kernels: barrier ordering, shuffle results,
planted out-of-bounds accesses, a planted missing barrier, divergent barriers and warp
collectives (reported, not hung), dynamic and templated static shared memory, thread-block
clusters (a barrier of the cluster, reads of a peer's shared memory)."""

from __future__ import annotations

import re
import signal
import time

import numpy as np
import pytest

from paged_decode import emulator
from paged_decode.emulator import (
    Buffer,
    CompileError,
    DivergenceError,
    EmulatorError,
    ExitedPeerError,
    KernelFault,
    KernelTimeoutError,
    MisalignedError,
    OutOfBoundsError,
    RaceError,
    launch,
)
from paged_decode.emulator.launch import (
    DEFAULT_SCHEDULES,
    LEGACY_SCHEDULES,
    MISALIGN,
    SCHEDULES,
    default_schedules,
)
from paged_decode.emulator.rewrite import refuse_c_style_pointer_casts
from paged_decode.errors import InvalidArgumentError
from paged_decode.kernels.common import CUDA_COMMON
from paged_decode.kernels.mma import CUDA_MMA

pytestmark = pytest.mark.skipif(not emulator.available()[0],
                                reason=f"emulator unavailable: {emulator.available()[1]}")

SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Each thread writes its slot, the block syncs, each reads its neighbour's: correct only
// if the barrier holds every thread until all have written.
template <int N>
__global__ void rotate(const float* __restrict__ x, float* __restrict__ y) {
  __shared__ float s[N];
  const int t = threadIdx.x;
  s[t] = x[blockIdx.x * N + t];
  __syncthreads();
  y[blockIdx.x * N + t] = s[(t + 1) % N];
}

// The same without the barrier: a race through shared memory.
template <int N>
__global__ void rotate_racy(const float* __restrict__ x, float* __restrict__ y) {
  __shared__ float s[N];
  const int t = threadIdx.x;
  s[t] = x[blockIdx.x * N + t];
  y[blockIdx.x * N + t] = s[(t + 1) % N];
}

// Two barriers in a row with a phase counter: every thread sees every write of phase 1.
__global__ void phases(int* __restrict__ out) {
  __shared__ int count[1];
  if (threadIdx.x == 0) count[0] = 0;
  __syncthreads();
  atomicAddEmu(count, 1);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = count[0];
}

__global__ void shuffles(const float* __restrict__ x, float* __restrict__ out) {
  const int t = threadIdx.x;
  const float v = x[t];
  float s = v;
  for (int off = 16; off >= 1; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  out[4 * t + 0] = s;                                        // warp sum
  out[4 * t + 1] = __shfl_xor_sync(0xffffffffu, v, 5);       // butterfly partner
  out[4 * t + 2] = __shfl_sync(0xffffffffu, v, 3);           // broadcast of lane 3
  out[4 * t + 3] = __shfl_down_sync(0xffffffffu, v, 2, 8);   // down within groups of 8
}

__global__ void halves(const __half* __restrict__ h, const __nv_bfloat16* __restrict__ b,
                       const float* __restrict__ f, float* __restrict__ out,
                       __half* __restrict__ h_out, __nv_bfloat16* __restrict__ b_out) {
  const int t = threadIdx.x;
  out[2 * t] = __half2float(h[t]);
  out[2 * t + 1] = __bfloat162float(b[t]);
  h_out[t] = __float2half_rn(f[t]);
  b_out[t] = __float2bfloat16_rn(f[t]);
}

// __byte_perm(x, y, s) of each thread's words and selector.
__global__ void byte_perms(const unsigned* __restrict__ x, const unsigned* __restrict__ y,
                           const unsigned* __restrict__ s, unsigned* __restrict__ out) {
  const int t = threadIdx.x;
  out[t] = __byte_perm(x[t], y[t], s[t]);
}

// Dynamic shared memory, written in reverse and read back after a barrier.
extern __shared__ __align__(16) float dyn[];
__global__ void dynamic(const float* __restrict__ x, float* __restrict__ y, int n) {
  const int t = threadIdx.x;
  dyn[n - 1 - t] = x[t];
  __syncthreads();
  y[t] = dyn[t];
}

__global__ void overrun(const float* __restrict__ x, float* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) y[i] = x[i < n ? i : 0];        // off by one: writes y[n]
}

__global__ void underrun(const float* __restrict__ x, float* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i - 1];                 // reads x[-1]
}

__global__ void early_exit_barrier(float* __restrict__ y) {
  if (threadIdx.x >= 32) return;             // warp 1 leaves before the barrier
  __syncthreads();
  y[threadIdx.x] = 1.f;
}

__global__ void half_warp_shuffle(float* __restrict__ y) {
  float v = (float)threadIdx.x;
  if ((threadIdx.x & 31) < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  y[threadIdx.x] = v;
}

__global__ void split_shuffles(float* __restrict__ y) {
  float v = (float)threadIdx.x;
  if ((threadIdx.x & 31) < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  else v = __shfl_xor_sync(0xffffffffu, v, 2);
  y[threadIdx.x] = v;
}

// Prefetching one tile ahead into a double buffer: the refill of buffer (i + 1) & 1 needs
// a barrier after the reads of iteration i - 1 (SYNC). The shuffles keep a warp's lanes
// in step, as an mma loop does, so forward and reverse order cannot see the race.
template <bool SYNC>
__global__ void ring(const float* __restrict__ x, float* __restrict__ y, int n_tiles) {
  __shared__ float buf[2][64];
  const int t = threadIdx.x;
  float acc = 0.f;
  buf[0][t] = x[t];
  for (int i = 0; i < n_tiles; ++i) {
    if (i + 1 < n_tiles) buf[(i + 1) & 1][t] = x[(i + 1) * 64 + t];
    __syncthreads();                                   // tile i is complete
    const int src = __shfl_xor_sync(0xffffffffu, 63 - t, 0);
    acc += buf[i & 1][src] * (float)(i + 1);           // another warp's element
    acc += __shfl_xor_sync(0xffffffffu, 0.f, 1);
    if (SYNC) __syncthreads();                         // buffer i & 1 is refilled next
  }
  y[t] = acc;
}

// Two cp.async groups per thread; WAIT groups may still be in flight at the first read.
template <int WAIT>
__global__ void staged(const float* __restrict__ x, float* __restrict__ y) {
  __shared__ __align__(16) float s[2][128];
  const int t = threadIdx.x;
  pd::cp_async16(&s[0][4 * t], x + 4 * t, true);
  pd::cp_async_commit();
  pd::cp_async16(&s[1][4 * t], x + 128 + 4 * t, t % 2 == 0);   // odd lanes: zero-fill
  pd::cp_async_commit();
  pd::cp_async_wait<WAIT>();
  y[t] = s[0][4 * t + 1];
  pd::cp_async_wait<0>();
  y[32 + t] = s[1][4 * t + 2];
}

// Thread 0 copies x[0:4] into s[0:4] by cp.async and, before its wait, stores 5 to s[at]
// (at -1: no store); then the block copies s to y.
__global__ void store_in_flight(const float* __restrict__ x, float* __restrict__ y, int at) {
  __shared__ __align__(16) float s[8];
  s[threadIdx.x & 7] = 0.f;
  __syncthreads();
  if (threadIdx.x == 0) {
    pd::cp_async16(s, x, true);
    pd::cp_async_commit();
    if (at >= 0) s[at] = 5.f;
    pd::cp_async_wait<0>();
  }
  __syncthreads();
  if (threadIdx.x < 8) y[threadIdx.x] = s[threadIdx.x];
}

// A copy or a plain read from ``x + off`` (``off`` in elements, 64-bit): a wild index.
__global__ void far_copy(const float* __restrict__ x, float* __restrict__ y, long long off) {
  __shared__ __align__(16) float s[4];
  if (threadIdx.x == 0) pd::cp_async16(s, x + off, true);
  pd::cp_async_commit();
  pd::cp_async_wait<0>();
  __syncthreads();
  if (threadIdx.x == 0) y[0] = s[0];
}

__global__ void far_read(const float* __restrict__ x, float* __restrict__ y, long long off) {
  if (threadIdx.x == 0) y[0] = x[off];
}

// One cp.async by thread 0 from x + src_off (floats) to dst_off (floats) into dynamic
// shared memory (to 0), into y itself (1) or into a static 4-float variable (2); then
// threads 0-3 copy the four floats to y.
__global__ void copy_at(const float* __restrict__ x, float* __restrict__ y, long long src_off,
                        int dst_off, int to) {
  __shared__ __align__(16) float st[4];
  float* const base = to == 2 ? st : dyn;
  if (threadIdx.x == 0)
    pd::cp_async16(to == 1 ? static_cast<void*>(y) : static_cast<void*>(base + dst_off),
                   x + src_off, true);
  pd::cp_async_commit();
  pd::cp_async_wait<0>();
  __syncthreads();
  if (threadIdx.x < 4) y[threadIdx.x] = base[dst_off + threadIdx.x];
}

// Each thread writes its slot of y and fences (fence_at 1; at 0 it fences before an
// earlier barrier instead, at -1 never), the block meets, and thread 0 counts the block:
// the publication the fused merge makes.
__global__ void publish(float* __restrict__ y, int* __restrict__ count, int fence_at) {
  if (fence_at == 0) __threadfence();
  __syncthreads();
  y[blockIdx.x * blockDim.x + threadIdx.x] = 1.f;
  if (fence_at == 1) __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(count, 1);
}

// The same publication (fenced), then the block that counts last reads every block's
// slots with __ldcg: after each of its threads fences (acquire 1), after thread 0 fences
// and the block meets (2), after thread 0 alone fences, no barrier following (3), or
// with no fence at all (0).
__global__ void publish_read(float* __restrict__ y, int* __restrict__ count,
                             float* __restrict__ sum, int acquire) {
  __shared__ int last;
  y[blockIdx.x * blockDim.x + threadIdx.x] = 1.f + blockIdx.x;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(count, 1) + 1 == (int)gridDim.x;
    if (acquire == 2) __threadfence();
  }
  __syncthreads();
  if (!last) return;
  if (acquire == 1 || (acquire == 3 && threadIdx.x == 0)) __threadfence();
  float s = 0.f;
  for (unsigned b = 0; b < gridDim.x; ++b) s += __ldcg(y + b * blockDim.x + threadIdx.x);
  sum[threadIdx.x] = s;
}

// Two static arrays; after a barrier thread 0 writes a[n] (n = 32: one past a's end), then
// every thread sums a and b; thread 0 reads a[m] into y[0] where m >= 0. Through a
// pointer, which the red zones catch (an index of `a` itself traps: past_index).
__global__ void past_static(float* __restrict__ y, int n, int m) {
  __shared__ float a[32];
  __shared__ float b[32];
  float* const pa = a;
  a[threadIdx.x] = 1.f;
  b[threadIdx.x] = 2.f;
  __syncthreads();
  if (threadIdx.x == 0 && n >= 0) pa[n] = 3.f;
  __syncthreads();
  y[threadIdx.x] = a[threadIdx.x] + b[threadIdx.x];
  if (threadIdx.x == 0 && m >= 0) y[0] = pa[m];
}

// Thread 0 reads element n of a local array (local 1) or of the first row of a static
// shared 2 x 32 array (local 0): past the row, s[0][32] is s[1][0] in memory.
__global__ void past_index(float* __restrict__ y, int n, int local) {
  __shared__ float s[2][32];
  float r[4] = {1.f + threadIdx.x, 2.f, 3.f, 4.f};
  s[0][threadIdx.x] = 1.f;
  s[1][threadIdx.x] = 2.f;
  __syncthreads();
  if (threadIdx.x == 0) y[0] = local ? r[n] : s[0][n];
}

// Each thread fills its N float4 accumulators, and OVER = 1 one more: an element one past
// a local array of structs, through the struct's assignment (g++'s bounds checks alone
// take that for an address one past the end, which C++ allows, and let it through).
template <int N, int OVER>
__global__ void struct_past(float* __restrict__ y) {
  float4 acc[N];
#pragma unroll
  for (int j = 0; j < N + OVER; ++j) acc[j] = make_float4(1.f, 2.f, 3.f, (float)j);
  float s = 0.f;
  for (int j = 0; j < N; ++j) s += acc[j].x + acc[j].w;
  y[threadIdx.x] = s;
}

// Every thread divides 100 by n (a division by zero at n = 0).
__global__ void divide_by(int* __restrict__ y, int n) { y[threadIdx.x] = 100 / n; }

// Each thread adds 1 to its y element n times, counting by step (0: a loop without end),
// meeting the block at a barrier in every pass when sync is set.
__global__ void loop_by(float* __restrict__ y, int n, int step, int sync) {
  for (int i = 0; i < n; i += step) {
    y[blockIdx.x * blockDim.x + threadIdx.x] += 1.f;
    if (sync) __syncthreads();
  }
}

// Every thread waits for flag[0] to turn non-zero, which no thread does: a spin-wait.
__global__ void spin_on(const int* __restrict__ flag, float* __restrict__ y) {
  const volatile int* f = flag;
  while (*f == 0) {
  }
  y[threadIdx.x] = 1.f;
}

// Thread t sums w[0..7] where only w[1..7] are zeroed and w[0] is set for n > 0 alone: at
// n = 0 it reads an uninitialized local, which a GPU leaves holding whatever it held.
__global__ void uninit_sum(float* __restrict__ y, int n) {
  float w[8];
#pragma unroll
  for (int k = 1; k < 8; ++k) w[k] = 0.f;
  if (n > 0) w[0] = (float)n;
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += w[k];
  y[threadIdx.x] = s;
}

// Thread 0 loads four floats at x + off with one 16-byte __ldg.
__global__ void ldg_at(const float* __restrict__ x, float* __restrict__ y, int off) {
  if (threadIdx.x == 0) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(x + off));
    y[0] = v.x; y[1] = v.y; y[2] = v.z; y[3] = v.w;
  }
}

// The same through a float4 parameter (no cast): __ldg's own check.
__global__ void ldg_vec(const float4* __restrict__ x, float* __restrict__ y, int i) {
  if (threadIdx.x == 0) {
    const float4 v = __ldg(x + i);
    y[0] = v.x; y[1] = v.y; y[2] = v.z; y[3] = v.w;
  }
}

// Thread 0 moves four floats from x + off to shared float offset s_off (dynamic, to 0; a
// static variable, to 1) through float4 pointers made by casts (reinterpret_cast, or
// static_cast through void* when by_void); threads 0-3 copy them from there to y.
__global__ void cast_at(const float* __restrict__ x, float* __restrict__ y, int off,
                        int s_off, int to, int by_void) {
  __shared__ __align__(16) float st[8];
  float* const base = to == 1 ? st : dyn;
  if (threadIdx.x == 0) {
    const float4* src = by_void ? static_cast<const float4*>(static_cast<const void*>(x + off))
                                : reinterpret_cast<const float4*>(x + off);
    *reinterpret_cast<float4*>(base + s_off) = *src;
  }
  __syncthreads();
  if (threadIdx.x < 4) y[threadIdx.x] = base[s_off + threadIdx.x];
}

// A 4-byte local reinterpreted as two halves: a thread's registers, never checked.
__global__ void cast_local(float* __restrict__ y) {
  const unsigned u = 0x3c003c00u;   // (1.0, 1.0) in float16
  const __half2 h = *reinterpret_cast<const __half2*>(&u);
  if (threadIdx.x == 0) y[0] = __half2float(h.x) + __half2float(h.y);
}

// The order in which threads pass one point (non-atomic: fibers never interleave).
__global__ void tickets(int* __restrict__ out) {
  __shared__ int next[1];
  if (threadIdx.x == 0) next[0] = 0;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = next[0]++;
}

__global__ void grid_ids(int* __restrict__ out) {
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int t = threadIdx.x + blockDim.x * threadIdx.y;
  out[b * blockDim.x * blockDim.y + t] = b * 1000 + t;
}
"""

# a non-atomic increment is correct here: fibers never interleave inside a segment
PRELUDE = "template <typename T> __device__ void atomicAddEmu(T* p, T v) { *p += v; }\n"
SOURCE = CUDA_COMMON + SRC.replace("#include <cuda_bf16.h>\n",
                                   "#include <cuda_bf16.h>\n" + PRELUDE)
LEGACY = {"schedules": LEGACY_SCHEDULES, "cp_async": "sync"}   # the emulator before #18


def run(name, grid, block, args, smem=0, **kw):
    launch(SOURCE, name, grid, block, args, smem, **kw)


def test_barrier_orders_shared_memory_across_blocks():
    x = np.arange(4 * 64, dtype=np.float32)
    y = np.full_like(x, np.nan)
    run("rotate<64>", 4, 64, [Buffer("x", x), Buffer("y", y, True)])
    np.testing.assert_array_equal(y.reshape(4, 64), np.roll(x.reshape(4, 64), -1, axis=1))


def test_two_barriers_phase_counter():
    out = np.zeros(3 * 96, np.int32)
    run("phases", 3, 96, [Buffer("out", out, True)])
    assert (out == 96).all()


def test_shuffle_results():
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    out = np.full(4 * 64, np.nan, np.float32)
    run("shuffles", 1, 64, [Buffer("x", x), Buffer("out", out, True)])
    o = out.reshape(64, 4)
    lanes = np.arange(64)
    w = lanes // 32 * 32
    sums = x.reshape(2, 32).astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(o[:, 0], np.repeat(sums, 32), rtol=1e-5)
    assert (o[:32, 0] == o[0, 0]).all()                      # every lane the same total
    np.testing.assert_array_equal(o[:, 1], x[lanes ^ 5])
    np.testing.assert_array_equal(o[:, 2], x[w + 3])
    seg = lanes & ~7
    down = np.where((lanes - seg) + 2 < 8, lanes + 2, lanes)
    np.testing.assert_array_equal(o[:, 3], x[down])


def test_half_and_bfloat16_conversions_round_to_nearest_even():
    import ml_dtypes
    rng = np.random.default_rng(1)
    f = np.concatenate([rng.standard_normal(56).astype(np.float32) * 100,
                        np.array([65519.0, 65520.0, 1e-8, -0.0, np.inf, -np.inf, 2.0 ** -24,
                                  1.0 + 2.0 ** -11], np.float32)])
    with np.errstate(over="ignore"):
        h = f.astype(np.float16)
    b = f.astype(ml_dtypes.bfloat16)
    out = np.zeros(2 * 64, np.float32)
    h_out = np.zeros(64, np.float16)
    b_out = np.zeros(64, ml_dtypes.bfloat16)
    run("halves", 1, 64, [Buffer("h", h), Buffer("b", b), Buffer("f", f),
                          Buffer("out", out, True), Buffer("h_out", h_out, True),
                          Buffer("b_out", b_out, True)])
    np.testing.assert_array_equal(out[0::2], h.astype(np.float32))
    np.testing.assert_array_equal(out[1::2], b.astype(np.float32))
    np.testing.assert_array_equal(h_out.view(np.uint16), h.view(np.uint16))
    np.testing.assert_array_equal(b_out.view(np.uint16), b.view(np.uint16))


def test_byte_perm_follows_the_cuda_intrinsic():
    """Byte i of ``__byte_perm(x, y, s)`` is byte ``(s >> 4i) & 7`` of ``{y, x}`` (the
    CUDA math API's default mode); the fp8 tensor-core partial regroups V's codes with it."""
    rng = np.random.default_rng(2)
    x, y = (rng.integers(0, 2 ** 32, 64, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    s = rng.integers(0, 2 ** 16, 64, dtype=np.uint64).astype(np.uint32)
    s[:4] = [0x3120, 0x3210, 0x7654, 0x0020]
    out = np.zeros(64, np.uint32)
    run("byte_perms", 1, 64, [Buffer("x", x), Buffer("y", y), Buffer("s", s),
                              Buffer("out", out, True)])
    for i in range(64):
        both = int(x[i]) | int(y[i]) << 32
        want = sum(((both >> (8 * ((int(s[i]) >> (4 * k)) & 7))) & 0xff) << (8 * k)
                   for k in range(4))
        assert int(out[i]) == want, (i, hex(x[i]), hex(y[i]), hex(s[i]))
    b = [(int(x[0]) >> (8 * k)) & 0xff for k in range(4)]
    assert int(out[0]) == b[0] | b[2] << 8 | b[1] << 16 | b[3] << 24   # codes_by_column
    assert int(out[1]) == int(x[1]) and int(out[2]) == int(y[2])


def test_dynamic_shared_memory():
    x = np.arange(128, dtype=np.float32)
    y = np.zeros_like(x)
    run("dynamic", 2, 128, [Buffer("x", x), Buffer("y", y, True), np.int32(128)], smem=512)
    np.testing.assert_array_equal(y, x[::-1])


def test_dynamic_shared_memory_overruns_and_underruns_fault():
    """The forward and random schedules end the dynamic region at a guard (the launch's
    bytes rounded up to 16), reverse and runahead start it 16 bytes past one. Before, the
    region sat in front of static shared memory: a kernel whose host sized its ring 112
    bytes short (the tensor-core partial without its alignment slack) ran clean."""
    x = np.arange(128, dtype=np.float32)
    y = np.zeros_like(x)
    with pytest.raises(OutOfBoundsError, match=r"dynamic: block \(0,0,0\) thread \(0,0,0\): "
                       r"out-of-bounds write of dynamic shared memory at byte offset 512 "
                       r"\(the launch gave 512 bytes\) \[forward schedule\]"):
        run("dynamic", 1, 128, [Buffer("x", x), Buffer("y", y, True), np.int32(129)], smem=512)
    with pytest.raises(OutOfBoundsError, match=r"thread \(127,0,0\): out-of-bounds write of "
                       r"dynamic shared memory at byte offset -32 .*\[reverse schedule\]"):
        run("dynamic", 1, 128, [Buffer("x", x), Buffer("y", y, True), np.int32(120)], smem=512)


def copy_at(src_off, dst_off, to=0, smem=512):
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, np.float32)
    run("copy_at", 1, 32, [Buffer("x", x), Buffer("y", y, True), np.int64(src_off),
                           np.int32(dst_off), np.int32(to)], smem)
    return y[:4]


def test_cp_async_addresses_are_checked():
    """A cp.async copy's source and destination must be 16-byte aligned (PTX) and its
    destination inside the block's shared memory; each bad address fails naming it."""
    np.testing.assert_array_equal(copy_at(4, 8), [4, 5, 6, 7])
    with pytest.raises(MisalignedError, match=r"copy_at: block \(0,0,0\) thread \(0,0,0\): "
                       r"misaligned cp.async source: buffer 'x' byte offset 8 "):
        copy_at(2, 8)
    with pytest.raises(MisalignedError, match=r"misaligned cp.async destination: dynamic "
                       r"shared byte offset 8 is not a multiple of 16"):
        copy_at(4, 2)
    with pytest.raises(OutOfBoundsError, match=r"cp.async destination outside shared memory: "
                       r"dynamic byte offset 512, 16 bytes \(the launch gave 512 bytes"):
        copy_at(4, 128)
    with pytest.raises(OutOfBoundsError, match=r"cp.async destination at 0x[0-9a-f]+ is not "
                       r"in shared memory"):
        copy_at(4, 0, to=1)
    np.testing.assert_array_equal(copy_at(8, 0, to=2), [8, 9, 10, 11])
    with pytest.raises(OutOfBoundsError, match=r"cp.async destination outside shared memory: "
                       r"static byte offset \d+, 16 bytes, in no variable"):
        copy_at(8, 4, to=2)      # the static variable's red zone


def test_cp_async_source_alignment_follows_the_buffers_gpu_placement(monkeypatch):
    """A buffer MISALIGN starts 8 bytes past a 16-byte boundary (a view into a larger
    allocation) is aligned 8 bytes in, and not at its start."""
    monkeypatch.setitem(MISALIGN, "x", 8)
    np.testing.assert_array_equal(copy_at(2, 0), [2, 3, 4, 5])
    with pytest.raises(MisalignedError, match=r"buffer 'x' byte offset 16 \(the buffer starts "
                       r"8 bytes past a 16-byte boundary\)"):
        copy_at(4, 0)


_LDSM = CUDA_COMMON + CUDA_MMA + r"""
extern __shared__ __align__(16) unsigned short tile[];
// 32 rows of 8 16-bit elements in shared memory (at element row_off), one ldmatrix .x4 of
// them (or of x itself, from_global): lane l passes row l's address
__global__ void ld_rows(const unsigned short* __restrict__ x, unsigned* __restrict__ y,
                        int row_off, int from_global) {
  const int lane = threadIdx.x & 31;
  for (int i = lane; i < 256; i += 32) tile[row_off + i] = x[i];
  __syncthreads();
  unsigned r[4];
  const void* row = from_global ? static_cast<const void*>(x + lane * 8)
                                : static_cast<const void*>(tile + row_off + lane * 8);
  pd::ldsm_x4<false>(r, row);
  for (int i = 0; i < 4; ++i) y[lane * 4 + i] = r[i];
}
"""


def test_ldmatrix_rows_must_be_aligned_shared_addresses():
    """The emulated ldmatrix checks each lane's row address as the PTX ISA requires: 16-byte
    aligned, in shared memory."""
    x = np.arange(256, dtype=np.uint16)

    def ld(row_off, from_global=0):
        y = np.zeros(128, np.uint32)
        launch(_LDSM, "ld_rows", 1, 32, [Buffer("x", x), Buffer("y", y, True),
                                         np.int32(row_off), np.int32(from_global)], 1024)
        return y.reshape(32, 4)

    got = ld(8)
    lane = np.arange(32)[:, None]
    first = (np.arange(4)[None, :] * 8 + lane // 4) * 8 + 2 * (lane % 4)   # matrix i, row l / 4
    np.testing.assert_array_equal(got, first | (first + 1) << 16)
    with pytest.raises(MisalignedError, match=r"ld_rows: block \(0,0,0\) thread \(\d+,0,0\): "
                       r"misaligned ldmatrix row: dynamic shared byte offset \d+ is not a "
                       r"multiple of 16"):
        ld(4)
    with pytest.raises(OutOfBoundsError, match=r"ldmatrix row at 0x[0-9a-f]+ is not in shared "
                       r"memory"):
        ld(0, from_global=1)


def test_an_atomic_publishing_unfenced_writes_fails():
    """An atomicAdd is checked as a release of the block's global writes: each thread must
    fence, then meet the others at a barrier, before it."""
    def publish(fence_at):
        y = np.zeros(3 * 64, np.float32)
        count = np.zeros(1, np.int32)
        run("publish", 3, 64, [Buffer("y", y, True), Buffer("count", count, True),
                               np.int32(fence_at)])
        return y, count

    y, count = publish(1)
    assert (y == 1).all() and count[0] == 3
    with pytest.raises(KernelFault, match=r"publish: block \(\d,0,0\) thread \(0,0,0\): "
                       r"atomicAdd publishes the block's global writes, but thread 0 never "
                       r"ran __threadfence\(\)"):
        publish(-1)
    with pytest.raises(KernelFault, match=r"thread 0 ran its __threadfence\(\) before an "
                       r"earlier barrier"):
        publish(0)


def test_reading_published_writes_without_an_acquire_fence_fails():
    """The last block's __ldcg reads of what the others published (after the atomic that
    told it so) are checked as the acquire: the reading thread fenced after the atomic,
    or a thread fenced and the block met at a barrier since."""
    def read(acquire):
        y = np.zeros(3 * 64, np.float32)
        count = np.zeros(1, np.int32)
        total = np.full(64, np.nan, np.float32)
        run("publish_read", 3, 64, [Buffer("y", y, True), Buffer("count", count, True),
                                    Buffer("sum", total, True), np.int32(acquire)])
        return total

    for acquire in (1, 2):
        np.testing.assert_array_equal(read(acquire), 1 + 2 + 3)
    for acquire in (0, 3):
        with pytest.raises(KernelFault, match=r"publish_read: block \(\d,0,0\) thread "
                           r"\(\d+,0,0\): __ldcg after the block's atomic \(which tells it "
                           r"other blocks' writes are published\) with no __threadfence\(\) "
                           r"between"):
            read(acquire)


def test_static_shared_variables_have_red_zones():
    """Each static __shared__ variable is followed by a poisoned red zone: a write past it
    fails when the block ends (it landed in padding or the next variable before), a read
    past it gives NaN."""
    def past(n, m=-1):
        y = np.zeros(32, np.float32)
        run("past_static", 1, 32, [Buffer("y", y, True), np.int32(n), np.int32(m)])
        return y

    y = past(5)
    assert y[5] == 5 and (np.delete(y, 5) == 3).all()
    with pytest.raises(OutOfBoundsError, match=r"past_static: block \(0,0,0\): out-of-bounds "
                       r"write of static __shared__ 'a' \(128 bytes\) at byte 0 past its end"):
        past(32)
    with pytest.raises(OutOfBoundsError, match=r"'a' \(128 bytes\) at byte 8 past its end"):
        past(34)
    assert np.isnan(past(-1, m=32)[0])


def test_a_store_into_a_copy_in_flight_fails():
    """A plain store to shared memory a cp.async is still writing races with the copy on
    a GPU; the deferred copy finds its destination no longer poisoned when it lands."""
    def store(at):
        x = np.arange(1, 5, dtype=np.float32)
        y = np.zeros(8, np.float32)
        run("store_in_flight", 1, 32, [Buffer("x", x), Buffer("y", y, True), np.int32(at)])
        return y

    np.testing.assert_array_equal(store(-1), [1, 2, 3, 4, 0, 0, 0, 0])
    np.testing.assert_array_equal(store(5), [1, 2, 3, 4, 0, 5, 0, 0])
    for at in (0, 3):
        with pytest.raises(RaceError, match=r"store_in_flight: block \(0,0,0\) thread "
                           r"\(0,0,0\): shared memory written while a cp.async into it was "
                           r"in flight \(static byte offset 0, this thread's copy"):
            store(at)


def test_an_index_past_a_fixed_size_array_fails():
    """Kernels are compiled with g++'s array bounds checks: an index past a thread's local
    array, or past one dimension of a static shared array while still inside the whole
    (s[0][32] is s[1][0]), fails as out of bounds where a GPU would read a neighbour."""
    def at(n, local):
        y = np.zeros(1, np.float32)
        run("past_index", 1, 32, [Buffer("y", y, True), np.int32(n), np.int32(local)])
        return y[0]

    assert at(3, 1) == 4 and at(31, 0) == 1
    for n, local in ((4, 1), (-1, 1), (32, 0)):
        with pytest.raises(OutOfBoundsError, match=r"past_index: block \(0,0,0\) thread "
                           r"\(0,0,0\): out-of-bounds index of a fixed-size array"):
            at(n, local)


def test_an_element_one_past_a_local_struct_array_fails():
    """Kernels are compiled with g++'s object-size checks as well: a float4 stored one past
    a thread's local float4[N] through its assignment fails (bounds checks alone pass it),
    as the merge's accumulator loop one step too far must."""
    y = np.full(32, np.nan, np.float32)
    run("struct_past<4, 0>", 1, 32, [Buffer("y", y, True)])
    np.testing.assert_array_equal(y, np.full(32, 4 * 1.0 + 6.0, np.float32))
    with pytest.raises(OutOfBoundsError, match=r"struct_past<4, 1>: block \(0,0,0\) thread "
                       r"\(0,0,0\): out-of-bounds index of a fixed-size array"):
        run("struct_past<4, 1>", 1, 32, [Buffer("y", y, True)])


@pytest.mark.parametrize("cast, shown", [
    ("*(float4*)x", "float4*"), ("*( const float4 * )(x + 4)", "const float4 *"),
    ("*(float4* const)x", "float4* const"), ("((float4*)x)[0]", "float4*")])
def test_a_c_style_pointer_cast_is_refused(cast, shown):
    """The emulator checks the alignment of every reinterpret_cast / static_cast to a
    pointer; it cannot see a C-style one, so a kernel source holding one is refused,
    naming its line, instead of passing a misaligned access a GPU would fault on."""
    src = ("__global__ void c_cast(const float* __restrict__ x, float* __restrict__ y) {\n"
           f"  const float4 v = {cast};\n"
           "  y[threadIdx.x] = v.x;\n}\n")
    x, y = np.zeros(8, np.float32), np.zeros(32, np.float32)
    with pytest.raises(CompileError, match=rf"kernel source line 2: C-style cast "
                       rf"'\({re.escape(shown)}\)'; write reinterpret_cast"):
        launch(src, "c_cast", 1, 32, [Buffer("x", x), Buffer("y", y, True)])
    ok = src.replace(cast, "*reinterpret_cast<const float4*>(x)")
    launch(ok, "c_cast", 1, 32, [Buffer("x", x), Buffer("y", y, True)])


@pytest.mark.parametrize("code", [
    "void f(float*);", "int n = sizeof(float*) * 3;", "// (float4*)p", "/* (float4*)p */",
    "float a = (b * c) + d;", "thread float (&s)[4]", "float x = (float)y;",
    "bool z = (float*)0 == p;"])
def test_what_is_no_c_style_pointer_cast_passes(code):
    """Declarations, sizeof, comments, products, references to arrays, scalar casts and a
    null pointer are not C-style pointer casts of an operand."""
    refuse_c_style_pointer_casts(code)


def test_an_integer_division_by_zero_fails_as_a_fault():
    """x86 traps an integer division by zero, which would kill the process; the emulator
    reports it as the kernel's fault, naming the thread (a GPU gives an undefined value)."""
    y = np.zeros(32, np.int32)
    run("divide_by", 1, 32, [Buffer("y", y, True), np.int32(7)])
    assert (y == 14).all()
    with pytest.raises(KernelFault, match=r"divide_by: block \(0,0,0\) thread \(\d+,0,0\): "
                       r"arithmetic fault: integer division by zero"):
        run("divide_by", 1, 32, [Buffer("y", y, True), np.int32(0)])


@pytest.mark.parametrize("sync, threads, cluster", [(0, 1, 1), (1, 2, 1), (1, 1, 2)],
                         ids=["loop", "loop-with-barrier-two-os-threads", "cluster"])
def test_a_loop_without_end_is_stopped_by_the_watchdog(sync, threads, cluster):
    """A loop whose step is zero hangs a GPU; the emulator's watchdog stops the launch
    after its timeout and names a thread it stopped, whether the loop spends its time in
    the kernel's own code or (with a barrier in every pass) mostly in the runtime's
    scheduler, on one OS thread or two, in a cluster or not. The same launch with a
    step of one runs to its answer."""
    y = np.zeros(4 * 32, np.float32)
    kw = {"threads": threads, "cluster": cluster, "timeout": 1}
    run("loop_by", 4, 32, [Buffer("y", y, True), np.int32(5), np.int32(1), np.int32(sync)],
        **kw)
    assert (y == 5).all()
    t0 = time.monotonic()
    with pytest.raises(KernelTimeoutError, match=r"loop_by: block \(\d,0,0\) thread "
                       r"\(\d+,0,0\): did not finish within 1 s \(an endless loop"):
        run("loop_by", 4, 32, [Buffer("y", y, True), np.int32(5), np.int32(0), np.int32(sync)],
            **kw)
    assert time.monotonic() - t0 < 30


def test_a_spin_wait_nobody_releases_is_stopped_and_the_next_launch_runs(monkeypatch):
    """A wait on a value no thread writes is stopped too (the timeout from
    PAGED_DECODE_EMULATOR_TIMEOUT); the launches after it run as before, also after
    something reset the watchdog's signal, and a bad value of the setting is refused
    naming it."""
    flag, y = np.zeros(1, np.int32), np.zeros(32, np.float32)
    monkeypatch.setenv("PAGED_DECODE_EMULATOR_TIMEOUT", "1")
    with pytest.raises(KernelTimeoutError, match=r"spin_on: .* did not finish within 1 s"):
        run("spin_on", 1, 32, [Buffer("flag", flag), Buffer("y", y, True)])
    flag[0] = 1
    run("spin_on", 1, 32, [Buffer("flag", flag), Buffer("y", y, True)])
    assert (y == 1).all()
    # another library resetting the watchdog's signal (whose default action ends the
    # process): the next timed launch installs its handler again
    signal.signal(signal.SIGRTMIN + 3, signal.SIG_DFL)
    flag[0] = 0
    with pytest.raises(KernelTimeoutError, match=r"spin_on: .* did not finish within 1 s"):
        run("spin_on", 1, 32, [Buffer("flag", flag), Buffer("y", y, True)])
    monkeypatch.setenv("PAGED_DECODE_EMULATOR_TIMEOUT", "0")
    with pytest.raises(InvalidArgumentError, match="PAGED_DECODE_EMULATOR_TIMEOUT must be "
                       "a positive integer, got '0'"):
        run("spin_on", 1, 32, [Buffer("flag", flag), Buffer("y", y, True)])
    monkeypatch.delenv("PAGED_DECODE_EMULATOR_TIMEOUT")
    with pytest.raises(EmulatorError, match="timeout must be a positive number of seconds"):
        run("spin_on", 1, 32, [Buffer("flag", flag), Buffer("y", y, True)], timeout=0)


def test_an_uninitialized_local_reads_as_a_pattern_not_zero():
    """Locals start as a fixed non-zero pattern (g++'s -ftrivial-auto-var-init=pattern), so
    a kernel that reads one before writing it gives a visibly wrong answer, as a GPU's
    leftover register would, instead of the zero fresh stack memory holds."""
    y = np.full(32, np.nan, np.float32)
    run("uninit_sum", 1, 32, [Buffer("y", y, True), np.int32(3)])
    assert (y == 3).all()
    run("uninit_sum", 1, 32, [Buffer("y", y, True), np.int32(0)])
    assert (np.abs(y) > 1e30).all(), y


def test_vector_ldg_alignment_follows_the_buffers_gpu_placement(monkeypatch):
    """A 16-byte __ldg must be 16-byte aligned where the buffer sits on a GPU; g++'s own
    instruction for it may or may not fault, so the emulator checks, at the cast that
    made the pointer and, for a pointer no cast made, in __ldg itself."""
    x = np.arange(16, dtype=np.float32)

    def ldg(off, kernel="ldg_at"):
        y = np.zeros(4, np.float32)
        run(kernel, 1, 32, [Buffer("x", x), Buffer("y", y, True), np.int32(off)])
        return y

    np.testing.assert_array_equal(ldg(4), [4, 5, 6, 7])
    with pytest.raises(MisalignedError, match=r"ldg_at: block \(0,0,0\) thread \(0,0,0\): "
                       r"misaligned 16-byte access through a cast to const float4\*: buffer "
                       r"'x' byte offset 8 "):
        ldg(2)
    np.testing.assert_array_equal(ldg(1, "ldg_vec"), [4, 5, 6, 7])
    monkeypatch.setitem(MISALIGN, "x", 8)
    np.testing.assert_array_equal(ldg(2), [2, 3, 4, 5])
    with pytest.raises(MisalignedError, match=r"byte offset 16 \(the buffer starts 8 bytes"):
        ldg(4)
    with pytest.raises(MisalignedError, match=r"ldg_vec: block \(0,0,0\) thread \(0,0,0\): "
                       r"misaligned 16-byte load \(__ldg\) of buffer 'x' at byte offset 16 "
                       r"\(the buffer starts 8 bytes"):
        ldg(1, "ldg_vec")


def cast_at(off, s_off, to=0, by_void=0):
    x = np.arange(16, dtype=np.float32)
    y = np.zeros(4, np.float32)
    run("cast_at", 1, 32, [Buffer("x", x), Buffer("y", y, True), np.int32(off),
                           np.int32(s_off), np.int32(to), np.int32(by_void)], 64)
    return y


def test_pointer_casts_check_alignment_where_the_bytes_sit_on_a_gpu(monkeypatch):
    """A float4 access through a cast pointer must be 16-byte aligned in a launch buffer
    (where it would sit on a GPU) and in shared memory, dynamic or static; a GPU faults
    on it, g++ may not. A cast of a thread's own local is not checked."""
    np.testing.assert_array_equal(cast_at(4, 8), [4, 5, 6, 7])
    np.testing.assert_array_equal(cast_at(8, 4, to=1), [8, 9, 10, 11])
    np.testing.assert_array_equal(cast_at(4, 8, by_void=1), [4, 5, 6, 7])
    with pytest.raises(MisalignedError, match=r"cast_at: block \(0,0,0\) thread \(0,0,0\): "
                       r"misaligned 16-byte access through a cast to const float4\*: buffer "
                       r"'x' byte offset 24 \(the buffer starts 0 bytes"):
        cast_at(6, 8)
    with pytest.raises(MisalignedError, match=r"buffer 'x' byte offset 8 "):
        cast_at(2, 8, by_void=1)
    with pytest.raises(MisalignedError, match=r"misaligned 16-byte access through a cast to "
                       r"float4\*: dynamic shared byte offset 8 is not a multiple of 16"):
        cast_at(4, 2)
    with pytest.raises(MisalignedError, match=r"a cast to float4\*: static shared byte offset "
                       r"\d+ is not a multiple of 16"):
        cast_at(4, 1, to=1)
    monkeypatch.setitem(MISALIGN, "x", 8)
    np.testing.assert_array_equal(cast_at(2, 8), [2, 3, 4, 5])
    with pytest.raises(MisalignedError, match=r"buffer 'x' byte offset 16 \(the buffer starts "
                       r"8 bytes past a 16-byte boundary\)"):
        cast_at(4, 8)
    y = np.zeros(1, np.float32)
    run("cast_local", 1, 32, [Buffer("y", y, True)])
    assert y[0] == 2.0


def test_static_variables_past_the_red_zone_table_still_take_copies():
    """A library's first 256 static sites get red zones; one past them is still shared
    memory to cp.async (checked against the reserved bytes instead)."""
    n = 258
    decls = "".join(f"  __shared__ __align__(16) float v{i}[4];\n  v{i}[threadIdx.x & 3] = 0.f;\n"
                    for i in range(n))
    src = CUDA_COMMON + r"""
__global__ void many_sites(const float* __restrict__ x, float* __restrict__ y) {
""" + decls + f"""  __syncthreads();
  if (threadIdx.x == 0) pd::cp_async16(v{n - 1}, x, true);
  pd::cp_async_commit();
  pd::cp_async_wait<0>();
  __syncthreads();
  if (threadIdx.x < 4) y[threadIdx.x] = v{n - 1}[threadIdx.x] + v0[threadIdx.x];
}}
"""
    x = np.arange(4, dtype=np.float32) + 1
    y = np.zeros(4, np.float32)
    launch(src, "many_sites", 1, 32, [Buffer("x", x), Buffer("y", y, True)])
    np.testing.assert_array_equal(y, x)


def test_multi_dimensional_grid_and_block():
    out = np.full(2 * 3 * 2 * 8 * 4, -1, np.int32)
    run("grid_ids", (2, 3, 2), (8, 4), [Buffer("out", out, True)])
    np.testing.assert_array_equal(out, [b * 1000 + t for b in range(12) for t in range(32)])


def test_out_of_bounds_write_names_kernel_buffer_and_index():
    x = np.arange(100, dtype=np.float32)
    y = np.zeros(100, np.float32)
    with pytest.raises(OutOfBoundsError) as e:
        run("overrun", 4, 32, [Buffer("x", x), Buffer("y", y, True), np.int32(100)])
    msg = str(e.value)
    assert "overrun" in msg and "write" in msg and "'y'" in msg and "element 100" in msg
    assert "block (3,0,0) thread (4,0,0)" in msg


def test_out_of_bounds_read_before_the_start():
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, np.float32)
    with pytest.raises(OutOfBoundsError, match=r"underrun.*read of buffer 'x' at element -1"):
        run("underrun", 1, 64, [Buffer("x", x), Buffer("y", y, True), np.int32(64)])


def test_missing_barrier_is_caught_by_the_two_schedules():
    x = np.arange(64, dtype=np.float32)
    y = np.zeros_like(x)
    with pytest.raises(RaceError, match=r"rotate_racy<64>.*buffer 'y'"):
        run("rotate_racy<64>", 1, 64, [Buffer("x", x), Buffer("y", y, True)])
    # one schedule alone cannot see it
    run("rotate_racy<64>", 1, 64, [Buffer("x", x), Buffer("y", y, True)], check_races=False)


def test_divergent_barrier_is_reported_not_hung():
    y = np.zeros(64, np.float32)
    with pytest.raises(DivergenceError, match=r"early_exit_barrier: block \(0,0,0\).*"
                                              r"32 of 64 threads; 32 threads exited"):
        run("early_exit_barrier", 1, 64, [Buffer("y", y, True)])


def test_partial_warp_collective_is_reported():
    y = np.zeros(64, np.float32)
    with pytest.raises(DivergenceError, match=r"half_warp_shuffle.*16 of 32 lanes of warp 0"):
        run("half_warp_shuffle", 1, 64, [Buffer("y", y, True)])


def test_lanes_in_different_shuffles_are_reported():
    y = np.zeros(32, np.float32)
    with pytest.raises(DivergenceError, match=r"split_shuffles.*different collectives"):
        run("split_shuffles", 1, 32, [Buffer("y", y, True)])


def test_compile_error_carries_compiler_output():
    with pytest.raises(CompileError, match="no_such_identifier"):
        launch("__global__ void bad(float* y) { y[0] = no_such_identifier; }", "bad", 1, 32,
               [Buffer("y", np.zeros(1, np.float32), True)])


# ---------------------------------------------------------------------------- schedules
def _ring(sync, **kw):
    x = np.random.default_rng(2).standard_normal(5 * 64).astype(np.float32)
    y = np.full(64, np.nan, np.float32)
    run(f"ring<{'true' if sync else 'false'}>", 1, 64,
        [Buffer("x", x), Buffer("y", y, True), np.int32(5)], **kw)
    want = sum(x.reshape(5, 64)[i, ::-1].astype(np.float64) * (i + 1) for i in range(5))
    return y, want


def test_runahead_catches_a_refill_without_barrier_that_lockstep_orders_miss():
    y, want = _ring(True)                          # correct: every schedule agrees
    np.testing.assert_allclose(y, want, rtol=1e-6)
    y, want = _ring(False, **LEGACY)               # forward and reverse keep warps in step
    np.testing.assert_allclose(y, want, rtol=1e-6)
    for name in ("forward", "reverse", "random"):
        _ring(False, schedules=("forward", name))
    with pytest.raises(RaceError, match=r"ring<false>.*'y' differs between the forward and "
                                        r"the runahead fiber schedule"):
        _ring(False)


def _staged(wait, **kw):
    x = np.arange(256, dtype=np.float32)
    y = np.full(64, -1.0, np.float32)
    run(f"staged<{wait}>", 1, 32, [Buffer("x", x), Buffer("y", y, True)], **kw)
    return y, x


def test_deferred_cp_async_lands_at_the_matching_wait():
    y, x = _staged(1)                              # group 0 landed at wait_group 1
    np.testing.assert_array_equal(y[:32], x[1:128:4])
    np.testing.assert_array_equal(y[32:], np.where(np.arange(32) % 2 == 0, x[130::4], 0))
    y, x = _staged(2, **LEGACY)                    # synchronous copies hide the early read
    np.testing.assert_array_equal(y[:32], x[1:128:4])
    y, _ = _staged(2, check_races=False)           # in flight: the destination is poison
    assert np.isnan(y[:32]).all() and not np.isnan(y[32:]).any()


@pytest.mark.parametrize("off", [16, -4, 1 << 26, -(1 << 26), 1 << 40])
def test_a_copy_from_outside_every_buffer_faults_however_far(off):
    """A cp.async source is checked against the buffers' extents, not only by the guard
    pages: an index past them would read other mapped memory and no fault (a page id of
    100000 did, in the tensor-core prefix kernel)."""
    x = np.arange(16, dtype=np.float32)
    y = np.zeros(1, np.float32)
    run("far_copy", 1, 32, [Buffer("x", x), Buffer("y", y, True), np.int64(0)])
    assert y[0] == 0.0
    with pytest.raises(OutOfBoundsError, match=r"far_copy: block \(0,0,0\) thread \(0,0,0\): "
                       r"out-of-bounds read.*'x'"):
        run("far_copy", 1, 32, [Buffer("x", x), Buffer("y", y, True), np.int64(off)])


def test_a_plain_read_a_gigabyte_off_faults_and_names_the_buffer():
    x = np.arange(16, dtype=np.float32)
    y = np.zeros(1, np.float32)
    for off, where in ((1 << 28, "element 268435456"), (-(1 << 28), "element -268435456")):
        with pytest.raises(OutOfBoundsError, match=rf"read of buffer 'x' at {where}"):
            run("far_read", 1, 32, [Buffer("x", x), Buffer("y", y, True), np.int64(off)])


def test_schedule_orders():
    def order(name, blocks=1):
        out = np.full(64 * blocks, -1, np.int32)
        run("tickets", blocks, 64, [Buffer("out", out, True)], schedules=(name,))
        return out.reshape(blocks, 64)
    np.testing.assert_array_equal(order("forward")[0], np.arange(64))
    np.testing.assert_array_equal(order("reverse")[0], np.arange(64)[::-1])
    r3 = order("random:3")[0]
    assert sorted(r3) == list(range(64)) and (r3 != np.arange(64)).any()
    np.testing.assert_array_equal(order("random:3")[0], r3)          # seeded
    assert (order("random:4")[0] != r3).any()
    ra = order("runahead", blocks=2)               # one warp takes tickets 0..31 first
    leaders = [int(np.argmin(blk.reshape(2, 32).max(axis=1))) for blk in ra]
    for blk, lead in zip(ra, leaders):
        np.testing.assert_array_equal(blk.reshape(2, 32)[lead], np.arange(32))
    assert leaders[0] != leaders[1]                # the leader differs between blocks
    with pytest.raises(RaceError):                 # the default runs every schedule
        run("tickets", 1, 64, [Buffer("out", np.zeros(64, np.int32), True)])
    assert set(DEFAULT_SCHEDULES) == set(SCHEDULES)


def test_bad_schedule_names_are_refused(monkeypatch):
    args = [Buffer("out", np.zeros(64, np.int32), True)]
    with pytest.raises(EmulatorError, match="unknown schedule 'sideways'"):
        run("tickets", 1, 64, args, schedules=("sideways",))
    with pytest.raises(EmulatorError, match="seed must be an integer"):
        run("tickets", 1, 64, args, schedules=("random:x",))
    monkeypatch.setenv("PAGED_DECODE_EMULATOR_SCHEDULES", "forward, runahead:2")
    assert default_schedules() == ("forward", "runahead:2")
    monkeypatch.setenv("PAGED_DECODE_EMULATOR_CP_ASYNC", "eventually")
    with pytest.raises(EmulatorError, match="CP_ASYNC must be one of"):
        run("tickets", 1, 64, args, schedules=("forward",))


def test_static_shared_memory_over_the_limit_is_reported_not_hung():
    """A kernel whose static shared memory is past CUDA's 48 KB fails with the emulator's
    error in every block. The check once failed inside the site's static initializer,
    whose guard then stayed held: the next thread to reach it waited for ever. Run in a
    subprocess with a time limit so that a hang fails this test instead of the suite."""
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent('''
        import numpy as np
        from paged_decode.emulator import Buffer, EmulatorError, launch
        from paged_decode.kernels.common import CUDA_COMMON
        SRC = CUDA_COMMON + r"""
        __global__ void too_much_static(float* __restrict__ y) {
          __shared__ float s[12352];   // 49408 bytes
          s[threadIdx.x] = 1.0f;
          __syncthreads();
          y[blockIdx.x * blockDim.x + threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
        }
        """
        y = np.zeros(128, np.float32)
        try:
            launch(SRC, "too_much_static", 2, 64, [Buffer("y", y, True)], 0)
            print("RAN")
        except EmulatorError as exc:
            print("REFUSED", exc)
    ''')
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert "REFUSED" in res.stdout, res.stdout + res.stderr
    assert "static __shared__ memory exceeds 49152 bytes" in res.stdout


# Thread-block clusters through kernels/common.py's helpers (compiled in with PD_CLUSTER).
CLUSTER_SRC = r"""
// Each CTA fills its slots; after the cluster barrier (skipped when !sync) thread t reads
// slot t of CTA (rank + 1) % size; a second barrier (skipped when !stay) keeps every CTA
// until the others have read its memory.
__global__ void ring(float* __restrict__ y, int size, int sync, int stay) {
  __shared__ float slot[64];
  const unsigned me = pd::cluster_rank();
  slot[threadIdx.x] = 100.f * blockIdx.x + threadIdx.x;
  if (sync) pd::cluster_sync();
  const float* peer = pd::cluster_map(slot, (me + 1) % (unsigned)size);
  y[blockIdx.x * blockDim.x + threadIdx.x] = peer[threadIdx.x];
  if (stay) pd::cluster_sync();
}

// CTA 1 of each cluster leaves before the barrier the others wait at.
__global__ void cluster_leaves(float* __restrict__ y) {
  if (pd::cluster_rank() == 1) return;
  pd::cluster_sync();
  y[blockIdx.x * blockDim.x + threadIdx.x] = 1.f;
}

// cluster_map of a global address (what == 0) or to a CTA past the cluster (what == 1).
__global__ void map_bad(float* __restrict__ y, int what) {
  __shared__ float slot[32];
  slot[threadIdx.x] = 1.f;
  pd::cluster_sync();
  const float* p = what == 0 ? pd::cluster_map(y, 0u) : pd::cluster_map(slot, 9u);
  y[threadIdx.x] = p[0];
  pd::cluster_sync();
}

// Block `bad` writes `past` bytes beyond the end of its dynamic shared memory; the others
// only meet at the cluster barrier.
__global__ void cluster_dyn_past(float* __restrict__ y, int bad, int past) {
  extern __shared__ float dyn[];
  dyn[threadIdx.x] = 1.f;
  pd::cluster_sync();
  if ((int)blockIdx.x == bad && threadIdx.x == 0) dyn[(256 + past) / 4] = 2.f;
  y[blockIdx.x * blockDim.x + threadIdx.x] = dyn[threadIdx.x];
  pd::cluster_sync();
}
"""
CLUSTER_SOURCE = "#define PD_CLUSTER 2\n" + CUDA_COMMON + CLUSTER_SRC


def _cluster_ring(k, sync=1, stay=1, blocks=8, **kw):
    y = np.full(blocks * 64, np.nan, np.float32)
    launch(CLUSTER_SOURCE, "ring", blocks, 64,
           [Buffer("y", y, True), np.int32(k), np.int32(sync), np.int32(stay)], cluster=k, **kw)
    return y


@pytest.mark.parametrize("k", [2, 4, 8])
def test_cluster_ctas_read_each_other_after_the_cluster_barrier(k):
    b = np.repeat(np.arange(8), 64)
    want = 100.0 * (b // k * k + (b % k + 1) % k) + np.tile(np.arange(64), 8)
    np.testing.assert_array_equal(_cluster_ring(k), want.astype(np.float32))


def test_a_peer_read_before_the_cluster_barrier_reads_poison():
    """Without the first barrier rank 0 (swept first) reads rank 1's slots before rank 1
    wrote them: the poison, NaN (a negative control of the barrier)."""
    y = _cluster_ring(2, sync=0, schedules=("forward",))
    assert np.isnan(y.reshape(4, 2, 64)[:, 0]).all()


def test_a_missing_cluster_barrier_shows_as_schedules_that_disagree():
    """Under the four schedules (forward, reverse, a random CTA order every sweep, one
    warp ahead) the CTAs of a cluster move in different orders, so a peer read without
    the barrier gives different results: ``RaceError``."""
    with pytest.raises(RaceError, match=r"ring: buffer 'y' differs between the forward and "
                       r"the \w+ fiber schedule"):
        _cluster_ring(4, sync=0)


def test_a_read_of_an_exited_peer_fails():
    """Without the second barrier a CTA leaves while its neighbour still reads it: its
    shared memory is unmapped when it exits, so the read faults and is named."""
    with pytest.raises(ExitedPeerError, match=r"ring: block \(\d,0,0\) thread \(\d+,0,0\): read "
                       r"of the shared memory of CTA \d of its cluster, which has exited"):
        _cluster_ring(4, stay=0, schedules=("reverse",))


def test_a_cta_leaving_before_the_cluster_barrier_is_reported_not_hung():
    y = np.zeros(4 * 32, np.float32)
    with pytest.raises(DivergenceError, match=r"cluster_leaves: block \(\d,0,0\): divergent "
                       r"cluster barrier: 32 of the cluster's 64 threads wait at it, 32 exited"):
        launch(CLUSTER_SOURCE, "cluster_leaves", 4, 32, [Buffer("y", y, True)], cluster=2)


@pytest.mark.parametrize("what,msg", [
    (0, r"cluster_map of 0x[0-9a-f]+, which is not in this block's shared memory"),
    (1, r"cluster_map to CTA 9 of a cluster of 2"),
])
def test_cluster_map_refuses_what_is_not_a_peer_s_shared_memory(what, msg):
    y = np.zeros(32, np.float32)
    with pytest.raises(KernelFault, match=msg):
        launch(CLUSTER_SOURCE, "map_bad", 2, 32, [Buffer("y", y, True), np.int32(what)],
               cluster=2)


@pytest.mark.parametrize("k,grid", [(3, 8), (16, 16)])
def test_cluster_sizes_must_divide_the_grid_and_stay_portable(k, grid):
    y = np.zeros(grid * 64, np.float32)
    with pytest.raises(KernelFault, match=rf"ring: clusters of {k} CTAs along x over a grid "
                       rf"of {grid} \(at most 8, dividing the grid's x\)"):
        launch(CLUSTER_SOURCE, "ring", grid, 64,
               [Buffer("y", y, True), np.int32(k), np.int32(1), np.int32(1)], cluster=k)


def test_shared_memory_guards_hold_for_every_cluster_a_worker_runs():
    """A CTA's shared memory is unmapped when it exits and mapped again for the worker's
    next cluster: the guard pages between and around its regions stay guards (the last of
    one OS thread's four clusters writes 8 KiB past its dynamic memory)."""
    y = np.zeros(8 * 64, np.float32)
    launch(CLUSTER_SOURCE, "cluster_dyn_past", 8, 64,
           [Buffer("y", y, True), np.int32(-1), np.int32(0)], 256, cluster=2, threads=1)
    assert (y == 1).all()
    with pytest.raises(OutOfBoundsError, match=r"cluster_dyn_past: block \(6,0,0\) thread "
                       r"\(0,0,0\): out-of-bounds write of dynamic shared memory"):
        launch(CLUSTER_SOURCE, "cluster_dyn_past", 8, 64,
               [Buffer("y", y, True), np.int32(6), np.int32(8192)], 256, cluster=2,
               threads=1)
