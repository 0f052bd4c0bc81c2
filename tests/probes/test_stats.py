"""probes.stats against scipy.stats.ks_2samp: recorded TTFT samples, seeded samples, both regimes, sizing.

Direction: the probe asks whether hits are *faster*. Faster times put the hit sample's empirical CDF
*above* the miss sample's, and scipy names its alternative after the CDFs, not the times: the
probe's test is ``ks_2samp(hits, misses, alternative="greater")`` (as in Gu et al.'s audit), whose
statistic is ``max(F_hits - F_misses)``. ``alternative="less"`` would ask whether hits are slower.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from scipy.stats import ks_2samp

from kvcanary.probes import stats
from kvcanary.probes.stats import (
    d_plus_scaled,
    exact_pvalue,
    hodges_pvalue,
    ks_greater,
    median,
    min_detectable_effect,
    samples_per_arm,
    smirnov_limit,
)

# Time to first token in ms, recorded by the probe's timing test on reference workers (128 Ki-token
# prefixes, 38 trials per arm, shuffled). SHARED: another tenant's prefix was cached (hits).
SHARED_CROSS = [
    103.6, 53.6, 152.6, 46.4, 50.6, 48.4, 62.2, 94.4, 58.3, 183.1, 68.1, 48.4, 62.7, 59.6, 70.7, 157.1, 61.3,
    70.3, 115.4, 65.0, 185.4, 57.2, 80.5, 220.7, 82.2, 55.2, 229.2, 125.4, 177.5, 51.2, 148.9, 49.5, 44.2,
    155.7, 48.2, 52.1, 43.1, 47.4,
]  # fmt: skip
SHARED_MISS = [
    631.3, 446.5, 251.4, 288.5, 390.9, 311.6, 308.2, 239.8, 270.4, 343.8, 231.7, 250.3, 215.5, 354.0, 247.5,
    348.8, 310.7, 377.4, 318.3, 499.1, 286.6, 345.2, 648.3, 747.4, 939.4, 341.9, 366.6, 625.3, 458.5, 498.3,
    354.1, 211.8, 232.6, 204.5, 309.6, 247.5, 185.3, 226.5,
]  # fmt: skip
# ISOLATED: per-tenant salts, so the other tenant's "hit" arm is misses too (the null; note the ties).
ISOLATED_CROSS = [
    310.3, 282.6, 270.7, 346.6, 307.2, 333.9, 284.9, 547.2, 393.7, 389.1, 310.3, 391.0, 333.7, 310.6, 316.4,
    276.1, 309.9, 363.8, 585.0, 482.7, 386.2, 333.8, 436.9, 603.6, 653.9, 758.3, 655.1, 639.1, 300.0, 537.6,
    756.5, 552.5, 638.8, 398.7, 455.4, 718.7, 368.4, 846.9,
]  # fmt: skip
ISOLATED_MISS = [
    302.3, 317.9, 301.1, 288.2, 481.1, 364.4, 361.4, 309.0, 307.8, 345.1, 231.1, 192.1, 236.0, 565.9, 386.3,
    397.3, 517.8, 892.1, 323.9, 328.1, 515.0, 392.4, 514.5, 372.9, 460.5, 496.7, 666.8, 523.2, 525.6, 633.5,
    522.3, 556.6, 450.5, 362.6, 425.6, 706.6, 317.9, 698.4,
]  # fmt: skip
RECORDED = {"shared": (SHARED_CROSS, SHARED_MISS), "isolated": (ISOLATED_CROSS, ISOLATED_MISS)}


def seeded(seed: int, m: int, n: int, shift: float) -> tuple[list[float], list[float]]:
    """Return ``m`` normal values moved ``shift`` to the left (faster) and ``n`` unmoved ones."""
    rng = random.Random(seed)
    return [rng.gauss(0, 1) - shift for _ in range(m)], [rng.gauss(0, 1) for _ in range(n)]


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_it_agrees_with_scipy_on_recorded_ttft_samples(name: str) -> None:
    hits, misses = RECORDED[name]
    ours = ks_greater(hits, misses)
    theirs = ks_2samp(hits, misses, alternative="greater", method="exact")
    assert ours.statistic == pytest.approx(float(theirs.statistic), abs=1e-12)
    assert ours.pvalue == pytest.approx(float(theirs.pvalue), rel=1e-9)
    assert (ours.method, ours.n_first, ours.n_second) == ("exact", 38, 38)


def test_it_finds_recorded_hits_faster_and_the_isolated_arms_alike() -> None:
    shared, isolated = ks_greater(SHARED_CROSS, SHARED_MISS), ks_greater(ISOLATED_CROSS, ISOLATED_MISS)
    assert shared.statistic > 0.9 and shared.pvalue < 1e-15
    assert isolated.statistic < 0.2 and isolated.pvalue > 0.1
    # The other direction is "are hits slower?": scipy's "less", and nothing is found.
    slower = ks_greater(SHARED_MISS, SHARED_CROSS)
    assert slower.statistic == 0.0 and slower.pvalue == 1.0
    less = ks_2samp(SHARED_CROSS, SHARED_MISS, alternative="less", method="exact")
    assert float(less.pvalue) == pytest.approx(slower.pvalue)


# (37, 43) and (118, 122): the unequal arms of a timing run's looks (one shuffle of the whole plan).
@pytest.mark.parametrize(
    ("m", "n"), [(5, 5), (19, 19), (74, 74), (253, 253), (30, 41), (50, 37), (7, 300), (37, 43), (118, 122)]
)
@pytest.mark.parametrize("shift", [0.0, 0.4, 1.0, 3.0])
def test_its_exact_pvalues_match_scipys_exact_mode_on_seeded_samples(m: int, n: int, shift: float) -> None:
    hits, misses = seeded(m * 1000 + n, m, n, shift)
    ours = ks_greater(hits, misses)
    theirs = ks_2samp(hits, misses, alternative="greater", method="exact")
    assert ours.method == "exact"
    assert ours.statistic == pytest.approx(float(theirs.statistic), abs=1e-12)
    # scipy's unequal-arm path subtracts float path counts; ours sums positive first passages.
    assert ours.pvalue == pytest.approx(float(theirs.pvalue), rel=1e-6)


@pytest.mark.parametrize(("m", "n"), [(4, 6), (5, 5), (3, 7), (6, 4)])
def test_its_exact_distribution_is_the_share_of_all_orderings(m: int, n: int) -> None:
    # Under the null every placement of the m first-sample values among m + n ranks is equally likely.
    total = math.comb(m + n, m)
    counts: dict[int, int] = {}
    for ranks in itertools.combinations(range(m + n), m):
        first = [float(r) for r in ranks]
        second = [float(r) for r in range(m + n) if r not in ranks]
        h = d_plus_scaled(first, second)
        counts[h] = counts.get(h, 0) + 1
    for h in sorted(counts):
        tail = sum(c for k, c in counts.items() if k >= h) / total
        assert exact_pvalue(m, n, h) == pytest.approx(tail, rel=1e-12)


@pytest.mark.parametrize(("m", "n"), [(1500, 1200), (5000, 4000), (900, 1300)])
def test_it_switches_to_the_asymptotic_formula_for_large_unequal_arms_as_scipy_does(m: int, n: int) -> None:
    hits, misses = seeded(m + n, m, n, 0.15)
    ours = ks_greater(hits, misses)
    theirs = ks_2samp(hits, misses, alternative="greater", method="asymp")
    assert m * n > stats.EXACT_MAX_CELLS and ours.method == "asymptotic"
    assert ours.statistic == pytest.approx(float(theirs.statistic), abs=1e-12)
    assert ours.pvalue == pytest.approx(float(theirs.pvalue), rel=1e-9)


def test_its_asymptotic_formula_is_close_to_exact_where_both_apply() -> None:
    # 600 x 500 values: a size the probe never plans, but unequal arms after failed trials could be.
    for d in (0.08, 0.15, 0.25):
        exact = exact_pvalue(600, 500, round(d * 600 * 500))
        assert hodges_pvalue(600, 500, d) == pytest.approx(exact, rel=0.15)
        assert smirnov_limit(600, 500, d) >= hodges_pvalue(600, 500, d)


def test_it_evaluates_ties_as_scipy_does() -> None:
    hits = [1.0, 2.0, 2.0, 3.0, 5.0, 5.0]
    misses = [2.0, 3.0, 3.0, 4.0, 5.0, 6.0, 6.0]
    ours = ks_greater(hits, misses)
    theirs = ks_2samp(hits, misses, alternative="greater", method="exact")
    assert ours.statistic == pytest.approx(float(theirs.statistic))
    assert ours.pvalue == pytest.approx(float(theirs.pvalue), rel=1e-9)


def test_it_gives_complete_separation_of_equal_arms_one_over_the_orderings() -> None:
    for n in (5, 19, 74):
        assert exact_pvalue(n, n, n * n) == pytest.approx(1 / math.comb(2 * n, n), rel=1e-12)
    assert exact_pvalue(3, 4, 0) == 1.0 and exact_pvalue(3, 4, 13) == 0.0


@pytest.mark.parametrize(("effect", "n"), [(0.27, 253), (0.5, 74), (1.0, 19)])
def test_it_sizes_arms_as_the_detection_research_table_says(effect: float, n: int) -> None:
    assert samples_per_arm(1e-8, effect) == n
    # At that size an observed D of the target reaches alpha exactly too (the limit is conservative here).
    detectable = min_detectable_effect(1e-8, n)
    assert detectable is not None and detectable <= effect + 1 / n
    assert exact_pvalue(n, n, round(detectable * n) * n) < 1e-8


@pytest.mark.parametrize(
    ("effect", "per_look", "thresholds"),
    [(0.5, 79, [39, 56, 68]), (0.7, 40, [27, 39, 48]), (1.0, 20, [19, 27, 34])],
)
def test_it_sizes_three_looks_at_alpha_over_three_as_the_detection_research_table_says(
    effect: float, per_look: int, thresholds: list[int]
) -> None:
    alpha = 1e-8 / 3
    assert samples_per_arm(alpha, effect) == per_look
    for look, k in enumerate(thresholds, start=1):
        n = look * per_look
        assert min_detectable_effect(alpha, n) == k / n
        # scipy agrees: D+ = k/n reaches alpha at this look, one step less does not. The first sample
        # is the second moved k places to the left, which makes D+ exactly k/n.
        for steps, reaches in ((k, True), (k - 1, False)):
            misses = [float(i) for i in range(n)]
            hits = [i - steps + 0.5 for i in range(n)]
            theirs = ks_2samp(hits, misses, alternative="greater", method="exact")
            assert float(theirs.statistic) == pytest.approx(steps / n)
            assert (float(theirs.pvalue) < alpha) is reaches


def test_it_says_when_no_effect_can_reach_alpha() -> None:
    assert min_detectable_effect(1e-8, 14) is None  # 1/C(28, 14) = 2.5e-8
    assert min_detectable_effect(1e-8, 15) == 1.0
    with pytest.raises(ValueError, match="alpha"):
        samples_per_arm(0.0, 0.5)


def test_it_refuses_empty_samples_and_takes_medians() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ks_greater([], [1.0])
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0, 2.0, 3.0]) == 2.5
