"""Trace-driven simulation of several async RL runs on one cluster (`rlctl plan … --multiplex`).

A run is a loop of steps. Rollout batch n may start once batch n-1 is done and the trainer has
finished step n-1-off (off = max_off_policy_steps: with off = 0 the two sides alternate, with off >= 1
they overlap); trainer step n starts once step n-1 is done and batch n is in. This is the recurrence
whose steady state is the planner's async step (max of the two sides, or their sum when off = 0).

- isolated: each run has its trainer and inference nodes to itself (a batch takes its rollout time);
  runs that do not fit on the cluster together wait for nodes, first come first served.
- shared: each run keeps its trainer nodes (Spread: trainers on their own nodes), and every run's
  rollouts go to one pool of inference nodes, in chunks, scheduled by HRRS with a residency model per
  node; a node switching to another run's weights pays the setup cost (Backfill: the pool's idle
  capacity is filled with whichever run has rollouts queued). Runs whose trainer does not fit beside
  the pool wait, and later ones that fit are admitted first (backfill of the admission queue).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from rlctl.inference.pool_scheduler import HRRSScheduler, Request, Residency

CHUNKS_PER_NODE = 4
"""A batch's work on one of its inference nodes is split in this many requests, so that the pool can
interleave runs within a batch. At most `inference_nodes` chunks of a run are queued or running at once:
a batch is bounded by its longest rollouts' decode latency, so more nodes than its plan would not make
it faster, and the simulation never lets them."""


@dataclass(frozen=True)
class RunTrace:
    """One run's phase profile, from its plan."""

    name: str
    model: str
    """Architecture (one inference engine serves one): a switch between two pays an engine restart."""
    trainer_s: float
    rollout_s: float
    """A batch's time on the run's own inference nodes."""
    steps: int
    off_policy: int
    trainer_nodes: int
    inference_nodes: int
    weight_bytes_per_node: float
    """Inference weights a pool node holds to serve the run (every GPU's shard)."""

    @property
    def nodes(self) -> int:
        return self.trainer_nodes + self.inference_nodes


@dataclass(frozen=True)
class PoolNode:
    """Residency parameters of one pool node."""

    hbm_bytes: float
    host_bytes: float
    host_load_bytes_per_s: float
    cold_load_bytes_per_s: float
    engine_restart_s: float


class _Loop:
    """The step recurrence of one run; the caller says when batches finish."""

    def __init__(self, trace: RunTrace):
        self.t = trace
        self.next_batch = 1
        self.batch_running = False
        self.batch_done: dict[int, float] = {}
        self.trainer_done: dict[int, float] = {0: 0.0}
        self.trainer_step = 0  # last trainer step started
        self.trainer_busy = False
        self.start = 0.0

    def batch_ready(self, now: float) -> bool:
        n = self.next_batch
        if self.batch_running or n > self.t.steps:
            return False
        return n - 1 - self.t.off_policy <= 0 or (n - 1 - self.t.off_policy) in self.trainer_done

    def trainer_ready(self) -> bool:
        n = self.trainer_step + 1
        return not self.trainer_busy and n <= self.t.steps and n in self.batch_done

    @property
    def finished(self) -> bool:
        return self.t.steps in self.trainer_done


def isolated_wall(t: RunTrace) -> float:
    """Time from start to the last trainer step on the run's own nodes."""
    batch_end, trainer_end = 0.0, {0: 0.0}
    for n in range(1, t.steps + 1):
        gate = trainer_end.get(n - 1 - t.off_policy, 0.0)
        batch_end = max(batch_end, gate) + t.rollout_s
        trainer_end[n] = max(trainer_end[n - 1], batch_end) + t.trainer_s
    return trainer_end[t.steps]


