"""Measured step costs per CUDA-graph shape (engine/speculative/step_costs.py) and the uniform width priced by them.

The numbers replay an H100's batch-64 run of the embedded model (bench/step_kinds.py --trace, 2026-12-06): plain
steps 1.34 ms for 64 tokens, tree rounds 2.7-2.8 ms whatever their width (host-bound), the root-only round that
leaves trees 2.56 ms. A line fitted on rows priced those rounds at a fraction of their cost, and every round lost."""
from __future__ import annotations

import pytest

from engine.cuda_graphs import graph_shape
from engine.plan import ScheduledSeq, StepPlan, StepResult
from engine.request import Request
from engine import SamplingParams
from engine.speculative.adaptive import BudgetController
from engine.speculative.step_costs import STALE_DECAY, StepCosts
from tests.speculative.test_adaptive import confidence

PLAIN_MS, LEAVING_MS = 1.34, 2.56
ROUND_MS = {2: 2.70, 5: 2.75, 17: 2.80}  # width (rows a request) -> a round's time at batch 64


def _mean(costs: StepCosts, key: tuple) -> float:
    """The measured mean of one shape: (batch bucket, width bucket, synchronous)."""
    weight, total = costs.means[key]
    return total / weight


def test_a_shapes_first_step_is_not_counted_and_a_plain_mean_needs_two_steps():
    costs = StepCosts(graph_shape)
    costs.observe(64, 1, 0.011)  # its first replay: not counted
    costs.observe(64, 17, 0.0028)
    costs.observe(64, 17, 0.0028)
    costs.observe(64, 1, 0.00134)
    assert costs.extra(64, 17) is None  # one plain step: not yet believed
    costs.observe(64, 1, 0.00134)
    assert costs.extra(64, 17) == pytest.approx(0.00146)
    assert costs.extra(60, 16) == pytest.approx(0.00146)  # the same buckets: the same graph
    assert costs.extra(64, 9) is None and costs.extra(32, 17) is None  # other shapes: not measured
    assert StepCosts(None).extra(64, 17) is None and StepCosts(None).width_seconds(64, 16, 1e-6) is None


def test_the_leaving_round_is_its_own_shape_and_a_spike_counts_a_bounded_step():
    costs = StepCosts(graph_shape)
    for _ in range(4):
        costs.observe(64, 1, 0.00134)
        costs.observe(64, 1, 0.00256, leaving=True)
    assert costs.extra(64, 1) == 0.0
    assert costs.extra(64, 1, leaving=True) == pytest.approx(0.00122)
    before = costs.extra(64, 1, leaving=True)
    costs.observe(64, 1, 0.5, leaving=True)  # a GC pause: at most 4x the mean
    assert before < costs.extra(64, 1, leaving=True) < before + 4 * 0.00256


def test_a_dear_round_is_priced_by_its_rows_again_after_a_run_of_plain_steps():
    """A round measured dear is not chosen again, so its record would never change; aged by the plain steps at its
    batch it stops counting after ~70 of them and the width is priced by rows plus the least fixed part."""
    costs = StepCosts(graph_shape)
    for _ in range(2):  # (the first not counted) one round measured
        costs.observe(64, 17, 0.0028)
    for _ in range(3):
        costs.observe(64, 1, 0.00134)
    assert costs.extra(64, 17) is not None
    steps = 0
    while costs.extra(64, 17) is not None:
        costs.observe(64, 1, 0.00134)
        steps += 1
    assert 60 < steps < 80 and STALE_DECAY ** (steps + 2) < 0.5
    # priced by rows again: 16 nodes x 64 requests at 1 ns, plus the fixed part the stale record still shows
    seconds = costs.width_seconds(64, 16, 1e-9)
    assert seconds[16] == pytest.approx(16 * 64 * 1e-9 + (0.0028 - 0.00134 - 16 * 64 * 1e-9), rel=0.02)


