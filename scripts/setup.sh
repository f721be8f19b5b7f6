#!/usr/bin/env bash
# bash scripts/setup.sh [--test]
#
# Creates .venv beside this repo and installs zerorun into it (editable). torch: kept if the
# venv already has one (GPU users install their own CUDA build first); otherwise the pinned
# CPU build, because an unpinned torch pulls a multi-GB CUDA build. --test also installs the
# test extras and, when run as root with apt, the OpenSSH server the multi-node tests use.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q "torch==${ZERORUN_TORCH_VERSION:-2.13.0}"
fi
if [ "${1:-}" = "--test" ]; then
    .venv/bin/python -m pip install -q -e ".[test]"
    if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client) >/dev/null
    fi
else
    .venv/bin/python -m pip install -q -e .
fi
