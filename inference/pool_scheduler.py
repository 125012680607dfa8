"""Highest-Response-Ratio-with-Setup (HRRS) scheduling for an inference pool shared by several runs.

Pure, deterministic, no I/O: the pool runtime and the multiplexing planner's simulation both drive it
with their own clock (`now`, seconds).

Each run has a FIFO queue of requests (a request is whatever a replica serves in one go: one rollout
batch, or one chunk of it). When a replica is free it serves the head request of the run with the
highest response ratio

    priority = (wait + expected service) / (expected service + setup cost)

where setup cost is 0 when the run's weights (or adapter) are resident in the replica's HBM, and
otherwise the time to bring them there from the tier they sit in (host RAM or NVMe / the shared
filesystem), plus the time to move the weights it evicts down to host RAM. A run's `wait` is how long
it has been waiting for the pool: since its head request arrived, or since the run was last dispatched
if that is later — a backlogged run does not bank the age of every queued request at once.

Starvation bound (single replica; it holds for each replica of a pool on its own, because a dispatch on
any replica only resets a run's wait). Let R be the number of runs with queued work, s_min the
smallest expected service, and D the longest dispatch (largest service + largest setup cost). A run r
that has waited w has priority >= w / D, while another run j has priority <= 1 + w_j / s_min. So once
w > A = D * (1 + (R - 1) * D / s_min), a run j can win only with w_j > (R - 1) * D. Among any R
consecutive dispatches that are not r's, some run j appears twice, less than (R - 1) * D apart, so its
wait at the second one is below (R - 1) * D: a contradiction. Hence after A, r is dispatched within
the dispatch in progress plus R - 1 more:

    wait <= starvation_bound(R, s_min, D) = D * (1 + (R - 1) * D / s_min) + R * D

(the pool is work-conserving: a free replica never idles while a request is queued).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable, Literal

HBM, HOST, COLD = "hbm", "host", "cold"
"""Residency tiers, fastest first: GPU memory, the node's host RAM, NVMe / the shared filesystem."""


@dataclass(frozen=True)
class Request:
    run: str
    arrival: float
    """When it was queued (seconds, the caller's clock)."""
    service_s: float
    """Expected service time on one replica, setup excluded (> 0)."""
    tag: object = None
    """The caller's handle (e.g. step and chunk index); the scheduler never reads it."""


@dataclass(frozen=True)
class Dispatch:
    replica: int
    request: Request
    start: float
    setup_s: float
    """Time spent making the run's weights resident before serving (0 when they were)."""
    priority: float

    @property
    def end(self) -> float:
        return self.start + self.setup_s + self.request.service_s


def starvation_bound(runs: int, min_service_s: float, max_dispatch_s: float) -> float:
    """Longest a queued run waits for a replica (derivation in the module docstring)."""
    r, d = max(1, runs), max_dispatch_s
    return d * (1 + (r - 1) * d / min_service_s) + r * d