def test_rounds_are_counted_by_whether_their_shapes_measured_time_was_believed():
    """What chose a run's rounds (bench/step_kinds.py prints it): a round of a shape never measured, or whose record
    went stale, was priced by its rows; one whose record stood, by its measured time. Plain steps, the leaving
    round and synchronous steps are not rounds run ahead."""
    costs = StepCosts(graph_shape)
    costs.observe(64, 1, 0.00134)
    costs.observe(64, 1, 0.00134, leaving=True)
    costs.observe(64, 5, 0.0051, synchronous=True)
    assert (costs.rounds_believed, costs.rounds_priced_by_rows) == (0, 0)
    for _ in range(3):  # the first never counted: priced by rows twice, then believed
        costs.observe(64, 5, 0.0028)
    assert (costs.rounds_believed, costs.rounds_priced_by_rows) == (1, 2)
    for _ in range(200):  # stale
        costs.observe(64, 1, 0.00134)
    costs.observe(64, 5, 0.0028)
    assert (costs.rounds_believed, costs.rounds_priced_by_rows) == (1, 3)
    costs.reset()
    assert (costs.rounds_believed, costs.rounds_priced_by_rows) == (0, 0)


def measured(*steps: tuple[int, int, float]) -> StepCosts:
    """Step costs after three rounds of these (requests, width, seconds) steps (each shape's first not counted)."""
    costs = StepCosts(graph_shape)
    for _ in range(3):
        for num_seqs, width, seconds in steps:
            costs.observe(num_seqs, width, seconds)
    return costs


def test_an_unmeasured_width_pays_its_rows_and_the_least_fixed_part_seen():
    costs = measured((64, 1, 0.00134), (64, 17, 0.0028), (16, 1, 0.0011), (16, 2, 0.0016))
    t_row = 1e-6
    fixed = min(0.0016 - 0.0011 - 1 * 16 * t_row, 0.0028 - 0.00134 - 16 * 64 * t_row)
    assert costs.least_fixed(t_row) == pytest.approx(fixed)
    seconds = costs.width_seconds(64, 16, t_row)
    assert seconds[0] == 0.0 and seconds[1] == pytest.approx(1 * 64 * t_row + fixed)  # width 2: not measured
    assert seconds[4] == pytest.approx(4 * 64 * t_row + fixed)  # width 5: not measured
    assert seconds[6] == pytest.approx(8 * 64 * t_row + fixed)  # 7 rows run as the width-9 graph: its rows paid
    assert costs.width_seconds(60, 6, t_row)[6] == pytest.approx(8 * 64 * t_row + fixed)  # ... and its batch's
    assert seconds[16] == pytest.approx(0.0028 - 0.00134)


def test_an_unmeasured_width_costs_no_less_than_a_narrower_measured_one():
    """With the least fixed part taken from any batch, a 5-wide round at batch 64 was priced below the 2-wide
    round measured there; a wider round at the same batch runs more rows through the same work."""
    costs = measured((64, 1, 0.00134), (64, 2, 0.0027), (16, 1, 0.0011), (16, 2, 0.0012))
    t_row = 1e-6
    fixed = costs.least_fixed(t_row)
    assert fixed == pytest.approx(0.0012 - 0.0011 - 16 * t_row)
    seconds = costs.width_seconds(64, 8, t_row)
    assert seconds[1] == pytest.approx(0.0027 - 0.00134)  # measured
    assert 4 * 64 * t_row + fixed < seconds[1]  # the rows' price alone is below it ...
    assert seconds[4] == pytest.approx(seconds[1]) and seconds[8] == pytest.approx(seconds[1])  # ... the floor holds
    assert costs.width_seconds(16, 8, t_row)[4] == pytest.approx(4 * 16 * t_row + fixed)  # batch 16: its own


def test_no_tree_is_priced_before_a_plain_step_at_its_batch_is_measured():
    """Without a plain step to hold it against, a round's price is unknown; priced by rows, a batch-64 run on an
    H100 verified trees in 27 of its first 30 steps (each tree round followed by the root-only round leaving it, so
    no plain step was measured). Until three plain steps ran at the batch, each node of width costs
    UNMEASURED_PLAIN: trees stay off, and a probe still holds its own width, not a wider one (at one price for every
    width the widest is the cheapest per node: a probe's round would go out as wide as any request's tree)."""
    from engine.speculative.step_costs import UNMEASURED_PLAIN
    from engine.speculative.step_width import uniform_width

    costs = StepCosts(graph_shape)
    for _ in range(3):
        costs.observe(64, 17, 0.0037)
        costs.observe(64, 1, 0.0035, leaving=True)
    unmeasured = [UNMEASURED_PLAIN * w for w in range(5)]
    assert costs.width_seconds(64, 4, 1e-9) == unmeasured
    costs.observe(64, 1, 0.0014)
    costs.observe(64, 1, 0.0014)
    assert costs.width_seconds(64, 4, 1e-9) == unmeasured  # one counted: not yet
    costs.observe(64, 1, 0.0014)
    assert costs.width_seconds(64, 16, 1e-9)[16] == pytest.approx(0.0023)
    tokens = [seconds * 47e3 for seconds in StepCosts(graph_shape).width_seconds(64, 16, 1e-9)]  # not measured
    strong = [[0.9] * 16] * 64
    assert uniform_width(strong, [16] * 64, 0.02, 0.0, width_costs=tokens) == [0] * 64
    assert uniform_width(strong, [16] * 64, 0.02, 0.0, [4] + [0] * 63, width_costs=tokens) == [4] * 64


