"""The local launcher: a detached supervisor process runs every group's tasks as local processes.

`start_supervisor(run, attempt)` spawns `python -m rlctl.launchers.local --run-dir DIR --attempt N` in
its own session and returns at once. The supervisor starts each task in its own process group (so a
component's children — e.g. the router under the orchestrator — are stopped with it), keeps
`status/<group>.<group>.<rank>.json` and `status/supervisor.json` up to date, and applies the same
teardown as the Slurm job: a failed task has the others asked to stop at once (SIGTERM: the trainer
saves a checkpoint, the rest exit) and a finished orchestrator lets them exit on `DONE`; either way
whatever is left after `deployment.grace_period_s` is terminated (TERM, then KILL). SIGTERM to the
supervisor (`rlctl cancel`) stops everything; no process outlives it. Tasks run in sessions of their
own, so a task's servers and their children are stopped with it, even when the task died first
(rlctl.inference.processes). Everything runs in the run dir, with nothing importable from the current
directory (`python -P`) and files private to the owner (umask 077).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlctl.inference.processes import (PRIVATE_UMASK, ask_process_groups_to_stop, exit_status, private_umask,
                                       python_module_argv, stop_process_groups)
from rlctl.inference.server import free_port
from rlctl.launchers.env import (component_command, component_env, component_popen_options, task_record,
                                 task_status_path)
from rlctl.launchers.groups import JobGroup
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.files import FILE_MODE, atomic_write_json, private_dir
from rlctl.orchestrator.exchange.placement import shared_host_trainer_threads

# After TERM, seconds before KILL. Longer than a component's own bound for its servers
# (rlctl.inference.__main__.SERVER_STOP_S), so a component stops them before it is killed itself.
KILL_AFTER_S = 15.0


def status_dir(run: RunDir) -> Path:
    return run.status


def open_log(path: Path) -> int:
    """A log file for appending, owner-only whatever the caller's umask (a descriptor, for Popen)."""
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # an older log of a resumed run may predate the private modes
    return fd


