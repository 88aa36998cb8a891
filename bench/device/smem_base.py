"""Where dynamic shared memory starts in the shared window, modulo 128 bytes, for a few
static shared-memory sizes (CUDA, diagnostics; session 31).

CUDA promises 16-byte alignment of ``extern __shared__`` storage and nothing more. The
tensor-core kernels' swizzled K/V tiles need a 128-byte aligned start, which they make
themselves (``align_smem`` in ``paged_decode/kernels/mma.py``); a variant that assumed
it trapped on an H100 (S31-R11). The v2 partial's uint4 ring takes the dynamic base as it
comes: where that base is 16 bytes off a 32-byte boundary, two lanes' 16-byte pieces of
one 32-byte global sector land in two 32-byte spans of shared memory, which is the layout
that made ``cp.async`` fetch such sectors twice in v2tc's padded ring. This script says
which case a device is in: for each static size it launches one block with 64 KB of
dynamic shared memory and writes ``__cvta_generic_to_shared(dynamic base) % 128``.

Usage on the GPU machine: python3 bench/device/smem_base.py [OUT.json] (CuPy; the kernel
also runs under the CPU emulator, tests/test_smem_base_script.py)
"""

import json
import sys

SOURCE = r"""
extern "C" __global__ void base_mod(unsigned* out) {
  extern __shared__ __align__(16) unsigned char dyn[];
#if STATIC_BYTES > 0
  __shared__ unsigned char fixed[STATIC_BYTES];
  fixed[threadIdx.x % STATIC_BYTES] = (unsigned char)threadIdx.x;   // keep it allocated
  __syncthreads();
  dyn[0] = fixed[(threadIdx.x + 1) % STATIC_BYTES];
#endif
  if (threadIdx.x == 0)
    out[0] = static_cast<unsigned>(__cvta_generic_to_shared(dyn)) & 127u;
}
"""

STATIC_SIZES = (0, 16, 48, 512, 1024, 1040, 1536)
DYNAMIC_BYTES = 64 * 1024


def base_mod(static_bytes: int) -> int:
    """``dynamic base % 128`` of one launch whose kernel holds ``static_bytes`` of static
    shared memory."""
    import cupy as cp
    module = cp.RawModule(code=SOURCE, options=(f"-DSTATIC_BYTES={static_bytes}",))
    kernel = module.get_function("base_mod")
    kernel.max_dynamic_shared_size_bytes = DYNAMIC_BYTES
    out = cp.zeros(1, dtype=cp.uint32)
    kernel((1,), (128,), (out,), shared_mem=DYNAMIC_BYTES)
    cp.cuda.Device().synchronize()
    return int(out.get()[0])


def main() -> None:
    import cupy as cp
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else str(dev["name"])
    rows = {s: base_mod(s) for s in STATIC_SIZES}
    for s, m in rows.items():
        print(f"{name}: static {s:5d} B -> dynamic base % 128 = {m:3d}"
              f"{'' if m % 32 == 0 else '  (16 off a 32-byte boundary)'}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": name, "dynamic_base_mod_128": rows}, f, indent=1)


if __name__ == "__main__":
    main()
