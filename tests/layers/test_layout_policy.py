"""Layout policies: one decide(facts, current) contract, four rules (pure Python, single process)."""

import itertools
import random

import pytest

from fusedpar.layers import (
    AutoPolicy,
    LoadPolicy,
    PrefillDecodePolicy,
    ShiftThresholdPolicy,
    StepFacts,
    StepModeRule,
    StepTimeCurve,
)
from fusedpar.layouts import ParallelLayout

W = 4
DP = ParallelLayout(W, tp=1)  # 4 replicas
TP = ParallelLayout(W, tp=4)  # 1 replica, TP over all
SPTP = ParallelLayout(W, sp=2, tp=2)


def facts(tokens=1, **kw):
    return StepFacts(scheduled_tokens=tokens, **kw)


def run(policy, steps, start=None):
    """The layouts a caller runs, threading `current` through the steps as the contract says."""
    current, out = start or policy.initial, []
    for f in steps:
        current = policy.decide(f, current)
        out.append(current)
    return out


# --- shift threshold ---------------------------------------------------------------------------

@pytest.mark.parametrize("threshold", [None, 0, 16, 1024])
@pytest.mark.parametrize("base", [SPTP, ParallelLayout(8, sp=2, tp=2), ParallelLayout(4, sp=4)])
def test_shift_threshold_follows_shift_policy(base, threshold):
    policy, rule = ShiftThresholdPolicy(base, threshold), StepModeRule(threshold)
    shift = ParallelLayout(base.world_size, sp=1, tp=base.replica_size)
    assert policy.layouts == (base, shift) and shift.dp == base.dp
    for n in (1, 15, 16, 17, 1024, 1025, 10**6):
        want = base if rule.mode(n, base.sp) == "base" else shift
        for current in policy.layouts:  # the rule ignores the current layout
            assert policy.decide(facts(n), current) == want


def test_shift_threshold_with_sp1_has_one_layout():
    policy = ShiftThresholdPolicy(TP, 0)
    assert policy.layouts == (TP,)
    assert policy.decide(facts(10**6), TP) is TP


# --- load-driven DP <-> TP ---------------------------------------------------------------------

def test_load_policy_hysteresis_does_not_flap():
    policy = LoadPolicy(DP, TP, low=2, high=6, initial=TP)
    loads = [1, 3, 5, 6, 5, 3, 4, 2, 3, 5, 1]
    got = run(policy, [facts(running=n) for n in loads])
    assert got == [TP, TP, TP, DP, DP, DP, DP, TP, TP, TP, TP]
    # a load oscillating inside the band never switches, whichever side it starts on
    band = [facts(running=r, waiting=w) for r, w in [(3, 0), (2, 3), (5, 0), (3, 2), (4, 1)]]
    assert set(run(policy, band, start=TP)) == {TP}
    assert set(run(policy, band, start=DP)) == {DP}


def test_load_policy_urgent_request_moves_to_tp_at_once():
    policy = LoadPolicy(DP, TP, low=1, high=4, urgent_priority=0)
    busy = dict(running=8, waiting=8)
    steps = [facts(**busy, priorities=(5, 3)),
             facts(**busy, priorities=(5, 0, 3)),  # urgent (0 <= 0): TP although the load says DP
             facts(**busy, priorities=(-1,)),
             facts(**busy, priorities=(5, 3))]  # urgent one done: load rule from TP, 16 >= high
    assert run(policy, steps) == [DP, TP, TP, DP]
    # without urgent_priority the priorities are ignored
    assert LoadPolicy(DP, TP, low=1, high=4).decide(facts(**busy, priorities=(-100,)), DP) is DP


def test_load_policy_counts_waiting_requests():
    policy = LoadPolicy(DP, TP, low=1, high=4, initial=TP)
    assert policy.decide(facts(running=1, waiting=3), TP) is DP
    assert policy.decide(facts(running=1, waiting=2), TP) is TP


# --- prefill / decode re-sharding --------------------------------------------------------------