def test_entering_trees_pays_the_leaving_round_however_long_ago_it_was_measured():
    """Under CUDA graphs with tree steps launched ahead, the step that enters trees pays the root-only round that
    will leave them (switch_tokens). That round is measured each time trees are left, so its record ages only
    while no tree is entered; priced at 0 once stale, entering trees looked ~1.2 ms cheaper after ~70 plain steps
    at batch 64."""
    controller = BudgetController(max_budget=16)
    controller.pipelined = controller.switches_ahead = True
    controller.costs.shape_of = graph_shape
    for _ in range(4):
        controller.costs.observe(64, 1, 0.00146)
        controller.costs.observe(64, 1, 0.00266, leaving=True)
    for _ in range(3):
        controller.observe_step(64, 0.00146, 64)
    fresh = controller.switch_tokens(64)
    assert fresh == pytest.approx(0.0012 * 64 / 0.00146, rel=0.01)  # ~53 tokens at the plain steps' rate
    for _ in range(300):  # the leaving record stale (a tree shape's would be priced by its rows again)
        controller.costs.observe(64, 1, 0.00146)
    controller.observe_step(64, 0.00146, 64)
    assert controller.costs.extra(64, 1, leaving=True) is None
    assert controller.switch_tokens(64) == pytest.approx(fresh, rel=0.01)
    assert controller.switch_tokens(8) == 0.0  # nothing measured at that batch


def _controller(measured: bool) -> BudgetController:
    """A controller after the H100 trace's steps at batch 64 under graphs (asynchronous, tree steps launched
    ahead of any step): plain steps, rounds of three widths, the root-only rounds that left them."""
    controller = BudgetController(max_budget=16)
    controller.pipelined, controller.switches_ahead, controller.price_tree_steps = True, True, False
    if measured:
        controller.costs.shape_of = graph_shape
    for _ in range(3):
        for width, ms in ROUND_MS.items():
            controller.observe_step(64 * width, ms / 1e3, tokens=83, tree=True)
            controller.costs.observe(64, width, ms / 1e3)
        controller.observe_step(64, LEAVING_MS / 1e3, tokens=64)
        controller.costs.observe(64, 1, LEAVING_MS / 1e3, leaving=True)
        for _ in range(8):
            controller.observe_step(64, PLAIN_MS / 1e3, tokens=64)
            controller.costs.observe(64, 1, PLAIN_MS / 1e3)
    return controller


@pytest.mark.parametrize("measured", [False, True])
def test_rounds_that_cost_more_than_they_bring_stay_plain_at_batch_64(measured):
    """64 requests whose trees expect ~0.4 accepted drafts each (~26 tokens a round) against a round's measured
    ~1.4 ms extra (~70 tokens at 64 tokens / 1.34 ms) and the leaving round's ~1.2 ms: plain. Priced by the fitted
    row slope (the rounds' widths cost about the same, so the slope is small) the same step chose trees; that is
    what lost on the H100. Trees that expect ~3 drafts a request (~190 tokens) still run."""
    controller = _controller(measured)
    assert controller.threshold() < 0.1  # the fitted slope: ~1.3 us a row (the trace: 1.3-3)
    ids = [f"r{i}" for i in range(64)]
    mild = [0.25, 0.1, 0.05] + [0.001] * 13
    strong = [0.97 ** (j + 1) for j in range(16)]
    for qs, wants_trees in ((mild, not measured), (strong, True)):
        for rid in ids:
            controller.observe_curve(rid, confidence([sum(qs[:j + 1]) for j in range(16)]))
        got = controller.uniform(ids, [4] * 64, [16] * 64)
        assert any(got) == wants_trees, (qs[:3], got[:4])