@dataclass
class Residency:
    """Which runs' weights one replica (a node of the pool) holds in HBM and in host RAM.

    Capacities are bytes; load rates are the bytes per second of moving weights into HBM from host RAM
    and from the cold tier (NVMe / shared filesystem, which holds every run's published weights).
    Eviction from HBM writes the weights down to host RAM; eviction from host RAM drops them (the cold
    tier still has them). `eviction`: `lru` evicts the least recently used run; `cost` first evicts runs
    with no queued work, then the cheapest to bring back (smallest), least recently used on ties.
    `group_switch_s` is added when no run of the same group (model architecture: one inference engine)
    stays resident — a different architecture needs an engine restart, not an in-place reload."""

    hbm_bytes: float
    host_bytes: float
    host_load_bytes_per_s: float
    cold_load_bytes_per_s: float
    eviction: Literal["lru", "cost"] = "lru"
    group_switch_s: float = 0.0
    sizes: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)
    hbm: OrderedDict = field(default_factory=OrderedDict)
    host: OrderedDict = field(default_factory=OrderedDict)

    def register(self, run: str, nbytes: float, group: str | None = None) -> None:
        if nbytes > self.hbm_bytes:
            raise ValueError(f"run {run!r} needs {nbytes:.3g} bytes of HBM but a replica holds {self.hbm_bytes:.3g}")
        self.sizes[run] = float(nbytes)
        self.groups[run] = group

    def tier_of(self, run: str) -> str:
        return HBM if run in self.hbm else HOST if run in self.host else COLD

    def _victims(self, tier: OrderedDict, capacity: float, need: float, keep: str, pending: frozenset) -> list:
        used = sum(self.sizes[r] for r in tier if r != keep)
        order = [r for r in tier if r != keep]  # OrderedDict order: least recently used first
        if self.eviction == "cost":
            rank = {r: i for i, r in enumerate(order)}
            order.sort(key=lambda r: (r in pending, self.sizes[r], rank[r]))
        out = []
        for r in order:
            if used + need <= capacity:
                break
            out.append(r)
            used -= self.sizes[r]
        return out

    def setup_cost(self, run: str, pending: Iterable[str] = ()) -> float:
        """Seconds before `run` can be served here (0 when resident in HBM); changes nothing."""
        if run in self.hbm:
            return 0.0
        size = self.sizes[run]
        victims = self._victims(self.hbm, self.hbm_bytes, size, run, frozenset(pending))
        cost = sum(self.sizes[v] for v in victims if v not in self.host) / self.host_load_bytes_per_s
        cost += size / (self.host_load_bytes_per_s if run in self.host else self.cold_load_bytes_per_s)
        staying = [r for r in self.hbm if r not in victims]
        if not any(self.groups[r] == self.groups[run] for r in staying):
            cost += self.group_switch_s if staying or self.hbm or victims else 0.0
        return cost

    def make_resident(self, run: str, pending: Iterable[str] = ()) -> float:
        """Load `run` into HBM (evicting as needed), mark it most recently used; returns the setup cost."""
        cost = self.setup_cost(run, pending)
        if run in self.hbm:
            self.hbm.move_to_end(run)
            return cost
        for v in self._victims(self.hbm, self.hbm_bytes, self.sizes[run], run, frozenset(pending)):
            del self.hbm[v]
            self._to_host(v, pending)
        self.host.pop(run, None)
        self.hbm[run] = True
        return cost

    def _to_host(self, run: str, pending) -> None:
        if self.sizes[run] > self.host_bytes:
            return  # does not fit host RAM: only the cold tier keeps it
        for v in self._victims(self.host, self.host_bytes, self.sizes[run], run, frozenset(pending)):
            del self.host[v]
        self.host[run] = True
        self.host.move_to_end(run)


class HRRSScheduler:
    """Per-run FIFO queues and one Residency per replica; `dispatch` picks what a free replica serves."""

    def __init__(self, replicas: list[Residency]):
        if not replicas:
            raise ValueError("a pool needs at least one replica")
        self.replicas = replicas
        self.queues: dict[str, deque] = {}
        self.last_dispatch: dict[str, float] = {}
        self.switches = 0
        """Dispatches that paid a setup cost (weights not resident)."""

    def submit(self, request: Request) -> None:
        if not request.service_s > 0:
            raise ValueError(f"request of run {request.run!r}: expected service must be > 0")
        for res in self.replicas:
            if request.run not in res.sizes:
                raise ValueError(f"run {request.run!r} is not registered on every replica")
        self.queues.setdefault(request.run, deque()).append(request)

    def pending_runs(self) -> list[str]:
        return [r for r, q in self.queues.items() if q]

    def queued(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def wait(self, run: str, now: float) -> float:
        head = self.queues[run][0]
        return max(0.0, now - max(head.arrival, self.last_dispatch.get(run, head.arrival)))

    def priority(self, run: str, replica: int, now: float) -> float:
        """(wait + expected service) / (expected service + setup cost) of the run's head request."""
        service = self.queues[run][0].service_s
        setup = self.replicas[replica].setup_cost(run, self.pending_runs())
        return (self.wait(run, now) + service) / (service + setup)

    def dispatch(self, replica: int, now: float) -> Dispatch | None:
        """The request replica `replica`, free at `now`, serves next (None when nothing is queued).
        Ties go to the run queued first (dict order), so the result is deterministic."""
        pending = self.pending_runs()
        if not pending:
            return None
        best = max(pending, key=lambda r: self.priority(r, replica, now))
        prio = self.priority(best, replica, now)
        request = self.queues[best].popleft()
        setup = self.replicas[replica].make_resident(best, self.pending_runs())
        self.switches += setup > 0
        self.last_dispatch[best] = now
        return Dispatch(replica=replica, request=request, start=now, setup_s=setup, priority=prio)


class FIFOScheduler(HRRSScheduler):
    """Oldest request first, setup cost ignored: the baseline HRRS is compared with."""

    def dispatch(self, replica: int, now: float) -> Dispatch | None:
        pending = self.pending_runs()
        if not pending:
            return None
        best = min(pending, key=lambda r: self.queues[r][0].arrival)
        request = self.queues[best].popleft()
        setup = self.replicas[replica].make_resident(best, self.pending_runs())
        self.switches += setup > 0
        self.last_dispatch[best] = now
        return Dispatch(replica=replica, request=request, start=now, setup_s=setup, priority=0.0)