def test_prefill_decode_transitions_only_when_host_tier_full_or_empty():
    policy = PrefillDecodePolicy(SPTP, TP)
    cap = 10
    steps = [  # (waiting, host_used) -> expected
        ((5, 0), SPTP), ((4, 3), SPTP), ((3, 9), SPTP),
        ((2, 10), TP),  # host tier full: decode
        ((2, 7), TP), ((6, 1), TP),  # host tier draining: stay, although requests wait
        ((6, 0), SPTP),  # host tier empty and work waits: prefill
        ((1, 4), SPTP),
        ((0, 5), TP),  # nothing waits: decode, host tier not full
        ((0, 0), TP),  # empty but nothing waits: stay
        ((3, 2), TP),
        ((3, 0), SPTP),
    ]
    got = run(policy, [facts(waiting=w, waiting_prefill_tokens=w, host_tier_used=u, host_tier_capacity=cap)
                       for (w, u), _ in steps])
    assert got == [want for _, want in steps]
    assert policy.initial is SPTP


def test_prefill_decode_never_switches_between_transition_points():
    """Random facts: every switch happens at an allowed point, and never elsewhere."""
    policy, rng, current = PrefillDecodePolicy(SPTP, TP), random.Random(0), SPTP
    switches = 0
    for _ in range(2000):
        waiting, used = rng.choice([0, 0, 1, 7]), rng.choice([0, 0, 1, 5, 8, 8])
        f = facts(waiting=waiting, host_tier_used=used, host_tier_capacity=8)
        nxt = policy.decide(f, current)
        if current is SPTP:
            assert (nxt is TP) == (used == 8 or waiting == 0), (f, current, nxt)
        else:
            assert (nxt is SPTP) == (used == 0 and waiting > 0), (f, current, nxt)
        switches += nxt is not current
        current = nxt
    assert switches > 100  # the facts above do reach both transition points


def test_prefill_decode_needs_a_host_tier():
    with pytest.raises(ValueError, match="host_tier_capacity must be >= 1, got 0"):
        PrefillDecodePolicy(SPTP, TP).decide(facts(waiting=1), SPTP)


# --- automatic ---------------------------------------------------------------------------------

# synthetic curves: SP x TP is slow for small steps and fast for large ones, TP the opposite
BASE_CURVE = [(1, 2.0e-3), (512, 2.5e-3), (4096, 8.0e-3)]
SHIFT_CURVE = [(1, 1.0e-3), (512, 2.0e-3), (4096, 16.0e-3)]


def test_step_time_curve_interpolates_and_extrapolates():
    c = StepTimeCurve([(10, 1.0), (20, 3.0)])
    assert [c(n) for n in (1, 10, 15, 20, 40)] == [1.0, 1.0, 2.0, 3.0, 6.0]


def test_auto_policy_picks_the_faster_layout_per_step():
    policy = AutoPolicy({SPTP: BASE_CURVE, TP: SHIFT_CURVE}, latency_goal_s=1.0)
    for n, want in [(1, TP), (100, TP), (512, TP), (2048, SPTP), (4096, SPTP), (10**5, SPTP)]:
        for current in (SPTP, TP):
            assert policy.decide(facts(n), current) is want, (n, current)
    # one layout faster everywhere wins everywhere
    fast = [(n, s / 2) for n, s in SHIFT_CURVE]
    assert {AutoPolicy({SPTP: SHIFT_CURVE, TP: fast}, latency_goal_s=1.0).decide(facts(n), SPTP)
            for n in (1, 300, 5000)} == {TP}


def test_auto_policy_counts_the_waiting_prefill():
    policy = AutoPolicy({SPTP: BASE_CURVE, TP: SHIFT_CURVE}, latency_goal_s=1.0)
    assert policy.decide(facts(8, running=8), TP) is TP
    # the same small step with 8192 prompt tokens waiting: SP x TP serves the visible work sooner
    assert policy.decide(facts(8, running=8, waiting=4, waiting_prefill_tokens=8192), TP) is SPTP


def test_auto_policy_latency_goal_overrides_the_decode_horizon():
    """Decode-heavy visible work favours TP over DP replicas; a tight goal for the waiting prompts forces DP."""
    f = facts(8, running=8, waiting=2, waiting_prefill_tokens=4096)
    curves = {DP: BASE_CURVE, TP: SHIFT_CURVE}
    loose = AutoPolicy(curves, latency_goal_s=1.0, decode_steps=200)
    ttft = {lay: e[0] for lay, e in loose.estimates(f, DP).items()}
    assert ttft[DP] < ttft[TP]  # 10.0 ms vs 17.0 ms
    assert loose.decide(f, DP) is TP  # 200 decode steps of 10 requests: TP is faster overall
    tight = AutoPolicy(curves, latency_goal_s=0.012, decode_steps=200)
    assert tight.decide(f, DP) is DP  # only DP gets the prompts their first token in 12 ms
    # no layout meets an impossible goal: the least late one
    assert AutoPolicy(curves, latency_goal_s=1e-6, decode_steps=200).decide(f, TP) is DP


