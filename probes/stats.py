"""The one-sided two-sample Kolmogorov-Smirnov test and its sample sizing, in pure Python.

Probes import nothing heavy (no numpy, no scipy): this module is the statistics of the prefix-cache
timing test (``probes/prefix_cache/timing.py``), checked against ``scipy.stats.ks_2samp`` in
``tests/probes/test_stats.py``.

The question is one-sided: are the times of the first sample (cache hits, if the cache is shared)
stochastically *smaller* than those of the second (misses)? Smaller times mean the first sample's
empirical CDF ``F1`` lies *above* the second's ``F2``, so the statistic is

    D+ = max_t (F1(t) - F2(t)),  in [0, 1],

which is scipy's ``ks_2samp(first, second, alternative="greater")``: scipy names the alternative
after ``F1 > F2``, not after the times ("hits faster" is ``greater``, as in Gu et al.'s audit).

The p-value ``P(D+ >= d)`` under the null (both samples from one continuous distribution, so every
interleaving of the two sorted samples is equally likely) comes from one of three places; ``method``
in the result says which:

- ``exact``, equal arms (``m == n``), any size: ``C(2n, n-k) / C(2n, n)`` for ``d = k/n`` (reflection
  principle, Gnedenko-Korolyuk), evaluated as a product of ``k`` ratios.
- ``exact``, unequal arms with ``m * n <= EXACT_MAX_CELLS``: the probability that a uniformly random
  lattice path from (0, 0) to (m, n) ever reaches ``i/m - j/n >= d``, summed over first passages
  (path counting in the style of Hodges 1958, kept as probabilities: every term is positive, so
  p-values far below 1e-8 keep their precision instead of cancelling in ``1 - P(inside)``).
- ``asymptotic``, larger unequal arms: Smirnov's limit ``exp(-2 z^2)``, ``z = d sqrt(mn/(m+n))``, with
  Hodges' (1958) eq. 5.3 finite-sample correction (the formula scipy's ``asymp`` mode uses).

Ties (two equal times) are evaluated as scipy does (both CDFs step at the tied value); the null
distribution assumes there are none, which holds for clock readings in practice.

Sample sizing: with equal arms the limit gives ``P(D+ >= d) ~ exp(-n d^2)``, so an observed effect
``D`` reaches significance ``alpha`` with ``n = ceil(ln(1/alpha) / D^2)`` per arm: 253 for D = 0.27,
74 for D = 0.5 and 19 for D = 1 at alpha = 1e-8 (``docs/detection-research.md`` §1). The limit is
only a guide (it is optimistic for tiny ``n`` and pessimistic at these sizes: the exact p of D = 0.5
at n = 74 is 4.5e-9, of D = 1 at n = 19 is 2.8e-11), so :func:`min_detectable_effect` states the
exact threshold a plan really has (0.269 at n = 253, 0.5 at n = 74, 18/19 at n = 19), and no plan
below 15 values per arm can reach 1e-8 at all (1/C(28, 14) = 2.5e-8).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Unequal arms up to this many lattice cells (m * n) get the exact p-value (about 1 s at the cap).
EXACT_MAX_CELLS = 1_000_000


@dataclass(frozen=True)
class KsResult:
    """One one-sided two-sample KS test: ``statistic`` is D+ (first sample's CDF above the second's),
    ``pvalue`` is P(D+ >= statistic) under the null, ``method`` is ``exact`` or ``asymptotic``."""

    statistic: float
    pvalue: float
    n_first: int
    n_second: int
    method: str


def d_plus_scaled(first: Sequence[float], second: Sequence[float]) -> int:
    """Return ``m * n * D+`` as an exact integer (``max(i*n - j*m)`` over the merged samples).

    ``i`` and ``j`` count the values of each sample at or below each distinct value, as scipy's
    ``searchsorted(side="right")`` does, so tied values move both CDFs together.
    """
    xs, ys = sorted(first), sorted(second)
    m, n = len(xs), len(ys)
    best = i = j = 0
    for value in sorted({*xs, *ys}):
        while i < m and xs[i] <= value:
            i += 1
        while j < n and ys[j] <= value:
            j += 1
        best = max(best, i * n - j * m)
    return best


def exact_pvalue(m: int, n: int, h: int) -> float:
    """Return P(m*n*D+ >= h) exactly for arms of ``m`` and ``n`` values (``h``: see :func:`d_plus_scaled`)."""
    if h <= 0:
        return 1.0
    if h > m * n:
        return 0.0
    if m == n:
        return _equal_arms(n, math.ceil(h / n))
    return _first_passage(m, n, h)


def _equal_arms(n: int, k: int) -> float:
    # C(2n, n-k) / C(2n, n) = prod_{j<k} (n - j) / (n + 1 + j): no huge binomials, no cancellation.
    p = 1.0
    for j in range(k):
        p *= (n - j) / (n + 1 + j)
    return p


def _first_passage(m: int, n: int, h: int) -> float:
    """Return the probability that a uniform random path from (0, 0) to (m, n) ever has i*n - j*m >= h.

    ``row[j]`` holds the probability of standing at (i, j) without having reached the boundary. Only a
    step in ``i`` (a value of the first sample) raises ``i*n - j*m``, so only such steps cross it, and
    the mass that crosses is summed as it does.
    """
    row = [1.0] * (n + 1)
    for j in range(1, n + 1):  # along i = 0 the difference is -j*m < h: nothing crosses
        row[j] = row[j - 1] * (n - j + 1) / (m + n - j + 1)
    crossed = 0.0
    for i in range(1, m + 1):
        new = [0.0] * (n + 1)
        for j in range(n + 1):
            left = m + n - (i - 1) - j  # steps left when standing at (i - 1, j)
            from_below = row[j] * (m - i + 1) / left
            if i * n - j * m >= h:
                crossed += from_below  # (i, j - 1) lies beyond the boundary too, so it holds no mass
                continue
            from_left = new[j - 1] * (n - j + 1) / (m + n - i - j + 1) if j else 0.0
            new[j] = from_below + from_left
        row = new
    return min(1.0, crossed)


def hodges_pvalue(m: int, n: int, d: float) -> float:
    """Return Smirnov's asymptotic P(D+ >= d) with Hodges' eq. 5.3 correction (scipy's ``asymp``)."""
    if d <= 0:
        return 1.0
    big, small = max(m, n), min(m, n)
    z = math.sqrt(big * small / (big + small)) * d
    correction = 2 * z * (big + 2 * small) / math.sqrt(big * small * (big + small)) / 3
    return min(1.0, math.exp(-2 * z * z - correction))


def smirnov_limit(m: int, n: int, d: float) -> float:
    """Return Smirnov's limiting P(D+ >= d) = exp(-2 z^2), z = d sqrt(mn/(m+n)): what sizing uses."""
    return min(1.0, math.exp(-2 * d * d * m * n / (m + n))) if d > 0 else 1.0


def ks_greater(first: Sequence[float], second: Sequence[float], method: str = "auto") -> KsResult:
    """Test whether ``first`` is stochastically smaller than ``second`` (its CDF lies above).

    ``method`` is ``auto`` (exact for equal arms or up to :data:`EXACT_MAX_CELLS`, else asymptotic),
    ``exact`` or ``asymptotic``. Raises ``ValueError`` for an empty sample or an unknown method.
    """
    m, n = len(first), len(second)
    if not m or not n:
        raise ValueError("both samples need at least one value")
    if method not in ("auto", "exact", "asymptotic"):
        raise ValueError(f"unknown method {method!r}")
    h = d_plus_scaled(first, second)
    d = h / (m * n)
    if method == "auto":
        method = "exact" if m == n or m * n <= EXACT_MAX_CELLS else "asymptotic"
    p = exact_pvalue(m, n, h) if method == "exact" else hodges_pvalue(m, n, d)
    return KsResult(d, p, m, n, method)


def samples_per_arm(alpha: float, effect: float) -> int:
    """Return ``ceil(ln(1/alpha) / effect^2)``: the values per arm at which an observed D+ of ``effect``
    reaches ``alpha`` by Smirnov's limit. Raises ``ValueError`` outside 0 < alpha < 1, 0 < effect <= 1."""
    if not 0 < alpha < 1 or not 0 < effect <= 1:
        raise ValueError("need 0 < alpha < 1 and 0 < effect <= 1")
    # The rounding guard keeps an exact product (ln(1e8)/0.25 = 73.68...) from tipping on float noise.
    return math.ceil(math.log(1 / alpha) / (effect * effect) - 1e-9)


def min_detectable_effect(alpha: float, n: int) -> float | None:
    """Return the smallest D+ (a multiple of 1/n) whose exact p is below ``alpha`` with ``n`` values
    per arm, or None when even complete separation (D+ = 1, p = 1/C(2n, n)) does not reach it."""
    p = 1.0
    for k in range(1, n + 1):
        p *= (n - k + 1) / (n + k)
        if p < alpha:
            return k / n
    return None


def median(values: Sequence[float]) -> float:
    """Return the median of ``values``; raises ``ValueError`` when there are none."""
    if not values:
        raise ValueError("median of no values")
    ordered, mid = sorted(values), len(values) // 2
    return ordered[mid] if len(values) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