def _summary(runs, starts, ends, walls, gpn: int, gpu_seconds: float, makespan: float, extra: dict) -> dict:
    busy = sum(r.steps * (r.trainer_s * r.trainer_nodes + r.rollout_s * r.inference_nodes) * gpn for r in runs)
    per_run = [{"name": r.name, "start_s": starts[i], "end_s": ends[i], "duration_s": ends[i] - starts[i],
                "slowdown": (ends[i] - starts[i]) / walls[i] if walls[i] > 0 else None,
                "completion_slowdown": ends[i] / walls[i] if walls[i] > 0 else None}
               for i, r in enumerate(runs)]
    return {"makespan_s": makespan, "gpu_hours": gpu_seconds / 3600,
            "utilization": busy / gpu_seconds if gpu_seconds > 0 else None, "runs": per_run, **extra}


def simulate_isolated(runs: list[RunTrace], cluster_nodes: int, gpn: int) -> dict:
    """Each run on its own split-async allocation; a run that does not fit waits for the earliest time
    enough nodes are free (in the order given)."""
    walls = [isolated_wall(r) for r in runs]
    ends_heap: list[tuple[float, int]] = []  # (end, nodes) of running allocations
    free, now = cluster_nodes, 0.0
    starts, ends = [0.0] * len(runs), [0.0] * len(runs)
    for i, r in enumerate(runs):
        while free < r.nodes:
            now, nodes = heapq.heappop(ends_heap)
            free += nodes
        starts[i], ends[i] = now, now + walls[i]
        free -= r.nodes
        heapq.heappush(ends_heap, (ends[i], r.nodes))
    gpu_s = sum(r.nodes * gpn * w for r, w in zip(runs, walls))
    return _summary(runs, starts, ends, walls, gpn, gpu_s, max(ends), {"nodes": cluster_nodes})


class _Shared:
    def __init__(self, runs, cluster_nodes: int, pool_nodes: int, gpn: int, node: PoolNode, eviction: str):
        self.runs, self.gpn = runs, gpn
        self.free_trainer_nodes = cluster_nodes - pool_nodes
        res = []
        for _ in range(pool_nodes):
            r = Residency(node.hbm_bytes, node.host_bytes, node.host_load_bytes_per_s, node.cold_load_bytes_per_s,
                          eviction=eviction, group_switch_s=node.engine_restart_s)
            for t in runs:
                r.register(t.name, t.weight_bytes_per_node, group=t.model)
            res.append(r)
        self.sched = HRRSScheduler(res)
        self.loops = [_Loop(t) for t in runs]
        self.by_name = {t.name: i for i, t in enumerate(runs)}
        self.waiting = list(range(len(runs)))  # not admitted yet, in order
        self.events: list = []
        self.seq = 0
        self.free_nodes = list(range(pool_nodes))
        self.chunks_left: dict[int, int] = {}
        self.unsubmitted: dict[int, int] = {}
        self.ends = [0.0] * len(runs)
        self.pool_nodes = pool_nodes
        self.held_s = 0.0  # pool node-seconds held: nodes no active run can use are released
        self.last = 0.0
        self.setup_s = 0.0

    def push(self, when: float, kind: str, data) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, data))

    def admit(self, now: float) -> None:
        for i in list(self.waiting):  # first come first served, later runs backfill what is left
            if self.runs[i].trainer_nodes <= self.free_trainer_nodes:
                self.free_trainer_nodes -= self.runs[i].trainer_nodes
                self.waiting.remove(i)
                self.loops[i].start = now
                self.advance(i, now)

    def advance(self, i: int, now: float) -> None:
        lp, t = self.loops[i], self.runs[i]
        if lp.batch_ready(now):
            n = lp.next_batch
            lp.batch_running = True
            self.chunks_left[i] = t.inference_nodes * CHUNKS_PER_NODE
            self.unsubmitted[i] = self.chunks_left[i]
            for _ in range(t.inference_nodes):  # one lane per inference node of its plan
                self.submit_chunk(i, n, now)
        if lp.trainer_ready():
            lp.trainer_busy = True
            lp.trainer_step += 1
            self.push(now + t.trainer_s, "trainer", (i, lp.trainer_step))

    def submit_chunk(self, i: int, n: int, now: float) -> None:
        if self.unsubmitted[i] > 0:
            self.unsubmitted[i] -= 1
            t = self.runs[i]
            self.sched.submit(Request(t.name, now, t.rollout_s / CHUNKS_PER_NODE, tag=(i, n)))

    def fill(self, now: float) -> None:
        while self.free_nodes and self.sched.queued():
            # the free node where the best request ranks highest: a resident run's node, when one is free
            node = max(self.free_nodes, key=lambda k: (max(self.sched.priority(r, k, now)
                                                           for r in self.sched.pending_runs()), -k))
            self.free_nodes.remove(node)
            d = self.sched.dispatch(node, now)
            self.setup_s += d.setup_s
            self.push(d.end, "chunk", (node, d.request.tag))

    def hold(self, now: float) -> None:
        active = sum(t.inference_nodes for i, t in enumerate(self.runs)
                     if i not in self.waiting and not self.loops[i].finished)
        self.held_s += min(self.pool_nodes, active) * (now - self.last)
        self.last = now

    def run(self) -> float:
        self.admit(0.0)
        self.fill(0.0)
        now = 0.0
        while self.events:
            now, _, kind, data = heapq.heappop(self.events)
            self.hold(now)
            if kind == "chunk":
                node, (i, n) = data
                self.free_nodes.append(node)
                self.free_nodes.sort()
                self.chunks_left[i] -= 1
                self.submit_chunk(i, n, now)
                if self.chunks_left[i] == 0:
                    lp = self.loops[i]
                    lp.batch_done[n] = now
                    lp.batch_running = False
                    lp.next_batch += 1
                    self.advance(i, now)
            else:
                i, n = data
                lp = self.loops[i]
                lp.trainer_done[n] = now
                lp.trainer_busy = False
                if lp.finished:
                    self.ends[i] = now
                    self.free_trainer_nodes += self.runs[i].trainer_nodes
                    self.admit(now)
                self.advance(i, now)
            self.fill(now)
        return now