def test_auto_policy_prices_decode_in_the_fastest_free_switch():
    """SP x TP and TP have one replica size: after an SP x TP step the decode steps run in TP for free,
    so the decode horizon does not hold SP x TP back, and switch_s does not apply between them."""
    f = facts(8, running=8, waiting=2, waiting_prefill_tokens=4096)
    policy = AutoPolicy({SPTP: BASE_CURVE, TP: SHIFT_CURVE}, latency_goal_s=1.0, decode_steps=200, switch_s=1.0)
    est = policy.estimates(f, TP)
    assert est[SPTP][1] - est[SPTP][0] == pytest.approx(est[TP][1] - est[TP][0])  # both decode at TP's speed
    assert policy.decide(f, TP) is SPTP and policy.decide(facts(8, running=8), SPTP) is TP


def test_auto_policy_on_measured_curves_is_shift_with_a_measured_threshold():
    """Curves measured at start-up of a serving run (4x H100, Llama-3-8B shape, 32 layers, bf16; tokens
    per step: ms): SP=4 for large steps, TP=4 for small ones, DP only when the queue is long enough
    to pay for its switch and its slower decode."""
    sp4 = ParallelLayout(W, sp=4)
    ms = {TP: [(1, 3.60), (16, 6.14), (64, 6.10), (256, 6.23), (1024, 12.58), (2048, 21.30)],
          sp4: [(1, 8.67), (16, 8.84), (64, 8.70), (256, 8.92), (1024, 11.12), (2048, 15.53)],
          DP: [(1, 7.24), (16, 9.93), (64, 9.75), (256, 9.79), (1024, 10.05), (2048, 13.32), (8192, 44.77)]}
    policy = AutoPolicy({lay: [(n, t * 1e-3) for n, t in c] for lay, c in ms.items()}, latency_goal_s=1.0,
                        decode_steps=32, switch_s=3.97e-3, initial=TP)
    for n, running, want in [(1, 1, TP), (64, 64, TP), (256, 40, TP), (1024, 40, sp4), (2048, 40, sp4)]:
        for current in (TP, sp4):
            assert policy.decide(facts(n, running=running), current) == want, (n, running, current)


def test_auto_policy_prices_decode_steps_on_the_decode_curves():
    """2x H200 start-up curves (ms): as prefill steps, SP=2 beats TP=2 from 16 tokens on, but a decode
    step of B sequences runs TP's decode graphs. Without decode curves auto sends 16-sequence decode
    steps to SP; with them decode steps stay in TP and prefill-heavy steps still go to SP."""
    sp2, tp2 = ParallelLayout(2, sp=2), ParallelLayout(2, tp=2)
    ms = {tp2: [(1, 4.67), (16, 8.48), (64, 8.43), (256, 8.53), (1024, 17.30), (2048, 29.09)],
          sp2: [(1, 7.94), (16, 8.21), (64, 8.15), (256, 8.27), (1024, 14.85), (2048, 24.74)]}
    dec = {tp2: [(1, 4.7), (16, 4.9), (64, 5.6)], sp2: [(1, 7.9), (16, 8.3), (64, 9.0)]}
    curves = {lay: [(n, t * 1e-3) for n, t in c] for lay, c in ms.items()}
    decode = {lay: [(n, t * 1e-3) for n, t in c] for lay, c in dec.items()}
    plain = AutoPolicy(curves, latency_goal_s=1.0, decode_steps=32, initial=tp2)
    priced = AutoPolicy(curves, latency_goal_s=1.0, decode_steps=32, initial=tp2, decode_curves=decode)
    step = facts(16, running=16)  # a decode step
    assert plain.decide(step, tp2) == sp2
    assert priced.decide(step, tp2) == tp2 and priced.decide(step, sp2) == tp2
    assert priced.estimates(step, tp2)[tp2][0] == pytest.approx(4.9e-3)
    prefill = facts(2048, running=16)  # a prefill chunk beside the decodes: SP still wins it
    assert priced.decide(prefill, tp2) == sp2
    with pytest.raises(ValueError, match="decode_curves must cover the same layouts"):
        AutoPolicy(curves, latency_goal_s=1.0, decode_curves={tp2: decode[tp2]})


