"""Starting and stopping the processes of a run, so that none outlives it.

Layout: the local launcher starts each component in a session of its own; a component starts its
servers (vLLM, the router) in a process group of their own inside that session. So a component can stop
its server's group without signalling itself, and the launcher reaches everything of a component —
its servers and their children included — through the session, even when the component died first.

Why TERM alone is not enough (each seen on vLLM 0.x): during start-up vLLM turns SIGTERM into a
KeyboardInterrupt that its ZMQ socket context swallows while it waits for the engine core's handshake,
after which the server waits `VLLM_ENGINE_READY_TIMEOUT_S` (600 s) for an engine that waits for it;
once its shutdown has begun, further SIGTERMs are ignored; and multiprocessing's resource_tracker
ignores SIGTERM by design. So every stop is TERM, then KILL of whatever is left after a bound.

PID reuse: a group or session is only signalled while its leader is our child and not yet reaped (a
zombie still holds its pid, and so the group's and session's number), and each process is checked to
belong to it right before it is signalled (through a pidfd where the kernel has them).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Iterable

from rlctl.orchestrator.exchange.procstat import HAVE_PROC, proc_stat

PR_SET_PDEATHSIG = 1
PRIVATE_UMASK = 0o077  # every file of a run 0600, every directory 0700 (see orchestrator/exchange/files.py)
KILL_WAIT_S = 10.0  # after SIGKILL, how long to wait for the kernel to take the processes down
_POLL_S = 0.05


def die_with_parent() -> None:
    """`preexec_fn` for such a child: the kernel sends it SIGTERM when its parent dies, even by SIGKILL.

    Linux only (elsewhere a no-op). The signal follows the *thread* that spawned the child, so spawn
    long-lived children from the main thread."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def own_group_dying_with_parent() -> None:
    """`preexec_fn` of a server a component starts: a process group of its own (so the component can
    stop the server's group without signalling itself) in the component's session (so the launcher
    still reaches it), and SIGTERM when the component dies."""
    os.setpgid(0, 0)
    die_with_parent()


def python_module_argv(module: str, python: str = sys.executable, *, options: tuple[str, ...] = (),
                       version: tuple[int, ...] = tuple(sys.version_info[:2])) -> list[str]:
    """`python [options] -m module` that never imports from the current directory (`-P`, Python >= 3.11;
    before, the same by hand: drop sys.path[0], which `-c` sets to the current directory, then run the
    module). `version` is that of `python`; arguments for the module follow the returned list."""
    if tuple(version) >= (3, 11):
        return [python, *options, "-P", "-m", module]
    boot = (f"import runpy, sys; del sys.path[0]; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [python, *options, "-c", boot]


def private_umask() -> None:
    """Files and directories this process (and its children) creates are the owner's only."""
    os.umask(PRIVATE_UMASK)


# Young-generation size at which Python's cyclic GC runs (CPython's default: 700 net container allocations).
# vLLM's API server builds and drops tens of thousands of small objects (requests, outputs, logprob lists,
# JSON) per step: at 700 it ran about 100 young and 1 full collection per step of the generation-heavy peer
# variant, 40 ms of its 0.3 CPU s (gc.callbacks in each process). At 50000 it ran 1-2 young collections in
# 54 steps and the engine core, which inherits it through the fork, none. What only the cyclic GC frees
# (objects in reference cycles) waits longer: up to this many objects between collections.
GC_YOUNG_THRESHOLD = 50_000


def fewer_gc_passes() -> None:
    """Run this process's cyclic GC far less often (a long-lived server or loop that allocates per request)."""
    import gc

    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def _wait_state(proc: subprocess.Popen) -> tuple[str, int | None]:
    """('running' | 'exited' | 'reaped', exit code) of a child, *never reaping it*: an exited child
    stays a zombie, which keeps its pid — the number of its group and session — from being reused."""
    if proc.returncode is not None:
        return "reaped", proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped behind Popen's back: let it record what it can
        proc.poll()
        return "reaped", proc.returncode
    except AttributeError:  # no waitid here: poll (reaps; stop_process_groups then signals nothing)
        return ("running", None) if proc.poll() is None else ("reaped", proc.returncode)
    if info is None or info.si_pid == 0:
        return "running", None
    return "exited", info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def exit_status(proc: subprocess.Popen) -> int | None:
    """`proc.poll()` without reaping: None while it runs, else its exit code (negative: killed by that
    signal). Use it instead of `poll` for children whose group `stop_process_groups` stops later."""
    state, code = _wait_state(proc)
    return None if state == "running" else code


def has_exited(proc: subprocess.Popen) -> bool:
    return _wait_state(proc)[0] != "running"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, session) of `pid`, None when it is gone."""
    fields = proc_stat(pid)
    return None if fields is None else (fields[0], int(fields[2]), int(fields[3]))


def members(leaders: Iterable[int]) -> dict[int, list[int]]:
    """Live processes (zombies excluded) in the process group or the session numbered by each leader."""
    found: dict[int, list[int]] = {leader: [] for leader in leaders}
    if not HAVE_PROC:
        for leader in found:
            try:
                os.killpg(leader, 0)
                found[leader].append(leader)
            except (ProcessLookupError, PermissionError):
                pass
        return found
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is None or st[0] == "Z":
                continue
            for number in {st[1], st[2]} & found.keys():
                found[number].append(int(entry.name))
    return found


def _send(pid: int, leader: int, sig: int) -> None:
    """Signal `pid` if it still belongs to `leader`'s group or session (pidfd: no race with PID reuse)."""
    if not HAVE_PROC:
        try:
            os.killpg(leader, sig)
        except (ProcessLookupError, PermissionError):
            pass
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):
        fd = None
    try:
        st = _stat(pid)
        if st is None or leader not in (st[1], st[2]):
            return
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    finally:
        if fd is not None:
            os.close(fd)


def _signal_all(found: dict[int, list[int]], sig: int) -> None:
    for leader, pids in found.items():
        for pid in pids:
            _send(pid, leader, sig)


def ask_process_groups_to_stop(procs: Iterable[subprocess.Popen]) -> None:
    """SIGTERM to each running child in `procs` and its process group (its session when it leads one),
    without waiting: they wind down by themselves (a trainer saves a checkpoint first);
    `stop_process_groups` later ends whatever is left."""
    running = [p.pid for p in procs if _wait_state(p)[0] == "running"]
    if running:
        _signal_all(members(running), signal.SIGTERM)


def stop_process_groups(procs: Iterable[subprocess.Popen], timeout_s: float) -> list[int]:
    """Stop each child in `procs` together with its process group (its whole session when it leads
    one): SIGTERM to all of them while the child runs, SIGKILL to everything left after `timeout_s`
    (at once for a child that has already exited: its leftovers had their chance). Returns the
    children's exit codes, in order. Children must not have been reaped (use `has_exited`, not `poll`):
    a reaped child's number may belong to a stranger by now, so its group is left alone."""
    procs = list(procs)
    states = {p.pid: _wait_state(p)[0] for p in procs}
    pinned = [pid for pid, state in states.items() if state != "reaped"]
    running = [pid for pid, state in states.items() if state == "running"]
    if running:
        _signal_all(members(running), signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(members(pinned).values()):
            time.sleep(_POLL_S)
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline and any((left := members(pinned)).values()):
        _signal_all(left, signal.SIGKILL)
        time.sleep(_POLL_S)
    return [p.wait() for p in procs]


def stop_process_group(proc: subprocess.Popen, timeout_s: float) -> int:
    """`stop_process_groups` for one child; returns its exit code."""
    return stop_process_groups([proc], timeout_s)[0]