def test_warm_up_steps_are_neither_fitted_nor_measured():
    """The first decoding steps of a batch of new requests take the drafter's intake of their prompts (an H100 at
    batch 64: 11.3 and 7.9 ms against 1.3 ms later): seeding the plain mean there made every round look cheap."""
    controller = BudgetController(max_budget=16)
    controller.costs.shape_of = graph_shape
    requests = [Request([1, 2, 3], SamplingParams(max_tokens=50), request_id=f"r{i}") for i in range(64)]
    plan = StepPlan([ScheduledSeq(r, 1, True) for r in requests])
    result = StepResult(new_token_ids={r.request_id: [7] for r in requests})
    for _ in range(3):  # one output token each: warming up
        controller.observe_engine_step(plan, result, 0.0113, 0.0, synchronous=False, uniform_layout=True)
    assert controller.fit.n == 0 and not controller.costs.means and not controller.costs.seen
    for r in requests:
        r.output_token_ids = [5, 6, 7]
    for _ in range(3):
        controller.observe_engine_step(plan, result, 0.00134, 0.0, synchronous=False, uniform_layout=True)
    assert controller.fit.n > 0 and _mean(controller.costs, (64, 1, False)) == pytest.approx(0.00134)


def test_plain_steps_that_drafted_curves_are_neither_fitted_nor_measured():
    """Under CUDA graphs a plain step in which requests drafted for their curves takes the drafter's host work too
    (an H100 at batch 64: 3.5-6.7 ms against 2.1): fitted as 64 rows beside 9-wide rounds at 3.2 ms, it brought the
    row slope to 0 and the threshold to its floor, and rounds 9 and 17 wide ran for a handful of requests. Plain
    steps without drafts still are, and without graphs (cheap drafts at every step) so are those."""
    controller = BudgetController(max_budget=16)
    controller.costs.shape_of = graph_shape
    requests = [Request([1, 2, 3], SamplingParams(max_tokens=50), request_id=f"r{i}") for i in range(64)]
    for r in requests:
        r.output_token_ids = [5, 6, 7]  # past the warm-up
    plan = StepPlan([ScheduledSeq(r, 1, True) for r in requests])
    drafted = StepResult(new_token_ids={r.request_id: [7] for r in requests}, num_drafted=64)
    for _ in range(3):
        controller.observe_engine_step(plan, drafted, 0.0062, 0.0001, synchronous=False, uniform_layout=True)
    assert controller.fit.n == 0 and not controller.costs.means
    assert controller.drafting.calls == 3  # the drafter's own cost is still measured
    plain = StepResult(new_token_ids={r.request_id: [7] for r in requests})
    for _ in range(3):
        controller.observe_engine_step(plan, plain, 0.0021, 0.0, synchronous=False, uniform_layout=True)
    assert controller.fit.n > 0 and _mean(controller.costs, (64, 1, False)) == pytest.approx(0.0021)
    # without graphs a request at budget 0 drafts at every step while drafting is cheap: such steps are fitted
    eager = BudgetController(max_budget=16)
    eager.observe_engine_step(plan, drafted, 0.0062, 0.0001, synchronous=False, uniform_layout=False)
    assert eager.fit.n > 0


def test_a_nodes_expected_gain_never_exceeds_one_token():
    """A node is accepted at most once, so its expected gain is at most 1, however far a request's record stands
    above the engine's: a request whose unlikely nodes keep being accepted has a calibration well above 1, and
    its likely nodes were valued at several tokens each."""
    controller = BudgetController(max_budget=8)
    for _ in range(5):
        controller.observe_step(8, 0.01, tokens=8)
    qs = [0.95, 0.9] + [0.1] * 6
    curve = confidence([sum(qs[:j + 1]) for j in range(8)])
    for _ in range(10):
        controller.observe_request("weak", 8, [1], curve)
        controller.observe_request("copying", 8, list(range(1, 9)), curve)
    stats = controller.requests["copying"]
    reliability, scale = controller._bin_reliability(), controller._standing(stats, None)
    uncapped = [q * reliability[k] * scale for q, k in zip(stats.node_q, stats.node_bins)]
    assert max(uncapped) > 1.2
    gains = controller._gains(stats, None, 8)
    assert max(gains) == 1.0 and gains == [min(1.0, g) for g in uncapped]


