"""Checks shared by the end-to-end tests of the tiny recipe (local and Slurm): metrics, monitor, leftovers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rlctl.orchestrator.exchange.metrics import OrchestratorStepRecord, TrainerStepRecord, keys_of, read_records

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "recipes" / "tiny-cpu.toml")
RLCTL = [sys.executable, "-m", "rlctl.cli.main"]

# The per-step metrics of the contract (the typed records of exchange/metrics.py), by the component
# that records them: named through the record classes, so a renamed field fails here too.
TRAINER_KEYS = keys_of(TrainerStepRecord, "trainer_step_time_s", "wait_batch_s", "mismatch_kl", "weight_publish_s")
ORCHESTRATOR_KEYS = keys_of(OrchestratorStepRecord, "reward_mean", "orchestrator_step_time_s", "wait_policy_s",
                            "rollouts_per_s", "tokens_per_s", "off_policy_lag_mean", "off_policy_lag_max",
                            "dropped_groups", "weight_reload_s")


def rlctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*RLCTL, *args], capture_output=True, text=True, timeout=timeout)


def launch_waiting(root: Path, recipe: str, name: str, *overrides: str, timeout: float = 900):
    """`rlctl launch RECIPE --name NAME --wait` into `root` (plus `-o` overrides): the one run a module's
    e2e checks share. Returns (run dir, completed process, wall seconds)."""
    t0 = time.monotonic()
    extra = [arg for o in overrides for arg in ("-o", o)]
    out = subprocess.run([*RLCTL, "launch", recipe, "--name", name, "-o", f"deployment.output_dir={root}", *extra,
                          "--wait"], capture_output=True, text=True, timeout=timeout)
    return root / name, out, time.monotonic() - t0


def metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """(trainer records, orchestrator records), each sorted by step."""
    recs = read_records(run)
    by = lambda comp: sorted((r for r in recs if r.get("component") == comp), key=lambda r: r["step"])  # noqa: E731
    return by("trainer"), by("orchestrator")


def best_window_mean(rewards: list[float], window: int = 5) -> float:
    """The best mean reward over `window` consecutive steps: what a run reached, whatever it did after."""
    return max(sum(rewards[i:i + window]) / window for i in range(len(rewards) - window + 1))


def learning_report(trainer: list[dict], orch: list[dict]) -> str:
    """A run's learning curve and what tells a slow curve from an unstable one (policy lag, trainer/
    inference mismatch, masked tokens, gradient norms) or from one stuck on confident wrong answers
    (entropy near zero below the reward bar), for the message of a failed reward check."""
    def series(recs, key, digits=4):
        return [round(r[key], digits) if isinstance(r.get(key), (int, float)) else None for r in recs]

    return "\n".join(f"{name} {values}" for name, values in (
        ("rewards", series(orch, "reward_mean", 3)), ("lag", series(orch, "off_policy_lag_mean", 2)),
        ("mismatch_kl", series(trainer, "mismatch_kl")), ("masked_fraction", series(trainer, "masked_fraction")),
        ("grad_norm", series(trainer, "grad_norm", 3)), ("entropy", series(trainer, "entropy", 3))))


def assert_contract_keys(trainer: list[dict], orch: list[dict]) -> None:
    assert trainer and orch, "no metrics recorded"
    for recs, keys in ((trainer, TRAINER_KEYS), (orch, ORCHESTRATOR_KEYS)):
        for r in recs:
            missing = [k for k in keys if not isinstance(r.get(k), (int, float))]
            assert not missing, f"step {r['step']} of {r['component']} lacks {missing}"
    # Numbers that must be real measurements, not placeholders.
    assert all(r["tokens_per_s"] > 0 and r["rollouts_per_s"] > 0 for r in orch)
    assert all(r["trainer_step_time_s"] > 0 and r["weight_publish_s"] > 0 for r in trainer)
    assert max(r["off_policy_lag_max"] for r in orch) <= 1  # the recipe's max_off_policy_steps
    assert any(r["weight_reload_s"] > 0 for r in orch)


def monitor_json(run: Path) -> dict:
    out = rlctl("monitor", str(run), "--once", "--json")
    return json.loads(out.stdout)


def _environ_mentions(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return False


def _holds_file_under(pid: int, root: str) -> bool:
    """Whether `pid` has a file under `root` open (e.g. its log): catches processes that rewrite their
    command line and environment for a process title, such as vllm-router."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd).startswith(root):
                return True
        except OSError:
            continue
    return False


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper that never comes in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cwd_under(pid: int, root: str) -> bool:
    """Whether `pid` runs in `root` or below (every component runs in its run dir)."""
    try:
        return (os.readlink(f"/proc/{pid}/cwd") + "/").startswith(root)
    except OSError:
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def leftover_processes(run: Path) -> list[str]:
    """Processes of this run still alive: recorded pids, anything naming the run dir on its command line,
    anything carrying the run's RLCTL_RUN_DIR (children such as vLLM's engine core inherit it), running
    in the run dir, or holding a file of it open — and any vLLM process or multiprocessing
    resource_tracker whose environment so much as mentions the run dir (its temporary files live there)."""
    left = []
    for path in (run / "status").glob("*.json"):
        pid = json.loads(path.read_text()).get("pid")
        if isinstance(pid, int) and running(pid):
            left.append(f"{path.stem} pid {pid}")
    found = subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True).stdout.split()
    left += [f"pgrep pid {p}" for p in found if int(p) != os.getpid()]
    needle = f"RLCTL_RUN_DIR={run}\0".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid() or not running(int(proc.name)):
            continue
        pid, cmdline = int(proc.name), _cmdline(int(proc.name))
        if _environ_mentions(pid, needle):
            left.append(f"env pid {pid}: {cmdline[:120]!r}")
        elif _holds_file_under(pid, f"{run}/") or _cwd_under(pid, f"{run}/"):
            left.append(f"open-file/cwd pid {pid}: {cmdline.split(bytes(1))[0][:60]!r}")
        elif (b"vllm" in cmdline.lower() or b"resource_tracker" in cmdline) and _environ_mentions(pid, str(run).encode()):
            left.append(f"vllm pid {pid}: {cmdline[:120]!r}")
    return sorted(set(left))


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    """Poll until `predicate()` is truthy and return its value; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
