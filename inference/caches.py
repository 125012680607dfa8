"""Caches kept outside the run directory, shared by one user's runs because their entries are keyed by
code and versions (docs/launch.md): vLLM's, torch inductor's compiled kernels (the servers' and a
compiled trainer's), and the tiny models the CPU recipes build."""
from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(name: str, override_env: str | None) -> str:
    """A cache shared by the user's runs: `$XDG_CACHE_HOME/rlctl/<name>` (or ~/.cache), unless the user
    names one in `override_env`. For caches keyed by code and versions, which are safe to share."""
    if override_env and os.environ.get(override_env):
        return os.environ[override_env]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(base / "rlctl" / name)


def compile_cache_dir() -> str:
    """Where torch's inductor keeps the kernels it compiles, shared by the user's runs.

    vLLM compiles a few sampler kernels with a C++ compiler on the first sampled request (on 2 CPU
    cores 8-10 s of the server's start). The default place is under TMPDIR, which a server points into
    its run directory, so every run compiled them again; keyed by code and torch version, they are
    safe to share. A TORCHINDUCTOR_CACHE_DIR naming torch's default is not the user's choice: torch's
    first look at its cache dir (importing torch._dynamo does one) writes the default into the
    environment, and a process started from this one would inherit a `/tmp` a job may not keep."""
    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    torchs_own = bool(named) and os.path.abspath(named) == os.path.abspath(torch_default_compile_dir())
    return user_cache_dir("torchinductor", None if torchs_own else "TORCHINDUCTOR_CACHE_DIR")


def torch_default_compile_dir(tmpdir: str | Path | None = None) -> Path:
    """torch's default inductor cache dir, `<tmpdir>/torchinductor_<user>` (tmpdir: tempfile's), named as
    torch names it (torch._inductor.runtime.cache_dir_utils.default_cache_dir) without importing torch."""
    import getpass
    import re
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    sanitized = re.sub(r'[\\/:*?"<>|]', "_", user)
    return Path(tmpdir or tempfile.gettempdir()) / f"torchinductor_{sanitized}"


def vllm_cache_dir() -> str:
    """vLLM's own cache, shared by the user's runs as vLLM itself shares ~/.cache/vllm. Its model-class
    facts (`modelinfos/`, keyed by a hash of the model's source) are otherwise found by importing vLLM
    once more in a subprocess at every server start (8-17 s on 2 CPU cores)."""
    return user_cache_dir("vllm", "VLLM_CACHE_ROOT")


def share_compile_cache(tmpdir: str | Path, cache_dir: str | Path) -> None:
    """Point `<tmpdir>/torchinductor_<user>` at `cache_dir`: torch puts its precompiled C++ header
    (≈ 150 MB, most of the first request's compile time) there whatever TORCHINDUCTOR_CACHE_DIR says, and
    the server's tmpdir is inside its run. A path that already exists is left as it is, unless it is
    the empty directory torch's first look at its cache dir creates: the link takes its place."""
    link = torch_default_compile_dir(tmpdir)
    try:
        if not link.is_symlink():
            link.rmdir()
    except OSError:
        pass  # absent or not empty
    if link.exists() or link.is_symlink():
        return
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path(cache_dir).resolve(), target_is_directory=True)
    except OSError:
        pass  # the server then compiles into its own tmpdir, as before: slower, not wrong
