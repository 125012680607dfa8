"""The per-task environment of the launcher contract, and the task wrapper that runs one component.

Every task gets `RLCTL_RUN_DIR`, `RLCTL_ATTEMPT`, `RLCTL_GROUP`, `RLCTL_RANK`, `RLCTL_WORLD_SIZE`,
`RLCTL_LOCAL_RANK`;
inference tasks also `RLCTL_SERVER_INDEX` and `RLCTL_BIND_HOST` (orchestrator tasks the latter too: a pool's
front listens there); trainer tasks the torch.distributed
variables `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, computed
from the trainer group's *own* nodes (on Slurm: `SLURM_JOB_NODELIST_HET_GROUP_K`), so every rank
agrees. The same function serves the local launcher (all nodes = this host).
"""
from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from rlctl.inference.processes import PRIVATE_UMASK, die_with_parent, exit_status, python_module_argv, stop_process_group
from rlctl.inference.server import LINUX_EPHEMERAL_PORTS, LISTEN_PORTS

# Rendezvous ports are derived from the job id so that all ranks agree without talking (so from fixed
# bounds, not each node's own port range). Above the listening servers' ports (free_port) and below
# Linux's default ephemeral range: a port in it can be the local end of some outgoing connection on the
# node when the rank binds it.
PORT_BASE = LISTEN_PORTS[1]
PORT_SPAN = LINUX_EPHEMERAL_PORTS[0] - PORT_BASE


def master_port_for(job_id: str) -> int:
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def component_env(*, run_dir: str, attempt: int, group: str, rank: int, local_rank: int,
                  local_world_size: int, world_size: int, node_index: int, node_addrs: list[str],
                  master_port: int) -> dict[str, str]:
    """The contract's variables for task `rank` of `group` (node_addrs: the group's nodes, in order)."""
    env = {
        "RLCTL_RUN_DIR": str(run_dir),
        "RLCTL_ATTEMPT": str(attempt),
        "RLCTL_GROUP": group,
        "RLCTL_RANK": str(rank),
        "RLCTL_WORLD_SIZE": str(world_size),
        # index of the task on its node: servers sharing a node pick their GPUs with it
        "RLCTL_LOCAL_RANK": str(local_rank),
        # a native crash (SIGSEGV in a kernel or a collective) then leaves every thread's Python stack in the
        # task's log instead of an empty file and an exit code
        "PYTHONFAULTHANDLER": "1",
    }
    host = node_addrs[node_index]
    if group == "inference":
        env["RLCTL_SERVER_INDEX"] = str(rank)
        env["RLCTL_BIND_HOST"] = host
    elif group == "orchestrator":  # a pool's front (pool_service) listens there for runs on other nodes
        env["RLCTL_BIND_HOST"] = host
    elif group == "trainer":
        env.update(
            MASTER_ADDR=node_addrs[0],
            MASTER_PORT=str(master_port),
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(local_world_size),
        )
    return env


def absolute_pythonpath(environ: dict | None = None, cwd: str | None = None) -> dict[str, str]:
    """`{"PYTHONPATH": ...}` with its relative entries made absolute against `cwd` (default: here), as
    Python itself reads them at start, or {} when it has none. Launch finds a recipe's `module:Class`
    from here, but components start in the run dir (locally and in the batch script), where `mods`
    meant something else; so `start_attempt` passes every task this value."""
    environ = os.environ if environ is None else environ
    value = environ.get("PYTHONPATH")
    if not value:
        return {}
    cwd = os.getcwd() if cwd is None else cwd
    resolved = os.pathsep.join(p if os.path.isabs(p) else os.path.normpath(os.path.join(cwd, p))  # "": cwd
                               for p in value.split(os.pathsep))
    return {"PYTHONPATH": resolved} if resolved != value else {}


def expand_nodelist(nodelist: str) -> list[str]:
    """`node[1-3],gpu7` → ['node1', 'node2', 'node3', 'gpu7'] (Slurm hostlist syntax)."""
    from submitit.slurm.slurm import _parse_node_list

    return _parse_node_list(nodelist)


@functools.lru_cache(maxsize=None)
def node_address(name: str) -> str:
    """The address other nodes reach `name` at: Slurm's NodeAddr (node names need not resolve)."""
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for field in out.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1]
    return name