def simulate_shared(runs: list[RunTrace], cluster_nodes: int, pool_nodes: int, gpn: int, node: PoolNode,
                    eviction: str = "cost") -> dict:
    """The runs' trainers on their own nodes, their rollouts on one HRRS-scheduled pool of `pool_nodes`.
    The pool holds at most as many nodes as its active runs' plans have inference nodes (more would idle:
    a run never has more chunks in flight), so it shrinks as runs finish."""
    sim = _Shared(runs, cluster_nodes, pool_nodes, gpn, node, eviction)
    makespan = sim.run()
    walls = [isolated_wall(r) for r in runs]
    starts = [lp.start for lp in sim.loops]
    trainer_s = sum(r.trainer_nodes * gpn * (sim.ends[i] - starts[i]) for i, r in enumerate(runs))
    gpu_s = trainer_s + sim.held_s * gpn
    return _summary(runs, starts, sim.ends, walls, gpn, gpu_s, makespan,
                    {"nodes": cluster_nodes, "pool_nodes": pool_nodes, "weight_switches": sim.sched.switches,
                     "setup_s": sim.setup_s})


def pool_candidates(runs: list[RunTrace], cluster_nodes: int) -> list[int]:
    """Pool sizes worth simulating: from the runs' mean rollout demand (node-seconds of rollouts per
    second of their async steps) up to the sum of their inference nodes, bounded by what leaves room
    for the largest trainer."""
    demand = sum(r.inference_nodes * r.rollout_s / max(r.rollout_s, r.trainer_s if r.off_policy else
                                                        r.rollout_s + r.trainer_s) for r in runs)
    top = min(sum(r.inference_nodes for r in runs), cluster_nodes - max(r.trainer_nodes for r in runs))
    low = max(1, min(top, math.ceil(demand)))
    return list(range(low, top + 1))