def test_auto_policy_on_measured_curves_drains_a_flood_in_dp():
    """4x H200 start-up curves (Llama-3-8B shape; prefill: tokens per step, decode: sequences; ms) and
    the measured 3.7 ms DP <-> TP switch: a long queue goes to DP (every replica prefills at once)
    and so does a full batch of 256 decoding sequences; at 200 sequences and below decode returns to
    TP, and a prefill-heavy step at light load goes to SP."""
    sp4 = ParallelLayout(W, sp=4)
    ms = {TP: [(1, 3.55), (16, 6.20), (64, 6.13), (256, 6.30), (1024, 12.67), (2048, 20.85)],
          sp4: [(1, 6.64), (16, 6.78), (64, 6.72), (256, 6.84), (1024, 9.52), (2048, 14.40)],
          DP: [(1, 5.62), (16, 8.56), (64, 8.53), (256, 8.42), (1024, 8.52), (2048, 12.72), (8192, 44.10)]}
    dec = {TP: [(1, 3.44), (16, 3.49), (64, 4.05), (256, 6.36)],
           sp4: [(1, 6.93), (16, 7.12), (64, 7.60), (256, 39.37)],
           DP: [(1, 5.59), (16, 5.63), (64, 5.79), (256, 6.16)]}
    policy = AutoPolicy({lay: [(n, t * 1e-3) for n, t in c] for lay, c in ms.items()}, latency_goal_s=1.0,
                        decode_steps=32, switch_s=3.7e-3, initial=TP,
                        decode_curves={lay: [(n, t * 1e-3) for n, t in c] for lay, c in dec.items()})
    cases = [(facts(2048, waiting=256, waiting_prefill_tokens=256 * 1050), DP),
             (facts(2048, running=100, waiting=150, waiting_prefill_tokens=150 * 1050), DP),
             (facts(256, running=256), DP), (facts(200, running=200), TP), (facts(32, running=32), TP),
             (facts(1024, running=8, waiting=1, waiting_prefill_tokens=1000), sp4), (facts(8, running=8), TP)]
    for f, want in cases:
        for current in (TP, sp4, DP):
            assert policy.decide(f, current) == want, (f, current)


def test_auto_policy_switch_cost_keeps_the_current_layout_for_small_gains():
    curves = {DP: BASE_CURVE, TP: SHIFT_CURVE}
    f = facts(2048)  # DP: 4.86 ms, TP: 8.0 ms
    assert AutoPolicy(curves, latency_goal_s=1.0, switch_s=0.003).decide(f, TP) is DP
    assert AutoPolicy(curves, latency_goal_s=1.0, switch_s=0.004).decide(f, TP) is TP
    assert AutoPolicy(curves, latency_goal_s=1.0, switch_s=0.004).decide(f, DP) is DP


def test_auto_policy_ties_go_to_current_then_declaration_order():
    same = [(1, 1e-3), (100, 2e-3)]
    a, b, c = SPTP, TP, DP
    policy = AutoPolicy({a: same, b: same, c: same}, latency_goal_s=1.0)
    assert [policy.decide(facts(50), cur) for cur in (a, b, c)] == [a, b, c]


# --- every policy: determinism, declared answers, the contract's checks --------------------------

def _policies():
    return [ShiftThresholdPolicy(SPTP, 64),
            LoadPolicy(DP, TP, low=2, high=6, urgent_priority=0),
            PrefillDecodePolicy(SPTP, TP),
            AutoPolicy({SPTP: BASE_CURVE, TP: SHIFT_CURVE, DP: [(1, 1.5e-3), (4096, 12e-3)]},
                       latency_goal_s=0.01, decode_steps=10, switch_s=1e-3)]


def _random_facts(rng):
    waiting = rng.randrange(0, 6)
    return StepFacts(scheduled_tokens=rng.choice([1, 7, 64, 65, 900, 5000]), running=rng.randrange(0, 12),
                     waiting=waiting, waiting_prefill_tokens=rng.randrange(0, 3000) if waiting else 0,
                     host_tier_used=rng.randrange(0, 9), host_tier_capacity=8,
                     priorities=tuple(rng.randrange(-1, 4) for _ in range(min(waiting, 3))))


