"""HRRS scheduling of a shared inference pool: the priority formula, the starvation bound, and grouping of
requests of resident runs (fewer weight switches than FIFO)."""
import random

import pytest

from rlctl.inference.pool_scheduler import (COLD, HBM, HOST, FIFOScheduler, HRRSScheduler, Request, Residency,
                                            starvation_bound)

GB = 1e9


def _res(hbm=10 * GB, host=30 * GB, eviction="lru", group_switch_s=0.0, runs=(("a", 10 * GB),)):
    r = Residency(hbm_bytes=hbm, host_bytes=host, host_load_bytes_per_s=10 * GB, cold_load_bytes_per_s=1 * GB,
                  eviction=eviction, group_switch_s=group_switch_s)
    for name, size in runs:
        r.register(name, size)
    return r


def test_priority_formula_as_specified():
    res = _res(hbm=10 * GB, runs=[("a", 5 * GB), ("b", 5 * GB), ("c", 5 * GB)])
    res.make_resident("a")
    res.make_resident("b")
    res.make_resident("c")  # evicts a (LRU) to host RAM: a in host, b and c in HBM
    assert (res.tier_of("a"), res.tier_of("b"), res.tier_of("c")) == (HOST, HBM, HBM)
    res.register("d", 5 * GB)  # never loaded: cold tier
    assert res.tier_of("d") == COLD
    s = HRRSScheduler([res])
    s.submit(Request("a", 0.0, 2.0))
    s.submit(Request("b", 1.0, 4.0))
    s.submit(Request("d", 3.0, 1.0))
    now = 10.0
    # a from host: 5 GB at 10 GB/s + writing the LRU victim (b) down to host: 5 GB at 10 GB/s
    assert res.setup_cost("a") == pytest.approx(0.5 + 0.5)
    assert s.priority("a", 0, now) == pytest.approx((10.0 + 2.0) / (2.0 + 1.0))
    assert s.priority("b", 0, now) == pytest.approx((9.0 + 4.0) / (4.0 + 0.0))  # resident: setup 0
    # d from the cold tier: 5 GB at 1 GB/s, plus the victim's move to host
    assert s.priority("d", 0, now) == pytest.approx((7.0 + 1.0) / (1.0 + 5.0 + 0.5))
    d = s.dispatch(0, now)
    assert d.request.run == "a" and d.setup_s == pytest.approx(1.0) and d.end == pytest.approx(13.0)
    assert d.priority == pytest.approx(4.0)
    # the run's wait restarts at its dispatch: a backlogged run does not bank its queue's age
    s.submit(Request("a", 2.0, 4.0))
    assert s.wait("a", 12.0) == pytest.approx(2.0)
    assert s.priority("b", 0, 13.0) == pytest.approx((12.0 + 4.0) / (4.0 + 0.5 + 0.5))  # b was evicted


def test_group_switch_cost_when_no_engine_of_the_architecture_stays():
    res = _res(hbm=10 * GB, group_switch_s=60.0, runs=[])
    res.register("x", 6 * GB, group="qwen")
    res.register("y", 6 * GB, group="llama")
    res.register("z", 3 * GB, group="qwen")
    assert res.make_resident("x") == pytest.approx(6.0)  # an empty replica: the first load, no restart
    assert res.setup_cost("z") == pytest.approx(3.0)  # x (same architecture) stays resident
    assert res.setup_cost("y") == pytest.approx(6.0 / 10 + 6.0 + 60.0)  # x evicted: another engine


def test_cost_aware_eviction_keeps_runs_with_queued_work():
    lru = _res(hbm=10 * GB, runs=[("a", 4 * GB), ("b", 4 * GB), ("c", 4 * GB)])
    cost = _res(hbm=10 * GB, eviction="cost", runs=[("a", 4 * GB), ("b", 4 * GB), ("c", 4 * GB)])
    for r in (lru, cost):
        r.make_resident("a")
        r.make_resident("b")
        r.make_resident("c", pending={"a"})
    assert lru.tier_of("a") == HOST and lru.tier_of("b") == HBM
    assert cost.tier_of("a") == HBM and cost.tier_of("b") == HOST


