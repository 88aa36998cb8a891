"""Masked softmax with the package's non-finite semantics, for any array module.

One place for the rules every array-op path (the reference backend, the gather arms, the
sparse masked path) shares with the kernels:

- a visible position whose logit is not finite (NaN or +-inf: a non-finite query or key
  element, or an overflowing product) **poisons** its row: the row's output and LSE are
  NaN, never a value that looks like a masked or empty row;
- a row with no visible position is **empty**: zeros and LSE ``-inf``.

``xp`` is ``numpy``, ``cupy`` or ``mlx.core``: only ``where``, ``isfinite``, ``exp``
(``exp2`` where the module has it), ``log`` and the array methods ``max``/``any``/``sum``
are used, and no result depends on how a module's ``max`` treats NaN.
"""

from __future__ import annotations

import math
from typing import Any

LN2 = math.log(2.0)
NAN = float("nan")
INF = float("inf")


def _exp2(xp: Any, x: Any) -> Any:
    f = getattr(xp, "exp2", None)            # mlx.core has none
    return f(x) if f is not None else xp.exp(x * LN2)


class RowSoftmax:
    """Unnormalized softmax weights of logits ``s [..., T]`` over their valid positions.

    Attributes (``R`` = the leading dims of ``s``):
        p: ``[..., T]`` weights ``exp(s - m)`` (0 at invalid positions, NaN in poisoned rows).
        den: ``[..., R]`` sum of ``p`` (1 where the row is empty, so dividing is safe).
        lse2: ``[..., R]`` base-2 log-sum-exp of the logits; ``-inf`` empty, NaN poisoned.
        empty, poisoned: ``[..., R]`` bool.

    ``base2``: the logits are in log2 units (``exp2``), else natural units. ``T >= 1``
    (a reduction over no positions has no identity in every module).
    """

    def __init__(self, xp: Any, s: Any, valid: Any = None, *, base2: bool) -> None:
        finite = xp.isfinite(s)
        bad = ~finite if valid is None else (valid & ~finite)
        live = finite if valid is None else (valid & finite)
        self.poisoned = bad.any(axis=-1)
        self.empty = ~live.any(axis=-1) & ~self.poisoned
        s = xp.where(live, s, -INF)
        m = s.max(axis=-1, keepdims=True)
        m = xp.where(live.any(axis=-1, keepdims=True), m, 0.0)
        x = s - m
        p = _exp2(xp, x) if base2 else xp.exp(x)
        self.p = xp.where(self.poisoned[..., None], NAN, xp.where(live, p, 0.0))
        den = self.p.sum(axis=-1)
        self.den = xp.where(self.empty, 1.0, den)
        m = m[..., 0]
        lse2 = (m + xp.log(self.den) / LN2) if base2 else (m + xp.log(self.den)) / LN2
        self.lse2 = xp.where(self.poisoned, NAN, xp.where(self.empty, -INF, lse2))
        self._xp = xp

    def normalize(self, pv: Any) -> Any:
        """``pv [..., R, D]`` (``p @ V``) -> the normalized output: zeros in empty rows, NaN
        in poisoned ones."""
        xp = self._xp
        o = pv / self.den[..., None]
        return xp.where(self.poisoned[..., None], NAN, xp.where(self.empty[..., None], 0.0, o))


def merge_partials(xp: Any, v: Any, lse: Any, valid: Any = None, axis: int = 0
                   ) -> tuple[Any, Any]:
    """Merge normalized partial states along ``axis``: ``v [..., D]`` (``lse``'s shape plus
    ``D``), ``lse`` base 2, ``valid`` (``lse``'s shape) marks real partials (default all)
    -> ``(v_out, lse_out)`` with ``axis`` reduced.

    ``w_i = exp2(lse_i - top)`` over real partials with a finite LSE (``top`` their max);
    ``v_out = sum w_i v_i / sum w_i``, ``lse_out = top + log2(sum w_i)``. ``-inf`` partials
    (empty chunks) carry no weight and their ``v`` is never used (it may be NaN). A NaN or
    ``+inf`` partial LSE is not a state any kernel writes (a poisoned chunk has NaN): it
    poisons the group (NaN out). A group with no weight is empty: zeros and ``-inf``.
    """
    real = xp.isfinite(lse) if valid is None else (valid & xp.isfinite(lse))
    bad = ~(lse < INF) if valid is None else (valid & ~(lse < INF))
    poisoned = bad.any(axis=axis)
    empty = ~real.any(axis=axis) & ~poisoned
    ls = xp.where(real, lse, -INF)
    top = ls.max(axis=axis, keepdims=True)
    top = xp.where(real.any(axis=axis, keepdims=True), top, 0.0)
    w = xp.where(real, _exp2(xp, ls - top), 0.0)
    num = xp.where(real[..., None], w[..., None] * v, 0.0).sum(axis=axis)
    den = w.sum(axis=axis)
    safe = xp.where(empty | poisoned, 1.0, den)
    o = xp.where(poisoned[..., None], NAN, xp.where(empty[..., None], 0.0, num / safe[..., None]))
    top = top.squeeze(axis)
    lse_out = xp.where(poisoned, NAN, xp.where(empty, -INF, top + xp.log(safe) / LN2))
    return o, lse_out


def nonfinite_heads(xp: Any, q: Any, kf: Any, valid: Any, empty: Any, group: int) -> Any:
    """``bool [B, Hq]``: heads whose inputs could give a non-finite score, for paths that
    call a fused SDPA without seeing the scores (it takes a -inf score for a masked one):
    a non-finite element of ``q [B, Hq, D]``, or of a visible row of the gathered K
    ``kf [B, Hkv, T, D]`` (``valid [B, T]``) of the head's KV head (``group`` query heads
    each). An ``empty [B]`` request stays empty."""
    bad_k = ~xp.all(xp.isfinite(kf) | ~valid[:, None, :, None], axis=(2, 3))   # [B, Hkv]
    bad = ~xp.all(xp.isfinite(q), axis=-1) | xp.repeat(bad_k, group, axis=1)
    return bad & ~empty[:, None]


__all__ = ["LN2", "RowSoftmax", "merge_partials", "nonfinite_heads"]