def test_no_tree_runs_before_the_engines_throughput_is_measured():
    """A width's measured seconds are priced in tokens at the engine's decayed throughput; before a decoding step
    set it (a batch's warm-up steps are not counted) every price read 0 and the widest tree won: a batch-64 run's
    first probes on an H100 went out 16 nodes wide, every request filling them (3.5 ms against 2.0-2.3 ms for
    rounds at a probe's width). Until then each node of width is priced out, so only probes run, at their own
    width."""
    from engine.speculative.step_budgets import UNPRICED_TOKENS
    from engine.speculative.step_width import uniform_width

    controller = BudgetController(max_budget=16)
    controller.costs.shape_of = graph_shape
    ids = [f"r{i}" for i in range(64)]
    for rid in ids:  # confident trees, drafted, nothing verified or timed yet
        controller.observe_curve(rid, confidence([0.9 * (j + 1) for j in range(16)]))
    assert controller.seconds == 0
    prices = controller._width_costs(64, 16)
    assert prices == [w * UNPRICED_TOKENS for w in range(17)]
    assert controller.uniform(ids, [16] * 64, [16] * 64) == [0] * 64
    strong = [[0.9] * 16] * 64
    assert uniform_width(strong, [16] * 64, 0.02, 0.0, [4] + [0] * 63, width_costs=prices) == [4] * 64
    controller.observe_step(64, 0.0014, tokens=64)  # a decoding step: now priced by what it measured
    assert controller._width_costs(64, 16)[16] < 1e6


def test_trees_in_a_synchronous_step_are_priced_at_what_synchronous_steps_cost():
    """Under asynchronous scheduling a step scheduled after its predecessor's results (an admission) exposes the
    host's scheduling, drafting and launch: under load on an H100 a synchronous tree round took 5.1 ms against 2.7
    for a synchronous plain step, where rounds ahead took 3.0 against 1.2. Priced like a round ahead, trees ran in
    admission steps at 22 tokens a ms against plain decoding's 46. Trees worth ~1.2 tokens a request run ahead
    and not in a synchronous step; the synchronous steps measured include admissions' prefill chunks. Without
    asynchronous scheduling every step is priced at the one table."""
    controller = BudgetController(max_budget=16)
    controller.pipelined, controller.switches_ahead, controller.price_tree_steps = True, True, False
    controller.costs.shape_of = graph_shape
    requests = [Request([1, 2, 3], SamplingParams(max_tokens=500), request_id=f"r{i}") for i in range(64)]
    for r in requests:
        r.output_token_ids = [5, 6, 7]  # past the warm-up
    newcomer = Request(list(range(40)), SamplingParams(max_tokens=500), request_id="new")

    def plan(width: int, admits: bool = False) -> StepPlan:
        seqs = [ScheduledSeq(r, 1, True, width - 1) for r in requests[:63 if admits else 64]]
        return StepPlan(seqs + ([ScheduledSeq(newcomer, 40, True)] if admits else []))

    # a cycle of steps under load: plain ones ahead, rounds ahead, an admission, rounds scheduled synchronously
    # (a round emits two tokens a request)
    cycle = [(1, 0.0012, False, False)] * 6 + [(2, 0.0020, False, False), (3, 0.0021, False, False),
                                               (5, 0.0022, False, False), (1, 0.0027, True, True),
                                               (2, 0.0049, True, False), (3, 0.0050, True, False),
                                               (5, 0.0051, True, False)]
    for _ in range(4):
        for width, seconds, synchronous, admits in cycle:
            result = StepResult(new_token_ids={r.request_id: [7] * min(width, 2) for r in requests})
            controller.observe_engine_step(plan(width, admits), result, seconds, 0.0, synchronous, True)
    assert _mean(controller.costs, (64, 1, True)) == pytest.approx(0.0027)  # (admissions with a prompt's chunk)
    ids = [r.request_id for r in requests]
    qs = [0.6, 0.3, 0.2, 0.1] + [0.001] * 12
    for rid in ids:
        controller.observe_curve(rid, confidence([sum(qs[:j + 1]) for j in range(16)]))
    caps = [4] * 64  # widths up to 5 rows, all measured
    assert any(controller.uniform(ids, [4] * 64, caps))
    assert not any(controller.uniform(ids, [4] * 64, caps, synchronous=True))
    controller.pipelined = False  # synchronous scheduling: one table, every step as measured there
    assert controller.uniform(ids, [4] * 64, caps, synchronous=True) == controller.uniform(ids, [4] * 64, caps)
