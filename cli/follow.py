"""The one follow loop of `launch --wait`, `resume --wait` and `monitor --wait`: poll the run's state
(the same reader as `rlctl monitor`), show progress on stderr, stop when the run ended, a component
stalled (heartbeats, `monitoring.stall_timeout_s`) or the timeout passed."""
from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

from rlctl.launchers.status import DRY_RUN, ENDED

# run.json is replaced atomically and never removed while a run exists: missing this long, the run
# directory was deleted or moved, and nothing is left to follow (the wait would never end)
GONE_S = 10.0


def snapshot(run_dir: Path, with_errors: bool = True) -> tuple[dict, list[dict]]:
    """(summary, metric records) of a run as `rlctl monitor` shows it."""
    from rlctl.launchers.run_summary import log_errors, summarize
    from rlctl.launchers.status import run_state
    from rlctl.orchestrator.exchange.heartbeat import read_beats
    from rlctl.orchestrator.exchange.metrics import read_records

    status = run_state(run_dir)
    metrics = read_records(run_dir)
    errors = log_errors(run_dir, status.attempt, completed=status.state == "completed") if with_errors else []
    return summarize(status, metrics, errors, read_beats(run_dir)), metrics


class _Lines:
    """Progress on stderr: one rewritten line on a terminal, a new line only when something changed
    in logs and pipes."""

    def __init__(self, quiet: bool):
        self.quiet, self.tty = quiet, sys.stderr.isatty()
        self.last: str | None = None

    def show(self, line: str, keep: bool = False) -> None:
        if self.quiet or line == self.last:
            return
        if keep:  # a line that must stay (component states) ends the rewritten one first
            self.end()
            sys.stderr.write(line + "\n")
        else:
            sys.stderr.write(("\r\033[K" + line) if self.tty else line + "\n")
            self.last = line
        sys.stderr.flush()

    def end(self) -> None:
        if not self.quiet and self.tty and self.last is not None:
            sys.stderr.write("\n")
        self.last = None


def follow(run_dir: Path, quiet: bool = False, interval: float = 1.0, timeout: float | None = None) -> dict:
    """Follow the run until it ends (the final summary), a component stalls (`summary["stalled"]`
    names them) or `timeout` seconds pass (`summary["timed_out"]`)."""
    from rlctl.cli.monitor_view import progress_line

    deadline = None if timeout is None else time.monotonic() + timeout
    lines = _Lines(quiet)
    components = gone_since = None
    while True:
        try:
            summary, _ = snapshot(run_dir, with_errors=False)
        except (OSError, ValueError):
            time.sleep(interval)  # a file replaced right now; the next poll reads it whole
            continue
        if summary["state"] == "unknown" and not (Path(run_dir) / "run.json").exists():
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since >= GONE_S:
                lines.end()
                summary["state"] = "lost"
                summary["reason"] = f"{run_dir}/run.json is gone: the run directory was deleted or moved"
                return summary
        else:
            gone_since = None
        states = "  ".join(f"{c['name']}={c['state']}" for c in summary["components"])
        if states and states != components:
            lines.show(time.strftime("%H:%M:%S ") + states, keep=True)
            components = states
        lines.show(progress_line(summary))
        ended = summary["state"] in ENDED
        if ended or summary["stalled"]:
            lines.end()
            return snapshot(run_dir)[0] if ended else summary
        if deadline is not None and time.monotonic() >= deadline:
            lines.end()
            summary["timed_out"] = True
            return summary
        time.sleep(interval)


class Detached(Exception):
    """Following stopped by Ctrl-C or SIGTERM; the run itself goes on. `code` is the exit code (130, 143)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def follow_or_detach(run_dir: Path, name: str, **kwargs) -> dict:
    """`follow`, where Ctrl-C or SIGTERM (a CI job's timeout) stops the following only: one line says
    that the run keeps running and how to reach it, then Detached. A `launch --wait` that simply
    died left a run using the machine with nothing said about it."""
    def on_term(signum, frame):
        raise Detached(128 + signal.SIGTERM)

    main = threading.current_thread() is threading.main_thread()  # signal handlers: main thread only
    previous = signal.signal(signal.SIGTERM, on_term) if main else None
    try:
        return follow(run_dir, **kwargs)
    except (KeyboardInterrupt, Detached) as e:
        code = e.code if isinstance(e, Detached) else 130
        sys.stderr.write(f"\nrlctl: stopped following; run {name} keeps running "
                         f"(`rlctl monitor {name}`, `rlctl cancel {name}`)\n")
        raise Detached(code) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def exit_code(summary: dict) -> int:
    """0 for a completed run, 1 otherwise (failed, cancelled, lost, stalled), as `monitor --wait`: a
    component's own code (143 after a cancel, 137 after a kill, 2 or 3) would read as the CLI's own
    (killed, bad input, `--timeout`). `verdict` names the launcher's code."""
    return 0 if summary["state"] == "completed" and not summary["stalled"] else 1


def end_report(final: dict, logs: Path) -> list[str]:
    """What `--wait` prints when a run ended (or stalled): the reward, why it stalled or was lost, its
    last errors (what failed, without opening the logs), and the verdict with the exit code."""
    rc = exit_code(final)
    lines = []
    if final.get("reward_mean") is not None:
        lines.append(f"final reward mean {final['reward_mean']:.3f} (first {final['reward_first']:.3f}) "
                     f"after {final['steps_done']} step(s)")
    if final["stalled"]:
        from rlctl.launchers.run_summary import stall_message

        lines.append(f"run {final['name']} {stall_message(final)} (still running; `rlctl cancel` stops it)")
    if rc != 0 and final["state"] == "lost" and final.get("reason"):
        lines.append(f"run {final['name']} lost: {final['reason']}")
    if rc != 0 and final.get("errors"):
        lines.append("last errors in the logs:\n" + "\n".join(f"  {e['file']}: {e['line']}" for e in final["errors"]))
    return [*lines, f"run {verdict(final)} (exit code {rc}); logs: {logs}"]


def verdict(summary: dict) -> str:
    """`finished`, or the state in capitals with the launcher's exit code when it had one."""
    if summary["state"] == "completed" and not summary["stalled"]:
        return "finished"
    words = {"cancelled": "CANCELLED", "lost": "LOST", DRY_RUN: "NOT STARTED (a dry run)"}
    word = "STALLED" if summary["stalled"] else words.get(summary["state"], "FAILED")
    code = summary.get("exit_code")
    return word + (f", launcher exit code {code}" if isinstance(code, int) and code != 0 else "")
