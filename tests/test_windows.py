"""Verify-window planning: hand-computed budgets, batch-size behaviour, the threshold policy, per-row means."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.speculative.cost_table import CostTable
from specserve.speculative.windows import RowMeans, pick_order, plan_budget, plan_threshold, survivals

FLAT = CostTable((1, 64), (0.01, 0.01))
STEEP = CostTable((1, 2), (1.0, 3.0))            # each extra row costs twice a whole forward
LINEAR = CostTable((1, 2), (1.0, 1.25))          # t(r) = 1 + (r - 1) / 4


def rate(confidences, windows, cost, base=None):
    base = base or [1] * len(confidences)
    tokens = len(confidences) + sum(sum(survivals(c)[:w]) for c, w in zip(confidences, windows))
    return tokens / cost.time(sum(base) + sum(windows))


# ---------------------------------------------------------------------------------- survivals
def test_survivals_are_running_products():
    assert survivals([0.5, 0.5, 1.0, 0.2]) == pytest.approx([0.5, 0.25, 0.25, 0.05])
    assert survivals([]) == []


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_confidence_outside_unit_interval_is_rejected(bad):
    with pytest.raises(ValueError, match="confidence 2"):
        survivals([0.5, bad])


# ---------------------------------------------------------------------------------- plan_budget
def test_flat_cost_verifies_every_draft_with_positive_survival():
    # survivals [0.9, 0.45, 0.0] and [0.8]: extra rows are free, a zero survival adds nothing
    assert plan_budget([[0.9, 0.5, 0.0], [0.8]], FLAT) == [2, 1]


def test_steep_cost_verifies_only_the_anchors():
    assert plan_budget([[0.99, 0.99]], STEEP) == [0]
    assert plan_budget([[0.99, 0.99], [0.99]], STEEP) == [0, 0]


def test_middle_cost_stops_where_tokens_per_second_peak():
    # S = 0.9, 0.72, 0.36, 0.18 → τ/t = 1/1, 1.9/1.25, 2.62/1.5 (best), 2.98/1.75, 3.16/2
    assert plan_budget([[0.9, 0.8, 0.5, 0.5]], LINEAR) == [2]


def test_budget_goes_to_the_most_likely_drafts_across_requests():
    # ranked S: 0.9 (r0), 0.81 (r0), 0.5 (r1), 0.25 (r1); rows 2 + m:
    # 2/1.25, 2.9/1.5, 3.71/1.75 (best), 4.21/2, 4.46/2.25
    assert plan_budget([[0.9, 0.9], [0.5, 0.5]], LINEAR) == [2, 0]


def test_prefill_rows_make_extra_rows_relatively_cheaper():
    # base 5 rows: 1/2, 1.9/2.25, 2.62/2.5, 2.98/2.75 (best), 3.16/3
    assert plan_budget([[0.9, 0.8, 0.5, 0.5]], LINEAR, base_rows=[5]) == [3]
    assert plan_budget([[0.9, 0.8, 0.5, 0.5]], LINEAR, other_rows=4) == [3]


def test_no_requests_and_no_drafts():
    assert plan_budget([], LINEAR) == []
    assert plan_budget([[], []], LINEAR) == [0, 0]


def test_bad_base_rows_are_rejected():
    with pytest.raises(ValueError, match="2 requests"):
        plan_budget([[0.5], [0.5]], LINEAR, base_rows=[1])
    with pytest.raises(ValueError, match=">= 1"):
        plan_budget([[0.5]], LINEAR, base_rows=[0])


# FLAT, but each further row of a sequence costs a whole forward per 1,000 cached keys past 100
KEYED = CostTable((1, 64), (0.01, 0.01), context=100, extra_row_key_seconds=1e-5)


def test_rows_of_a_long_context_cost_their_attention():
    assert plan_budget([[0.9, 0.5, 0.0]], KEYED, keys=[100]) == [2]      # within the table's context: free
    # at 1,100 keys a row costs a forward: 1/0.01 beats 1.9/0.02 and 2.35/0.03
    assert plan_budget([[0.9, 0.5, 0.0]], KEYED, keys=[1100]) == [0]
    assert plan_budget([[0.99, 0.99, 0.99]], KEYED, keys=[200]) == [3]    # a tenth of a forward each pays


def test_rows_go_to_the_request_whose_rows_are_cheaper():
    # equal survivals: the short context's row is free, the long one's costs five forwards
    assert plan_budget([[0.9], [0.9]], KEYED, keys=[5100, 100]) == [0, 1]
    assert plan_budget([[0.9], [0.9]], KEYED, keys=[100, 5100]) == [1, 0]


def test_a_long_first_row_makes_further_rows_relatively_cheaper():
    # LINEAR with a first row of 3 more forwards past the context: 1/4, 1.9/4.25, 2.62/4.5, 2.98/4.75, 3.16/5 (best)
    cost = CostTable((1, 2), (1.0, 1.25), context=0, first_row_key_seconds=3e-3)
    assert plan_budget([[0.9, 0.8, 0.5, 0.5]], LINEAR) == [2]
    assert plan_budget([[0.9, 0.8, 0.5, 0.5]], cost, keys=[1000]) == [4]


def test_bad_keys_are_rejected():
    with pytest.raises(ValueError, match="keys 1 entries for 2 requests"):
        plan_budget([[0.5], [0.5]], KEYED, keys=[100])


def test_windows_shrink_as_confidence_falls():
    cost = CostTable((1, 8, 16), (0.040, 0.060, 0.100))
    windows = [plan_budget([[c] * 8], cost)[0] for c in (0.99, 0.95, 0.9, 0.8, 0.6, 0.4, 0.2, 0.05)]
    assert windows == sorted(windows, reverse=True)
    assert windows[0] == 8 and windows[-1] == 0


def test_large_batches_stop_growing_the_verify_batch():
    # free up to 16 rows, then each row adds 1/16 of a forward
    cost = CostTable((1, 16, 32), (0.02, 0.02, 0.04))
    previous = None
    for n in range(1, 65):
        windows = plan_budget([[0.8] * 7] * n, cost)
        assert n + sum(windows) <= max(n, 16)
        if previous is not None:
            assert max(windows) <= previous
        previous = max(windows)
        if n <= 2:
            assert windows == [7] * n
        if n >= 16:
            assert windows == [0] * n


confidence = st.sampled_from([0.0, 0.3, 0.5, 0.8, 1.0]) | st.floats(0.0, 1.0)
batches = st.lists(st.lists(confidence, max_size=5), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(batches)
def test_every_top_m_pick_is_a_prefix_of_each_request(confidences):
    ranked = pick_order(confidences)
    for m in range(len(ranked) + 1):
        for i in range(len(confidences)):
            picked = sorted(k for _, k, r in ranked[:m] if r == i)
            assert picked == list(range(1, len(picked) + 1))


def test_ties_keep_prefixes():
    # all survivals equal within and across requests: the order is k first
    assert [(k, i) for _, k, i in pick_order([[1.0, 1.0], [1.0, 1.0]])] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    # room for exactly one extra row: the tie between the requests' first drafts goes to request 0
    assert plan_budget([[1.0, 1.0], [1.0, 1.0]], CostTable((1, 3, 4), (1.0, 1.0, 10.0))) == [1, 0]


@settings(max_examples=100, deadline=None)
@given(batches, st.sampled_from([FLAT, LINEAR, STEEP, CostTable((1, 4, 8), (1.0, 1.1, 2.0))]))
def test_plan_is_the_best_of_all_window_choices(confidences, cost):
    windows = plan_budget(confidences, cost)
    best = max(rate(confidences, list(ws), cost)
               for ws in itertools.product(*(range(len(c) + 1) for c in confidences)))
    assert rate(confidences, windows, cost) == pytest.approx(best, rel=1e-12)


# ---------------------------------------------------------------------------------- plan_threshold
def test_threshold_cuts_where_survival_drops_below():
    # S = 0.9, 0.81, 0.729 | 0.5 | 1, 1, 0
    confidences = [[0.9, 0.9, 0.9], [0.5], [1.0, 1.0, 0.0]]
    assert plan_threshold(confidences, 0.8) == [2, 0, 2]
    assert plan_threshold(confidences, 0.5) == [3, 1, 2]
    assert plan_threshold(confidences, 0.0) == [3, 1, 3]
    assert plan_threshold(confidences, 1.0) == [0, 0, 2]


def test_threshold_outside_unit_interval_is_rejected():
    with pytest.raises(ValueError, match="threshold"):
        plan_threshold([[0.5]], 1.5)


# ---------------------------------------------------------------------------------- RowMeans
def test_row_means_pull_towards_the_prior_and_fill_unseen_rows():
    means = RowMeans()
    assert means.means(3, 0.5, 2.0) == [0.5, 0.5, 0.5]
    means.add([1.0, 0.2])
    means.add([0.0])
    assert means.means(3, 0.5, 2.0) == pytest.approx([(1.0 + 1.0) / 4, (0.2 + 1.0) / 3, 0.5])
    assert means.means(1, 0.5, 2.0) == pytest.approx([0.5])


def test_row_means_take_a_prior_per_row():
    means = RowMeans()
    assert means.means(4, [0.2, 0.6, 0.8], 2.0) == [0.2, 0.6, 0.8, 0.8]     # past its end: the last row's prior
    means.add([0.0, 1.0])
    assert means.means(3, [0.2, 0.6, 0.8], 2.0) == pytest.approx([0.4 / 3, 2.2 / 3, 0.8])


def test_the_forecast_gain_is_the_calibrated_forecasts_survivals():
    from specserve.speculative.windows import AllRows, BudgetPlanner
    from specserve.types import Request, SamplingParams

    planner = BudgetPlanner(CostTable((1, 2), (1.0, 1.25)))
    req = Request("a", [1], SamplingParams())
    assert planner.forecast_gain(req, 2) is None and AllRows().forecast_gain(req, 2) is None
    planner.observe(req, [0.5, 0.4, 0.3])                      # rows' means, each with the even prior twice
    assert planner.forecast_gain(req, 2) == pytest.approx(0.5 + 0.5 * (0.4 + 1.0) / 3)
    planner.verified(req, [0.5, 0.4], num_accepted=0)          # row 0 claimed 0.5, rejected: scaled by 2 / 2.5
    assert planner.forecast_gain(req, 1) == pytest.approx(0.5 * 2 / 2.5)


def test_row_means_count_a_verified_window_up_to_its_first_rejection():
    means = RowMeans()
    means.add_verified(num_verified=4, num_accepted=2)    # rows 0, 1 accepted, row 2 rejected, row 3 unreached
    means.add_verified(num_verified=2, num_accepted=2)    # both accepted, nothing rejected
    assert means.sums == [2.0, 2.0, 0.0] and means.counts == [2, 2, 1]


# ---------------------------------------------------------------------------------- planner calibration
def test_the_planner_scales_a_requests_claims_by_what_was_accepted():
    from specserve.speculative.windows import BudgetPlanner
    from specserve.types import Request, SamplingParams

    planner = BudgetPlanner(CostTable((1, 2), (1.0, 1.25)))
    liar, honest = Request("a", [1], SamplingParams()), Request("b", [1], SamplingParams())
    assert planner._calibrated(liar, [0.9, 0.9]) == [0.9, 0.9]          # nothing verified yet: face value
    for _ in range(8):                   # claimed 0.9 on row 0, always rejected (row 1 never reached)
        planner.verified(liar, [0.9, 0.9], num_accepted=0)
        planner.verified(honest, [0.5, 0.5], num_accepted=2)
    scaled = planner._calibrated(liar, [0.9, 0.9])
    assert scaled[0] == pytest.approx(0.9 * 2 / (8 * 0.9 + 2)) and scaled[1] == 0.9
    assert planner._calibrated(honest, [0.5, 0.6]) == [0.5, 0.6]          # never scaled up
    planner.release(liar)
    assert planner._calibrated(liar, [0.9]) == [0.9]


def test_the_planner_scales_only_the_block_rows_of_a_splice():
    """A splice's block drafts are the drafter's claims, calibrated; its copied rows are the n-gram record's own
    estimates and a pure n-gram window is taken as it is."""
    from specserve.speculative.windows import BudgetPlanner, Candidate
    from specserve.types import Request, SamplingParams, ScheduledRequest, StepPlan

    planner = BudgetPlanner(FLAT)
    liar = Request("a", [1], SamplingParams())
    for accepted in [0, 1] * 4:          # rows 0 and 1 both held less often than claimed
        planner.verified(liar, [0.9, 0.9, 0.9], num_accepted=accepted)
    seen = {}
    planner._budget = lambda plan, confidences: seen.update(confidences) or {0: 0}
    plan = StepPlan((ScheduledRequest(liar, 0, 1, True, 4),))
    planner.windows(plan, {0: Candidate([1, 2, 3, 4], [], [0.9, 0.9, 0.8, 0.8], ngram_match=3, ngram_from=1)})
    row0, row1 = planner._calibrated(liar, [0.9, 0.9])
    assert row0 < 0.9 and row1 < 0.9
    assert seen[0] == [row0, 0.9, 0.8, 0.8]
    planner.windows(plan, {0: Candidate([1, 2, 3, 4], [], [0.9, 0.9, 0.8, 0.8], ngram_match=3)})
    assert seen[0] == [0.9, 0.9, 0.8, 0.8]
    planner.windows(plan, {0: Candidate([1, 2, 3, 4], [], [0.9, 0.9, 0.8, 0.8])})
    assert seen[0] == planner._calibrated(liar, [0.9, 0.9, 0.8, 0.8])


def test_measured_block_overhead_joins_the_weights_estimate_as_a_running_mean():
    from specserve.speculative.windows import BudgetPlanner

    cost = CostTable((1, 8), (0.010, 0.024))
    fixed = BudgetPlanner(cost, relative_block_cost=0.1)
    fixed.timed(4, 0.5)
    assert fixed.block_time(4) == pytest.approx(0.1 * cost.time(4)) and fixed.block_overhead is None
    planner = BudgetPlanner(cost, relative_block_cost=0.1, measure_overhead=True)
    assert planner.block_time(0) == 0.0 and planner.block_time(4) == pytest.approx(0.1 * cost.time(4))
    planner.timed(4, 0.1 * cost.time(4) + 0.003)          # 3 ms beyond the weights' share
    assert planner.block_time(4) == pytest.approx(0.1 * cost.time(4) + 0.003)
    planner.timed(4, 0.1 * cost.time(4) + 0.008)
    assert planner.block_overhead == pytest.approx(0.003 + BudgetPlanner.OVERHEAD_WEIGHT * 0.005)
    planner.timed(8, 0.0)                                    # faster than the estimate: no negative overhead
    assert planner.block_overhead == pytest.approx(0.004 * (1 - BudgetPlanner.OVERHEAD_WEIGHT))


def test_a_block_that_costs_more_than_its_tokens_stops_running():
    """One request whose block wins 0.3 tokens: free blocks pay, blocks measured at a whole target step do not."""
    from specserve.speculative import DraftJob
    from specserve.speculative.windows import BudgetPlanner
    from specserve.types import Request, SamplingParams, ScheduledRequest, StepPlan

    cost = CostTable((1, 8), (0.010, 0.024))
    req = Request("a", [1, 2, 3], SamplingParams())
    plan = StepPlan((ScheduledRequest(req, start=2, num_feed=1, samples=True, max_drafts=4),))
    job = DraftJob(0, req, 4)
    verdict = {}
    for overhead in (0.0, 0.010):
        planner = BudgetPlanner(cost, relative_block_cost=0.0, measure_overhead=True)
        planner.observe(req, [0.3, 0.1, 0.05, 0.01])
        planner.timed(4, overhead)
        planner.num_steps = 1                               # not a probing step
        verdict[overhead] = planner.worth_drafting(plan, [job])
    # the forecast buys one verify row: the block runs that row and SPARE_ROWS more
    assert verdict[0.0] == [job._replace(num_drafts=1 + BudgetPlanner.SPARE_ROWS)] and verdict[0.010] == []


def test_a_block_runs_the_rows_its_forecast_or_recent_windows_may_use():
    """Rows past what the window can take cost time for nothing: a block drafted on its forecast runs the longer
    of the forecast's window and the request's recent windows, plus SPARE_ROWS; a request without a forecast runs
    every row, to measure them. A long window keeps the rows for a while, then they shrink one per block."""
    from specserve.speculative import DraftJob
    from specserve.speculative.windows import BudgetPlanner
    from specserve.types import Request, SamplingParams, ScheduledRequest, StepPlan

    cost = CostTable((1, 8), (0.010, 0.012))
    known, new = Request("a", [1, 2, 3], SamplingParams()), Request("b", [1, 2, 3], SamplingParams())
    plan = StepPlan(tuple(ScheduledRequest(r, start=2, num_feed=1, samples=True, max_drafts=8) for r in (known, new)))
    planner = BudgetPlanner(cost)
    planner.observe(known, [0.9, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    planner.num_steps = 1                                   # not a probing step

    def rows() -> list[int]:
        return [j.num_drafts for j in planner.worth_drafting(plan, [DraftJob(0, known, 8), DraftJob(1, new, 8)])]

    window = planner._budget(plan, {0: planner.forecast["a"].means(8)})[0]
    assert 1 <= window <= 8 - 2 - BudgetPlanner.SPARE_ROWS
    assert rows() == [window + BudgetPlanner.SPARE_ROWS, 8]
    planner.verified(known, [0.9] * 7, num_accepted=7)     # a sure chain took a window of 7
    assert rows() == [8, 8]
    planner.verified(known, [0.9], num_accepted=0)         # then short windows: the reach fades one per block
    assert rows() == [min(8, 6 + BudgetPlanner.SPARE_ROWS), 8]
    for _ in range(8):
        planner.verified(known, [0.9], num_accepted=0)
    # the rejections also scale the request's claims down (calibration): the forecast's window is its own again
    calibrated = planner._calibrated(known, planner.forecast["a"].means(8))
    window = planner._budget(plan, {0: calibrated})[0]
    assert rows() == [max(window, 1) + BudgetPlanner.SPARE_ROWS, 8]
    planner.release(known)
    assert "a" not in planner.reach