@pytest.mark.parametrize("index", range(4))
def test_policies_are_deterministic_and_answer_a_declared_layout(index):
    """Two ranks: separate policy objects fed equal (separately built) facts give the same answers."""
    rank0, rank1 = _policies()[index], _policies()[index]
    rng = random.Random(index)
    trace = [_random_facts(rng) for _ in range(500)]
    copy = [StepFacts(**{k: getattr(f, k) for k in f.__dataclass_fields__}) for f in trace]
    a, b = run(rank0, trace), run(rank1, copy)
    assert a == b
    assert all(any(lay is d for d in rank0.layouts) for lay in a)
    assert len(set(a)) > 1  # the trace exercises more than one answer


@pytest.mark.parametrize("index", range(4))
def test_current_must_be_declared(index):
    policy = _policies()[index]
    stranger = ParallelLayout(W, sp=4)
    with pytest.raises(ValueError, match="not one of the declared layouts"):
        policy.decide(facts(host_tier_capacity=1), stranger)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: LoadPolicy(DP, TP, low=4, high=4), r"low < high .*low=4, high=4"),
    (lambda: LoadPolicy(DP, TP, low=-1, high=4), r"low must be an int >= 0, got -1"),
    (lambda: LoadPolicy(DP, TP, low=1, high=4, urgent_priority=0.5), "urgent_priority must be an int"),
    (lambda: LoadPolicy(DP, DP, low=1, high=4), "must differ"),
    (lambda: LoadPolicy(DP, ParallelLayout(8, tp=8), low=1, high=4), r"one world size, got world sizes \[4, 8\]"),
    (lambda: LoadPolicy(DP, TP, low=1, high=4, initial=SPTP), "initial layout .* not one of the declared"),
    (lambda: PrefillDecodePolicy(SPTP, "tp"), "must be ParallelLayout"),
    (lambda: ShiftThresholdPolicy(SPTP, -1), "threshold must be an int >= 0"),
    (lambda: ShiftThresholdPolicy("sp2tp2"), "base must be a ParallelLayout"),
    (lambda: AutoPolicy({}, latency_goal_s=1.0), "non-empty dict"),
    (lambda: AutoPolicy({TP: SHIFT_CURVE}, latency_goal_s=0), r"latency_goal_s .* > 0, got 0"),
    (lambda: AutoPolicy({TP: SHIFT_CURVE}, latency_goal_s=1.0, switch_s=-1), r"switch_s .* >= 0, got -1"),
    (lambda: AutoPolicy({TP: SHIFT_CURVE}, latency_goal_s=1.0, decode_steps=1.5), "decode_steps must be an int"),
    (lambda: StepTimeCurve([]), r"\(tokens, seconds\) pairs"),
    (lambda: StepTimeCurve([(8, 1.0), (8, 2.0)]), r"strictly increasing, got \[8, 8\]"),
    (lambda: StepTimeCurve([(0, 1.0)]), "curve tokens must be an int >= 1, got 0"),
    (lambda: StepTimeCurve([(8, float("nan"))]), "curve seconds must be a finite number"),
    (lambda: StepTimeCurve([(8, 0.0)]), r"curve seconds .* > 0, got 0.0"),
])
def test_bad_configurations_name_the_constraint(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(("kw", "match"), [
    (dict(scheduled_tokens=0), "scheduled_tokens must be an int >= 1, got 0"),
    (dict(scheduled_tokens=4, running=-1), "running must be an int >= 0, got -1"),
    (dict(scheduled_tokens=4, waiting=True), "waiting must be an int"),
    (dict(scheduled_tokens=4, host_tier_used=5, host_tier_capacity=4), "host_tier_used=5 exceeds host_tier_capacity=4"),
    (dict(scheduled_tokens=4, waiting_prefill_tokens=9), "waiting_prefill_tokens=9 with waiting=0"),
    (dict(scheduled_tokens=4, running=1, priorities=(0, 1)), r"2 priorities for running \+ waiting = 1 \+ 0"),
    (dict(scheduled_tokens=4, running=1, priorities=(0.5,)), "priorities must be ints"),
])
def test_bad_facts_name_the_numbers(kw, match):
    with pytest.raises(ValueError, match=match):
        StepFacts(**kw)


def test_facts_are_hashable_values():
    a = StepFacts(4, running=2, priorities=[1, 0])
    assert a == StepFacts(4, running=2, priorities=(1, 0)) and hash(a) == hash(StepFacts(4, 2, priorities=(1, 0)))
    assert len({a, *itertools.repeat(StepFacts(4, 2, priorities=(1, 0)), 3)}) == 1
