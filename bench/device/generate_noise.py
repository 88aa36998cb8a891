"""How far transformers' own float32 logits move when only the batch layout changes,
beside how far paged-decode's move: the yardstick for the near-tie guard of the CUDA
generation test (``tests/helpers.assert_same_greedy``).

Usage on the GPU machine: python3 bench/device/generate_noise.py OUT.json [MODEL ...]

For each model (default ``llama3-8b-16l``; float32, seed 0, the test's ragged prompts):
- ``ref``: transformers' dynamic cache, the four prompts left-padded into one batch;
- ``alone``: the same cache, each prompt run by itself (no padding: other GEMM shapes);
- ``paged``: paged-decode with cascade (what the test runs) and flat (``cascade=None``).
Reports the largest logit difference of each against ``ref`` and of ``paged`` against
``alone``, the smallest top-1 / top-2 gap of ``ref``, whether the tokens agree, and the
float32 matmul settings (TF32 would explain a large floor).
"""

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from helpers import ragged_prompts  # noqa: E402

from paged_decode.integrations import transformers as pt  # noqa: E402
from paged_decode.integrations.random_models import transformers_model  # noqa: E402

NEW = 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # cpu: a dry run of the script


def main() -> None:
    out_path, names = sys.argv[1], sys.argv[2:] or ["llama3-8b-16l"]
    report = dict(allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                  float32_matmul_precision=torch.get_float32_matmul_precision(),
                  models={})
    for name in names:
        model = transformers_model(name, seed=0, device=DEVICE)
        prompts = ragged_prompts(model.config.vocab_size, seed=1)
        ref = pt.framework_generate(model, prompts, NEW)
        ref_l = ref.logits.cpu().numpy()                       # [steps, B, V]
        alone = [pt.framework_generate(model, [p], NEW) for p in prompts]
        alone_l = np.concatenate([a.logits.cpu().numpy() for a in alone], axis=1)
        alone_t = [a.tokens[0] for a in alone]
        top = np.sort(ref_l, axis=-1)[..., -2:]
        gap = top[..., 1] - top[..., 0]
        row = dict(margin=float(gap.min()), logit_abs_max=float(np.abs(ref_l).max()),
                   alone_vs_ref=float(np.abs(alone_l - ref_l).max()),
                   alone_tokens_equal=alone_t == ref.tokens)
        for arm, cascade in (("cascade", True), ("flat", None)):
            got = pt.generate(model, prompts, NEW, cascade=cascade, return_logits=True)
            got_l = got.logits.cpu().numpy()
            row[f"{arm}_vs_ref"] = float(np.abs(got_l - ref_l).max())
            row[f"{arm}_vs_alone"] = float(np.abs(got_l - alone_l).max())
            row[f"{arm}_tokens_equal"] = got.tokens == ref.tokens
        report["models"][name] = row
        print(name, json.dumps(row), flush=True)
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "models"}))


if __name__ == "__main__":
    main()
