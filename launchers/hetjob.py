"""Heterogeneous Slurm jobs through submitit (subclass, no fork).

The batch script (het_script.py) starts one `srun --het-group=K` step per group (each task runs
submitit's `python -m submitit.core._submit <folder>/<group>`, which unpickles that group's
ComponentTask) and supervises the steps. Per-group submitit folders are needed because every component
sees the leader's `SLURM_JOB_ID` and `SLURM_PROCID` restarts at 0 in each group.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from submitit.core import utils
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from rlctl.launchers.groups import JobGroup
from rlctl.launchers.het_script import render_het_script, strip_slurm_env
from rlctl.launchers.slurm_state import STATES

# Slurm states after which a job or component will not run again (PREEMPTED included: see slurm_state).
FAILED_STATES = tuple(raw for raw, ours in STATES.items() if ours in ("failed", "cancelled"))
_STATE_RANK = {"RUNNING": 1, "COMPLETING": 1, "PENDING": 2, "REQUEUED": 2, "COMPLETED": 3}


def combined_state(states: list[str]) -> str:
    """One state for a het job from its components' states: a failure wins, then running, then pending."""
    states = [s.split()[0] for s in states if s]  # 'CANCELLED by 0' -> 'CANCELLED'
    if not states:
        return "UNKNOWN"
    for s in states:
        if s in FAILED_STATES:
            return s
    return min(states, key=lambda s: _STATE_RANK.get(s, 0))


class HetInfoWatcher(SlurmInfoWatcher):
    """sacct lists a het job as `JOBID+K` rows (one per component; steps as `JOBID+K.step`). Keep each
    component under `JOBID+K` and map the job itself, `JOBID`, to the combined state."""

    def _make_command(self):
        to_check = {x.split("_")[0].split("+")[0] for x in self._registered - self._finished}
        if not to_check:
            return None
        command = ["sacct", "-o", "JobID,State,NodeList,ExitCode", "--parsable2"]
        for jid in sorted(to_check):
            command.extend(["-j", jid])
        return command

    def read_info(self, string) -> dict[str, dict[str, str]]:
        if not isinstance(string, str):
            string = string.decode()
        lines = string.splitlines()
        if len(lines) < 2:
            return {}
        names = lines[0].split("|")
        plain, parts = [], {}
        for line in lines[1:]:
            stats = {x: y.strip() for x, y in zip(names, line.split("|"))}
            jid = stats.get("JobID", "")
            if "+" in jid and "." not in jid:
                parts[jid] = stats
            else:
                plain.append(line)
        out = super().read_info("\n".join([lines[0], *plain])) if plain else {}
        leaders: dict[str, list[dict]] = {}
        for jid, stats in parts.items():
            out[jid] = stats
            leaders.setdefault(jid.split("+")[0], []).append(stats)
        for leader, rows in leaders.items():
            out[leader] = {"JobID": leader, "State": combined_state([r["State"] for r in rows]),
                           "NodeList": ",".join(r.get("NodeList", "") for r in rows)}
        return out


class HetJob(SlurmJob):
    """A submitted het job. `groups` is set by the executor; component states come from sacct."""

    watcher = HetInfoWatcher(delay_s=60)
    groups: list[JobGroup] = []

    def component_info(self, het_index: int, mode: str = "standard") -> dict[str, str]:
        self.watcher.get_info(self.job_id, mode=mode)
        return self.watcher.get_info(f"{self.job_id}+{het_index}", mode="cache")

    def group_job(self, name: str) -> SlurmJob:
        """A submitit job view of one group (its result pickles live in `<folder>/<group>`)."""
        group = next(g for g in self.groups if g.name == name)
        return HetJob(folder=self.paths.folder / name, job_id=self.job_id, tasks=list(range(group.ntasks)))


class HetSlurmExecutor(SlurmExecutor):
    """submitit's SlurmExecutor for het jobs: `submit_groups({group: callable})` → one HetJob."""

    job_class = HetJob

    def __init__(self, folder: Path, groups: list[JobGroup], *, job_name: str, batch_log: Path,
                 grace_period_s: int, env: dict[str, str] | None = None, python: str | None = None,
                 requeue: dict | None = None, hold: bool = False):
        super().__init__(folder, max_num_timeout=0, python=python)
        self.requeue = requeue
        self.hold = hold  # `sbatch --hold`: the job starts only once `scontrol release` is run
        self.groups = list(groups)
        self.job_name = job_name
        self.batch_log = Path(batch_log)
        self.grace_period_s = grace_period_s
        self.script_env = dict(env or {})
        Path(folder).mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_het_script(self.groups, Path(self.folder), self.python, job_name=self.job_name,
                                 batch_log=self.batch_log, grace_period_s=self.grace_period_s,
                                 env=self.script_env, requeue=self.requeue)

    def _num_tasks(self) -> int:
        return sum(g.ntasks for g in self.groups)

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        unset = [a for k in strip_slurm_env(dict(os.environ)) for a in ("-u", k)]
        # sbatch passes its umask on (SLURM_UMASK) to the files Slurm creates for the job (--output, --error)
        return ["env", *unset, "SLURM_UMASK=0077", "sbatch", *(["--hold"] if self.hold else []),
                str(submission_file_path)]

    def _internal_process_submissions(self, delayed_submissions):
        raise TypeError("het jobs are submitted with submit_groups(), one callable per group")

    def script_text(self) -> str:
        return self._make_submission_file_text("", "dry-run")

    def submit_groups(self, tasks: dict[str, object]) -> HetJob:
        missing = {g.name for g in self.groups} - set(tasks)
        if missing:
            raise ValueError(f"no task for group(s) {sorted(missing)}")
        tmp_folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        staged = {}
        for name, fn in tasks.items():
            pickle_path = tmp_folder / f".{uuid.uuid4().hex}.pkl"
            delayed = utils.DelayedSubmission(fn)
            delayed.set_timeout(0, 0)
            delayed.dump(pickle_path)
            os.chmod(pickle_path, 0o600)  # a pickle executes code when loaded
            staged[name] = pickle_path
        self._throttle()
        job = self._submit_command(self._submitit_command_str)
        job.groups = self.groups
        os.chmod(job.paths.submission_file, 0o600)
        for name, pickle_path in staged.items():
            HetJob(folder=Path(self.folder) / name, job_id=job.job_id).paths.move_temporary_file(
                pickle_path, "submitted_pickle")
        return job

