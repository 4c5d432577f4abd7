"""Level assignment and client sampling: proportions, determinism, budgets."""

import numpy as np

from fedhm_flwr.math import levels as lv


def test_fixed_levels_match_proportions_and_ignore_connection_order():
    pids = list(range(20))
    a = lv.fixed_levels(pids, [1, 1, 1, 1], seed=3)
    b = lv.fixed_levels(list(reversed(pids)), [1, 1, 1, 1], seed=3)
    assert a == b
    assert sorted(np.bincount(list(a.values()), minlength=4).tolist()) == [5, 5, 5, 5]
    assert lv.fixed_levels(pids, [1, 1, 1, 1], seed=4) != a
    assert np.bincount(list(lv.fixed_levels(range(10), [2, 3], 0).values())).tolist() == [4, 6]


def test_counts_use_largest_remainder():
    assert lv.counts_for([0.4, 0.6], 10) == [4, 6]
    assert sum(lv.counts_for([1, 1, 1], 10)) == 10


def test_dynamic_levels_follow_proportions():
    rng = np.random.default_rng(0)
    draws = lv.dynamic_levels(40000, [1, 3], rng)
    assert abs(np.mean(draws) - 0.75) < 0.01


def test_sampling_is_seeded_sized_and_without_replacement():
    keys = list(range(50))
    s1 = lv.sample_clients(keys, 0.2, 2, lv.round_rng(0, 5))
    assert s1 == lv.sample_clients(keys, 0.2, 2, lv.round_rng(0, 5))
    assert len(s1) == 10 == len(set(s1))
    assert s1 != lv.sample_clients(keys, 0.2, 2, lv.round_rng(0, 6))
    assert len(lv.sample_clients(keys[:3], 0.1, 2, lv.round_rng(0, 1))) == 2
    # a generator's maker is called only for a draw; a sample of every key is the same either way
    made = []
    maker = lambda: made.append(1) or lv.round_rng(0, 5)  # noqa: E731
    assert lv.sample_clients(keys, 0.2, 2, maker) == s1 and made == [1]
    shuffled = keys[::-1]
    for fraction, minimum in ((1.0, 2), (0.1, 50), (0.99, 50)):
        assert (
            lv.sample_clients(shuffled, fraction, minimum, maker)
            == keys
            == lv.sample_clients(shuffled, fraction, minimum, lv.round_rng(0, 5))
        )
    assert made == [1]


def test_budget_maps_to_the_largest_level_that_fits():
    costs = [100.0, 50.0, 25.0]
    assert lv.level_for_budget(100, costs) == 0
    assert lv.level_for_budget(60, costs) == 1
    assert lv.level_for_budget(25, costs) == 2
    assert lv.level_for_budget(10, costs) is None