def slurm_task_env(group, run_dir: str, attempt: int, environ: dict | None = None) -> dict[str, str]:
    """Contract env of the current srun task of `group` (a JobGroup), from Slurm's variables."""
    environ = os.environ if environ is None else environ
    k = group.het_index
    nodelist = (environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{k}") if group.shares_component is False
                else environ.get("SLURM_STEP_NODELIST"))
    nodelist = nodelist or environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"]
    names = expand_nodelist(nodelist)[: group.nodes]
    # name=addr pairs the batch script looked up once per component (see het_script.render_het_script)
    known = dict(p.split("=", 1) for p in environ.get(f"RLCTL_NODE_ADDRS_{k}", "").split(",") if "=" in p)
    this = environ.get("SLURMD_NODENAME", names[0])
    node_index = names.index(this) if this in names else int(environ.get("SLURM_NODEID", 0))
    env = component_env(
        run_dir=run_dir, attempt=attempt, group=group.name,
        rank=int(environ.get("SLURM_PROCID", 0)), local_rank=int(environ.get("SLURM_LOCALID", 0)),
        local_world_size=group.ntasks_per_node, world_size=group.ntasks, node_index=node_index,
        node_addrs=[known.get(n) or node_address(n) for n in names],
        master_port=master_port_for(environ.get("SLURM_JOB_ID", "0")),
    )
    if group.name == "trainer" and "OMP_NUM_THREADS" not in environ:  # the user's setting wins
        # The task's own CPUs, not the node's: a server colocated on the node has CPUs of its own step.
        env["OMP_NUM_THREADS"] = str(group.cpus_per_task)
    return env


def component_command(module: str, run_dir: str) -> list[str]:
    """argv of a component: nothing importable from the current directory (`-P`); launchers also run it
    with the run dir as its current directory and a private umask (`component_popen_options`)."""
    return [*python_module_argv(module, options=("-u",)), "--run-dir", str(run_dir)]


def component_popen_options(run_dir: str) -> dict:
    """How launchers start a component: in a session of its own (so it and everything it starts can be
    stopped together, see rlctl.inference.processes), in the run dir, with files private to the owner,
    and SIGTERM when the launcher dies."""
    return {"cwd": str(run_dir), "umask": PRIVATE_UMASK, "start_new_session": True, "preexec_fn": die_with_parent,
            "stdin": subprocess.DEVNULL}


def task_status_path(run, group_name: str, rank: int) -> Path:
    """`status/<group>.<group>.<rank>.json`: one task's start and exit, written by the local supervisor
    and (Slurm) by each task's wrapper; the failure summary (`run_summary.culprit`) reads them."""
    return run.status / f"{group_name}.{group_name}.{rank}.json"


def task_record(*, attempt: int, pid: int | None, state: str, started: float | None,
                returncode: int | None = None, ended: float | None = None) -> dict:
    """The fields of a task status file; the attempt tells a requeued job's records apart."""
    return {"pid": pid, "state": state, "returncode": returncode, "host": socket.gethostname(),
            "started": started, "ended": ended, "attempt": attempt}


class ComponentTask:
    """What each srun task runs (pickled by submitit): compute the env, run the component with its
    output in the run's log file, pass termination signals on, fail when the component fails."""

    def __init__(self, group, run_dir: str, attempt: int):
        self.group = group
        self.run_dir = str(run_dir)
        self.attempt = attempt

    def __call__(self) -> dict:
        from rlctl.orchestrator.exchange.files import atomic_write_json, private_dir
        from rlctl.orchestrator.exchange.layout import RunDir

        # a requeued job runs the same pickles as its next attempt (the batch script exports it)
        attempt = int(os.environ.get("RLCTL_ATTEMPT", self.attempt))
        env = slurm_task_env(self.group, self.run_dir, attempt)
        rank = int(env["RLCTL_RANK"])
        run = RunDir(Path(self.run_dir))
        log = run.log_path(attempt, self.group.name, f"{self.group.name}.{rank}")
        os.umask(PRIVATE_UMASK)  # the batch script sets it too; this task may run without it
        started = time.time()
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab", buffering=0) as out:
            child = subprocess.Popen(component_command(self.group.module, self.run_dir),
                                     env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                     **component_popen_options(self.run_dir))

        # submitit ignores SIGTERM in the task (it waits for USR2); the component must see it.
        def forward(signum, _frame):
            if exit_status(child) is None:
                child.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        while exit_status(child) is None:  # not wait(): the child's session is swept below, before reaping
            time.sleep(0.5)
        rc = stop_process_group(child, 0)  # what the component left running (e.g. its vLLM server) goes too
        # the exit as the local supervisor records it, with the attempt: the failure summary names the
        # task that failed first from these (a task srun kills after it records nothing)
        record = task_record(attempt=attempt, pid=child.pid, state="exited", started=started, returncode=rc,
                             ended=time.time())
        try:
            private_dir(run.status)
            atomic_write_json(task_status_path(run, self.group.name, rank), record)
        except OSError:
            pass  # a summary without its cause, not a task that fails for it
        if rc != 0:
            raise RuntimeError(f"{self.group.name} rank {rank} on {socket.gethostname()} exited with {rc}; log: {log}")
        return {"group": self.group.name, "rank": rank, "returncode": rc, "log": str(log)}
