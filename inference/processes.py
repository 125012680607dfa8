"""Children that cannot outlive their parent.

Components start their servers (vLLM, the router) and the local launcher starts components in their own
sessions, so each can be stopped as one process group. The price is that a killpg of the parent's group
no longer reaches them: if the parent dies before it stops them (SIGKILL, OOM, a teardown that
escalates), they would linger as orphans holding ports and memory. `die_with_parent` closes that gap.
"""
from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` for such a child: the kernel sends it SIGTERM when its parent dies, even by SIGKILL.

    Linux only (elsewhere a no-op). The signal follows the *thread* that spawned the child, so spawn
    long-lived children from the main thread."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