def _drive(sched, arrivals, check_bound=None):
    """Serve `arrivals` [(time, Request)] on replica 0 (work-conserving); returns the dispatches. With
    `check_bound` (the starvation bound), asserts that no queued run ever waits longer."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    now, out, i = 0.0, [], 0
    while i < len(arrivals) or sched.queued():
        while i < len(arrivals) and arrivals[i][0] <= now:
            sched.submit(arrivals[i][1])
            i += 1
        if not sched.queued():
            now = arrivals[i][0]
            continue
        if check_bound is not None:
            worst = max(sched.wait(r, now) for r in sched.pending_runs())
            assert worst <= check_bound, (worst, check_bound)
        d = sched.dispatch(0, now)
        out.append(d)
        now = d.end
    return out


@pytest.mark.parametrize("seed", range(8))
def test_starvation_free_within_the_bound(seed):
    """Overloaded pool (arrivals faster than service), runs of different sizes, some too large to share
    HBM with another: every queued run is served within starvation_bound(...)."""
    rng = random.Random(seed)
    runs = [(f"r{k}", rng.choice([2, 4, 8]) * GB) for k in range(rng.randint(2, 6))]
    res = _res(hbm=8 * GB, host=12 * GB, eviction=rng.choice(["lru", "cost"]), group_switch_s=5.0, runs=runs)
    services = [0.5, 1.0, 3.0]
    arrivals = []
    for name, _ in runs:
        t = rng.uniform(0, 5)
        for _ in range(60):
            arrivals.append((t, Request(name, t, rng.choice(services))))
            t += rng.expovariate(len(runs) / 1.2)  # offered load well above 1
    setup_max = max(size for _, size in runs) * (1 / (10 * GB) + 1 / GB) + 5.0
    bound = starvation_bound(len(runs), min(services), max(services) + setup_max)
    sched = HRRSScheduler([res])
    served = _drive(sched, arrivals, check_bound=bound)
    assert len(served) == len(arrivals)


def test_a_non_resident_run_is_not_starved_by_a_stream_of_resident_work():
    # the adversarial case for setup costs: run "hot" (resident) always has work queued; "cold" (a large
    # setup cost) has one request. FIFO-less greed would never switch; HRRS must, within the bound.
    res = _res(hbm=10 * GB, runs=[("hot", 10 * GB), ("cold", 10 * GB)])
    res.make_resident("hot")
    arrivals = [(0.5 * k, Request("hot", 0.5 * k, 0.5)) for k in range(400)]
    arrivals.append((1.0, Request("cold", 1.0, 0.5)))
    sched = HRRSScheduler([res])
    served = _drive(sched, arrivals)
    cold = next(d for d in served if d.request.run == "cold")
    bound = starvation_bound(2, 0.5, 0.5 + 10 + 1)
    assert cold.start - 1.0 <= bound
    assert cold.setup_s > 0


def test_setup_cost_groups_resident_runs():
    """Interleaved arrivals of two runs whose weights cannot both be resident: FIFO switches on almost
    every request; HRRS serves several requests of the resident run per switch."""
    def fresh(cls):
        res = _res(hbm=10 * GB, runs=[("a", 10 * GB), ("b", 10 * GB)])
        return cls([res])

    arrivals = []
    for k in range(100):
        arrivals.append((1.0 * k, Request("a", 1.0 * k, 1.0)))
        arrivals.append((1.0 * k + 0.5, Request("b", 1.0 * k + 0.5, 1.0)))
    hrrs, fifo = fresh(HRRSScheduler), fresh(FIFOScheduler)
    _drive(hrrs, arrivals)
    _drive(fifo, arrivals)
    assert fifo.switches >= 150
    assert hrrs.switches * 3 <= fifo.switches, (hrrs.switches, fifo.switches)


def test_bad_requests_are_refused():
    sched = HRRSScheduler([_res()])
    with pytest.raises(ValueError):
        sched.submit(Request("a", 0.0, 0.0))
    with pytest.raises(ValueError):
        sched.submit(Request("unknown", 0.0, 1.0))
    with pytest.raises(ValueError):
        _res(hbm=1 * GB, runs=[("big", 2 * GB)])
