"""Where generation through paged-decode spends its time, beside transformers' dynamic
cache: prefill against decode steps, a cProfile of the host side and a torch profiler
table of the GPU kernels (issue #16's tokens/s target).

Usage on the GPU machine: python3 bench/device/profile_generate.py OUT.txt [NEW]

The model and prompts are the example's (``examples/generate_transformers.py
--model-config llama3-8b-16l --dtype float16 --batch 32 --prefix-len 512 --prompt-len
512``): a random 16-layer model of Llama-3-8B's heads and width, float16.
"""

import cProfile
import io
import os
import pstats
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import _common  # noqa: E402  (the example's prompts)

from paged_decode.integrations import transformers as pt  # noqa: E402
from paged_decode.integrations.random_models import transformers_model  # noqa: E402

#: the example's arguments (seed 0; ``_common.prompts`` draws with seed + 1)
ARGS = SimpleNamespace(seed=0, batch=32, prefix_len=512, prompt_len=512)


def timed(run) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    out_path = sys.argv[1]
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    model = transformers_model("llama3-8b-16l", seed=0, dtype="float16", device="cuda",
                               init_on_device=True)
    ps = _common.prompts(ARGS, model.config.vocab_size)
    arms = {"paged": lambda n: pt.generate(model, ps, n),
            "paged-cascade": lambda n: pt.generate(model, ps, n, cascade=True),
            "dynamic": lambda n: pt.framework_generate(model, ps, n),
            "static": lambda n: pt.framework_generate(model, ps, n, cache_implementation="static")}
    lines = []
    for name, run in arms.items():
        run(2)                                                     # warm up
        t1 = min(timed(lambda r=run: r(1)) for _ in range(2))
        tn = min(timed(lambda r=run: r(new)) for _ in range(2))
        lines.append(f"{name}: prefill+1 {t1 * 1e3:.1f} ms, {new} tokens {tn * 1e3:.1f} ms, "
                     f"per decode step {(tn - t1) / (new - 1) * 1e3:.2f} ms")
        print(lines[-1], flush=True)
    for name in ("paged", "dynamic"):
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        arms[name](16)
        torch.cuda.synchronize()
        prof.disable()
        for key in ("tottime", "cumtime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(35)
            lines.append(f"== cProfile {name} by {key} (16 new tokens)\n{s.getvalue()}")
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as tp:
            arms[name](8)
            torch.cuda.synchronize()
        try:
            table = tp.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        except (KeyError, AttributeError, ValueError):
            table = tp.key_averages().table(sort_by="device_time_total", row_limit=30)
        lines.append(f"== torch profiler {name} (8 new tokens), by device time\n{table}")
    with open(out_path, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines[:4]))


if __name__ == "__main__":
    main()
