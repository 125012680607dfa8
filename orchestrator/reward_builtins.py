"""Built-in reward functions (`orchestrator.reward.function = "exact_match" | "math" | "code"`).

Each takes (prompt, completion_text, **args) and returns a float in [0, 1]; the expected answer is
`prompt.target` (datasets fill it from their answer column).

- `exact_match`: 1 if the completion, stripped, equals the target (optionally ignoring case). Cheap,
  so it runs inline on the event loop (`reward_inline = True`).
- `math`: the completion's final answer is mathematically equal to the target, checked by the
  `math-verify` package (LaTeX, \\boxed{}, fractions, radicals: `\\frac{1}{2}` = `0.5`). An optional
  extra (`pip install 'rlctl[workloads]'`), imported only when used.
- `code`: the completion (its last ``` fenced block if it has one) is a Python program; it runs once per
  test of `prompt.info["tests"]` (a list of {"input", "output"}; default one test: stdin
  `prompt.info["input"]`, expected stdout `prompt.target`). Reward = fraction of tests whose stdout
  matches (whitespace-trimmed). A program that loops, crashes or exceeds its limits fails that test:
  it scores 0, it is not a reward failure.

The code sandbox (`run_program`): a fresh interpreter (`python -I`) in an empty temporary directory,
with rlimits on CPU time, address space, written file size and open files; stdout goes to a file
capped by RLIMIT_FSIZE (an endless print cannot fill the worker's memory), and the wall time is
bounded too (a sleeping program uses no CPU). No network, in two layers:
1. a network namespace with only a loopback interface that is down (`unshare -rn`, unprivileged user
   namespaces), where the system allows it: the kernel refuses every connection, whatever the
   program does;
2. always, a Python audit hook installed before the program runs that refuses to create sockets, start
   processes or load native code through ctypes (an unremovable hook; it is what blocks the network
   where namespaces are unavailable, e.g. some containers or hardened kernels). Both layers are always
   on where possible so that a program scores the same on every machine.
The same hook refuses writes, renames and deletions outside the sandbox directory. That part is
best-effort (Python-level, not a mount namespace): the sandbox is for policy-written programs of a
training run, not for hostile code.
"""
from __future__ import annotations

import functools
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from rlctl.recipes.errors import RecipeError


def exact_match(prompt, completion: str, *, ignore_case: bool = False) -> float:
    answer, target = completion.strip(), str(prompt.target).strip()
    if ignore_case:
        answer, target = answer.casefold(), target.casefold()
    return float(answer == target)


exact_match.reward_inline = True  # a string comparison: cheaper inline than a round trip to a worker


def math_answer(prompt, completion: str, *, float_rounding: int = 6) -> float:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise RecipeError("the `math` reward needs the math-verify package (pip install 'rlctl[workloads]')",
                          key="orchestrator.reward.function") from None
    # math-verify bounds its own parsing with SIGALRM, which only the main thread may use.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_latex(str(prompt.target)), parsing_timeout=timeout)
    answer = parse(completion, parsing_timeout=timeout)
    if not gold or not answer:
        return 0.0
    return float(verify(gold, answer, float_rounding=float_rounding, timeout_seconds=timeout))


def _as_latex(target: str) -> str:
    """A bare target (`\\frac{1}{2}`, `0.5`) in math delimiters, so the LaTeX parser reads it whole."""
    return target if "$" in target or "\\boxed" in target or "\\(" in target else f"${target}$"


def code_tests(prompt, completion: str, *, time_limit_s: float = 5.0, memory_mb: int = 512,
               output_limit_kb: int = 1024) -> float:
    code = extract_code(completion)
    tests = prompt.info.get("tests") or [{"input": prompt.info.get("input", ""), "output": prompt.target}]
    passed = 0
    for test in tests:
        result = run_program(code, str(test.get("input", "")), time_limit_s=time_limit_s, memory_mb=memory_mb,
                             output_limit_kb=output_limit_kb)
        passed += result.ok and result.stdout.strip() == str(test.get("output", "")).strip()
    return passed / len(tests)


