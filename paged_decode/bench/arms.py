"""The arms a decode benchmark compares, built per case.

Each arm is a callable an engine would make once per step (ours: a ``prepare_decode``
call with the plan reused; FlashInfer: ``wrapper.run`` after one ``plan``; contiguous
SDPA: one ``scaled_dot_product_attention`` call on K/V already laid out contiguously), the
array its output lands in (verified against the float64 oracle before timing) and what it
actually ran. Ours also expose the plain ``decode(...)`` call with the same plan, timed
per call as the API cost.

- ``gather``, ``v1``, ``v2``, ``v2tc``: this package's paths (``v2tc``, the tensor-core
  partial, on a plan searched for its CTAs per chunk; 16-bit dtypes on ``cuda``).
- ``sdpa``: torch SDPA on contiguous ``[B, Hkv, L, D]`` K/V (the same bytes without
  paging; needs torch and equal request lengths).
- ``flashinfer``, ``flashinfer-tc``: FlashInfer's batch decode, CUDA-core and tensor-core
  (needs ``flashinfer`` importable).
- ``flashinfer-xqa``: FlashInfer 0.6+'s XQA decode (``flashinfer_xqa_arm``; a bench call
  with FlashInfer 0.6 importable, not 0.3.1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..backends import Backend
from ..call import plan_decode
from ..decode import decode
from ..errors import UnsupportedProblemError
from ..page_table import PageTable
from ..plan import DecodePlan
from ..prepared import prepare_decode
from ..specs import plan_geometry

OURS = ("gather", "v1", "v2", "v2tc")
EXTERNAL = ("sdpa", "flashinfer", "flashinfer-tc", "flashinfer-xqa")
ALL_ARMS = OURS + EXTERNAL
#: the paths each of our arms may report; anything else is a fallback
EXPECTED = {"gather": ("gather",), "v1": ("v1",), "v2": ("v2", "v2+merge"),
            "v2tc": ("v2tc", "v2tc+merge")}


class ArmUnavailable(Exception):
    """The arm cannot run this case here (missing package, unsupported geometry)."""


@dataclass
class Arm:
    call: Callable[[], Any]                 # what is timed per call and captured in a graph
    out: Any                                # where the output lands (verified)
    ran: str                                # what actually ran
    expected: tuple[str, ...] = ()          # allowed values of ``ran`` (ours)
    api_call: Callable[[], Any] | None = None   # ours: plain decode() with the same plan
    plan: dict[str, Any] = field(default_factory=dict)   # ours: the plan it runs (plan_facts)


def plan_facts(plan: DecodePlan) -> dict[str, Any]:
    """What the bench reports of a plan: chunks, CTAs and the rule that made it."""
    return {"chunks": plan.num_chunks, "ctas": plan.num_ctas,
            "rule": "wave" if plan.slots_per_unit else "target"}


def make_arm(name: str, be: Backend, q: Any, k: Any, v: Any, table: PageTable,
             plan: DecodePlan, sm_scale: float, variants: dict[str, Any] | None = None,
             *, keep_plan: bool = False) -> Arm:
    """Build arm ``name`` for one case (``q [B, Hq, D]``, pools ``[N, P, Hkv, D]`` of
    ``be``'s kind). ``variants``: ``decode``'s ``window_left`` / ``logits_soft_cap`` /
    ``sinks`` (``plan`` made with the window). The v2tc arm runs its own plan (its CTAs per
    chunk and, where calibrated, the wave rule) unless ``plan`` forces a chunk size or
    ``keep_plan`` (a sweep timing exactly its plan: a CTA target, say). Raises
    ``ArmUnavailable`` with the reason when it cannot run."""
    vk = {k_: v_ for k_, v_ in (variants or {}).items()
          if v_ is not None and not (k_ == "window_left" and v_ < 0)}
    if name in OURS:
        with be.launch_context(q):
            out = be.empty(tuple(q.shape), be.dtype_of(q))
        if name == "v2tc" and not (keep_plan or plan.forced):
            device = be.device_info()
            geo = plan_geometry("v2tc", plan.num_qo_heads, plan.num_kv_heads, plan.head_dim,
                                vk.get("kv_dtype"), device)
            if (plan.ctas_per_chunk, plan.slots_per_unit) != (geo["ctas_per_chunk"],
                                                              geo["slots_per_unit"]):
                # the same window; the target rule keeps the given plan's target (an fp8
                # pool's)
                plan = plan_decode(
                    table, plan.num_qo_heads, plan.num_kv_heads, plan.head_dim,
                    device=device, window_left=plan.window_left, kv_dtype=vk.get("kv_dtype"),
                    path="v2tc", target_ctas=None if geo["slots_per_unit"] else plan.target_ctas)
        try:
            prep = prepare_decode(q, k, v, table, plan, path=name, out=out,
                                  sm_scale=sm_scale, backend=be, **vk)
        except UnsupportedProblemError as exc:
            raise ArmUnavailable(str(exc)) from exc

        def api(name: str = name) -> Any:
            return decode(q, k, v, table, plan, path=name, out=out, sm_scale=sm_scale,
                          backend=be, **vk)
        return Arm(prep, out, prep.path, EXPECTED[name], api, plan_facts(plan))
    if name not in EXTERNAL:
        raise ValueError(f"bench: unknown arm {name!r}; arms: {', '.join(ALL_ARMS)}")
    if be.name != "cuda":
        raise ArmUnavailable(f"{name} runs only against the cuda backend")
    try:
        import torch

        from . import flashinfer_arm as fa
        from . import flashinfer_xqa_arm as fx
        from . import sdpa_arm
    except Exception as exc:
        raise ArmUnavailable(f"{name} needs torch and the arm module "
                             f"({type(exc).__name__}: {exc})") from exc
    qt, kt, vt = (torch.from_dlpack(x) for x in (q, k, v))
    if name == "sdpa" and vk:
        raise ArmUnavailable(f"sdpa (contiguous, plain attention) has no {', '.join(vk)}")
    if "kv_dtype" in vk:        # fp8 pools are CuPy bytes: FlashInfer reads torch fp8
        kt, vt = (t.view(getattr(torch, vk["kv_dtype"])) for t in (kt, vt))
    if "sinks" in vk:
        raise ArmUnavailable(f"{name}: FlashInfer's batch decode wrapper takes no sinks")
    try:
        if name == "sdpa":
            call, out, desc = sdpa_arm.make_contiguous_sdpa(qt, kt, vt, table,
                                                            sm_scale=sm_scale)
        else:
            ok, why = fa.available()
            if not ok:
                raise ArmUnavailable(why)
            kw = {"sm_scale": sm_scale, "window_left": vk.get("window_left", -1),
                  "logits_soft_cap": vk.get("logits_soft_cap"),
                  "k_scale": vk.get("k_scale"), "v_scale": vk.get("v_scale")}
            if name == "flashinfer-xqa":
                call, out, desc = fx.make_flashinfer_xqa(qt, kt, vt, table, **kw)
            else:
                call, out, desc = fa.make_flashinfer_decode(
                    qt, kt, vt, table, use_tensor_cores=name.endswith("-tc"), **kw)
    except ArmUnavailable:
        raise
    except Exception as exc:
        raise ArmUnavailable(f"{name}: {type(exc).__name__}: {str(exc)[:200]}") from exc
    return Arm(call, out, desc)


__all__ = ["ALL_ARMS", "Arm", "ArmUnavailable", "EXPECTED", "EXTERNAL", "OURS", "make_arm"]