def start_supervisor(run: RunDir, attempt: int, extra_env: dict | None = None) -> int:
    """`extra_env` reaches every task (the supervisor passes its environment on)."""
    log = run.attempt_logs(attempt) / "supervisor.log"
    private_dir(status_dir(run))
    record = status_dir(run) / "supervisor.json"
    # Replace the previous attempt's record first: it says "exited", which would read as this run's end;
    # its tasks' records go too (a follower showed their end states as this attempt's first).
    atomic_write_json(record, {"pid": None, "state": "starting", "returncode": None, "attempt": attempt})
    for stale in status_dir(run).glob("*.json"):
        if stale != record:
            stale.unlink(missing_ok=True)
    started = time.time()
    out = open_log(log)
    try:
        proc = subprocess.Popen(
            [*python_module_argv("rlctl.launchers.local"), "--run-dir", str(run.root), "--attempt", str(attempt)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            close_fds=True, env={**os.environ, **(extra_env or {})}, cwd=run.root, umask=PRIVATE_UMASK)
    except OSError:
        atomic_write_json(record, {"pid": None, "state": "exited", "returncode": 1, "attempt": attempt})
        raise
    finally:
        os.close(out)
    # The pid goes in now, not when the supervisor has imported (≈1 s later): until then a reader
    # would see a live-looking record without a process and call the run lost.
    atomic_write_json(record, {"pid": proc.pid, "state": "starting", "returncode": None, "attempt": attempt,
                               "started": started})
    return proc.pid


def trainer_threads(groups: list[JobGroup], cpus: int | None = None) -> int:
    """CPU threads per trainer rank on this host (`shared_host_trainer_threads`). Ranks that take every
    core fight the servers for them: on 2 cores a one-rank trainer with 2 threads made the
    generation-heavy peer bench's trainer steps 0.79 s long, with 1 thread 0.24-0.28 s."""
    count = {g.name: g.ntasks for g in groups}
    return shared_host_trainer_threads(cpus or os.cpu_count() or 1, count.get("inference", 0), count.get("trainer", 1))


class Task:
    def __init__(self, run: RunDir, attempt: int, group: JobGroup, rank: int, master_port: int,
                 threads: int = 1):
        self.group, self.rank = group, rank
        self.status_path = task_status_path(run, group.name, rank)
        self.log = run.log_path(attempt, group.name, f"{group.name}.{rank}")
        self.env = component_env(
            run_dir=str(run.root), attempt=attempt, group=group.name, rank=rank,
            local_rank=rank % group.ntasks_per_node, local_world_size=group.ntasks_per_node,
            world_size=group.ntasks, node_index=rank // group.ntasks_per_node,
            node_addrs=["127.0.0.1"] * group.nodes, master_port=master_port)
        if group.name == "trainer" and "OMP_NUM_THREADS" not in os.environ:  # the user's setting wins
            self.env["OMP_NUM_THREADS"] = str(threads)
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.info = task_record(attempt=attempt, pid=None, state="starting", started=None)

    def start(self, run: RunDir) -> None:
        out = open_log(self.log)
        try:
            self.proc = subprocess.Popen(component_command(self.group.module, str(run.root)),
                                         env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT,
                                         **component_popen_options(str(run.root)))
        finally:
            os.close(out)
        self.info.update(pid=self.proc.pid, state="running", started=time.time())
        atomic_write_json(self.status_path, self.info)

    def running(self) -> bool:
        """Whether the task still runs; an exited task's leftovers are killed (its session, while its
        pid is still reserved: the task is reaped only after that) and its end is recorded."""
        if self.returncode is None and self.proc is not None and exit_status(self.proc) is not None:
            self.ended(stop_process_groups([self.proc], 0)[0])
        return self.proc is not None and self.returncode is None

    def ended(self, rc: int) -> None:
        self.returncode = rc
        self.info.update(state="exited", returncode=rc, ended=time.time())
        atomic_write_json(self.status_path, self.info)


class Supervisor:
    def __init__(self, run: RunDir, attempt: int):
        self.run, self.attempt = run, attempt
        recipe = json.loads(run.recipe_json.read_text())
        self.grace = float(recipe["deployment"]["grace_period_s"])
        groups = [JobGroup.from_dict(g) for g in json.loads((run.configs / "groups.json").read_text())]
        port = free_port("127.0.0.1")  # the trainers' rendezvous
        threads = trainer_threads(groups)
        self.tasks = [Task(run, attempt, g, r, port, threads) for g in groups for r in range(g.ntasks)]
        self.cancelled = False
        self.status = status_dir(run) / "supervisor.json"
        self.started = time.time()

    def _on_signal(self, signum, _frame) -> None:
        self.cancelled = True

    def _write(self, state: str, rc: int | None) -> None:
        atomic_write_json(self.status, {"pid": os.getpid(), "state": state, "returncode": rc,
                                        "attempt": self.attempt, "started": self.started, "time": time.time()})

    def log(self, msg: str) -> None:
        print(f"[rlctl {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def stop_all(self) -> None:
        """TERM every running task's session at once, KILL what is left after KILL_AFTER_S."""
        live = [t for t in self.tasks if t.running()]
        for t, rc in zip(live, stop_process_groups([t.proc for t in live], KILL_AFTER_S)):
            t.ended(rc)

    def run_all(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._write("running", None)
        for t in self.tasks:
            t.start(self.run)
        self.log(f"started {len(self.tasks)} tasks")
        rc_final, deadline, seen = 0, None, set()
        while True:
            if self.cancelled:
                self.log("cancelled: stopping every task")
                self.stop_all()
                self._write("cancelled", 143)
                return 143
            running = 0
            for t in self.tasks:
                if t.running():
                    running += 1
                    continue
                rc = t.returncode
                if id(t) in seen:
                    continue
                seen.add(id(t))
                self.log(f"{t.group.name} rank {t.rank} exited with code {rc}")
                if rc != 0 and rc_final == 0:
                    rc_final = rc if rc > 0 else 128 - rc
                if deadline is None and (rc != 0 or t.group.name == "orchestrator"):
                    deadline = time.time() + self.grace
                    if rc != 0:
                        # told at once, the others wind down now (the trainer checkpoints) instead of
                        # idling through the grace period: it bounds their wind-down, then they are killed
                        self.log(f"asking the other tasks to stop (SIGTERM); what is left in {self.grace:g}s is terminated")
                        ask_process_groups_to_stop([o.proc for o in self.tasks])  # only the running ones are signalled
                    else:  # the others exit on DONE
                        self.log(f"stopping the other tasks within {self.grace:g}s")
            if running == 0:
                break
            if deadline is not None and time.time() >= deadline:
                self.log("grace period over: terminating the remaining tasks")
                self.stop_all()
                break
            time.sleep(0.2)
        self.stop_all()
        self.log(f"done with code {rc_final}")
        self._write("exited", rc_final)
        return rc_final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rlctl local supervisor (started by `rlctl launch`)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--attempt", type=int, default=0)
    args = parser.parse_args(argv)
    private_umask()
    sup = Supervisor(RunDir(Path(args.run_dir)), args.attempt)
    try:
        return sup.run_all()
    except BaseException:
        sup.stop_all()
        sup._write("exited", 1)
        raise


if __name__ == "__main__":
    sys.exit(main())