_FENCE = re.compile(r"```[ \t]*[A-Za-z0-9_+-]*[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced code block of the completion, or the whole completion when it has none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


@dataclass
class ProgramResult:
    stdout: str
    returncode: int | None  # None: killed at the wall-time limit
    stderr_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


# Audit events a sandboxed program may not raise: network, new processes, native code via ctypes
# (which could call socket(2) or fork(2) directly). `import` of the raw modules that would do the same
# without the Python-level wrappers that raise these events is refused too.
_BOOTSTRAP = """
import sys
_EVENTS = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
           "socket.sendto", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
           "os.fork", "os.forkpty", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata"}
_MODULES = {"_posixsubprocess", "_ctypes", "_socket"}
_CHANGES = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
            "os.link", "os.symlink", "os.utime", "shutil.rmtree"}
import os
_HOME = os.path.realpath(os.getcwd()) + os.sep
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
def _outside(path):
    try:
        return not os.path.realpath(os.fsdecode(path)).startswith(_HOME)
    except (TypeError, ValueError):
        return True  # a file descriptor or something stranger: refused for writing
def _guard(event, args):
    if event in _EVENTS or (event == "import" and args and args[0] in _MODULES):
        what = f"import {args[0]}" if event == "import" else event
        raise PermissionError(f"{what} is not allowed in the reward sandbox")
    writing = event == "open" and ((args[1] or "r") != "r" and (args[1] or "r") != "rb" or (args[2] or 0) & _WRITE)
    if (writing or event in _CHANGES) and args and not isinstance(args[0], int) and _outside(args[0]):
        raise PermissionError(f"{event} outside the sandbox directory is not allowed")
if sys.argv[1:] == ["audit"]:
    sys.dont_write_bytecode = True
    sys.addaudithook(_guard)
sys.argv = ["main.py"]
import runpy
runpy.run_path("main.py", run_name="__main__")
"""


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Whether `unshare -rn` works here (probed once per process)."""
    if not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def run_program(code: str, stdin: str = "", *, time_limit_s: float = 5.0, memory_mb: int = 512,
                output_limit_kb: int = 1024, network_namespace: bool | None = None,
                audit_hook: bool = True) -> ProgramResult:
    """Run Python `code` in the sandbox described in the module docstring. `network_namespace=None`
    uses one where available; the two switches exist so that tests can check each layer alone."""
    use_namespace = network_namespace_available() if network_namespace is None else network_namespace
    cpu = max(1, int(time_limit_s + 0.999))

    def limits() -> None:  # in the child, between fork and exec
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (output_limit_kb << 10, output_limit_kb << 10))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    with tempfile.TemporaryDirectory(prefix="rlctl-sandbox-") as tmp:
        with open(os.path.join(tmp, "main.py"), "w") as f:
            f.write(code)
        with open(os.path.join(tmp, "stdin"), "w") as f:
            f.write(stdin)
        command = [sys.executable, "-I", "-c", _BOOTSTRAP, "audit" if audit_hook else "open"]
        if use_namespace:
            command = ["unshare", "-rn", "--", *command]
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8", "TMPDIR": tmp}
        with open(os.path.join(tmp, "stdin")) as fin, open(os.path.join(tmp, "stdout"), "wb") as fout, \
                open(os.path.join(tmp, "stderr"), "wb") as ferr:
            try:
                code_ = subprocess.run(command, stdin=fin, stdout=fout, stderr=ferr, cwd=tmp, env=env,
                                       preexec_fn=limits, timeout=2 * time_limit_s + 1).returncode
            except subprocess.TimeoutExpired:
                code_ = None
        with open(os.path.join(tmp, "stdout"), "rb") as f:
            stdout = f.read(output_limit_kb << 10).decode(errors="replace")
        with open(os.path.join(tmp, "stderr"), "rb") as f:
            stderr = f.read()[-2000:].decode(errors="replace")
    return ProgramResult(stdout, code_, stderr)
