#!/usr/bin/env bash
# bash scripts/setup.sh [--test]
#
# Creates .venv beside this repo and installs zerorun into it (editable). torch: kept if the
# venv already has one, or if $PYTHON has one (the venv then sees the system's packages: a GPU
# image's CUDA torch is reused, and nothing it has is fetched); otherwise pip installs
# torch==2.13.0 from the configured package index: from PyPI on Linux x86_64 that is the CUDA
# build with its NVIDIA libraries (several GB; it runs on CPU too), where a local CPU wheel is
# offered first (our CI machine's pip has one) it is the CPU build. ZERORUN_TORCH_INDEX=URL
# passes --index-url for torch alone (e.g. PyTorch's CPU wheel index). --test also installs the
# test extras and, when run as root with apt, the OpenSSH server the multi-node tests use and
# Debian's slurm-wlm and munge for the Slurm tests (tests/e2e/test_slurm_jobs.py starts its own
# private cluster with its own config, key and ports; it never uses the system's services), and
# slurmdbd and mariadb-server so that cluster keeps accounting for sacct (it runs a mariadbd and
# a slurmdbd of its own, on its own ports and sockets: it neither uses nor disturbs the system's
# services, where apt starts them); these two add about 20 s (apt-get update included; measured
# on a Debian bookworm container) and 180 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
        # A machine whose Python already has torch (a GPU image's CUDA build): the venv sees it and
        # what sits beside it, so nothing is downloaded that is already there (GUIDE.md section 6).
        "$PYTHON" -m venv --system-site-packages .venv
    else
        "$PYTHON" -m venv .venv
    fi
fi
# Without a package index (a GPU machine with no network) pip cannot fetch build tools: install
# from what is there (--no-index --no-build-isolation) when the ordinary install fails.
pip_install() { .venv/bin/python -m pip install -q "$@" || .venv/bin/python -m pip install -q --no-index --no-build-isolation "$@"; }
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q ${ZERORUN_TORCH_INDEX:+--index-url "$ZERORUN_TORCH_INDEX"} "torch==${ZERORUN_TORCH_VERSION:-2.13.0}"
fi
if [ "${1:-}" = "--test" ]; then
    pip_install -e ".[test]"
    if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client) >/dev/null
    fi
    if ! command -v slurmctld >/dev/null 2>&1 && [ ! -x /usr/sbin/slurmctld ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge) >/dev/null
    fi
    if ! command -v slurmdbd >/dev/null 2>&1 && [ ! -x /usr/sbin/slurmdbd ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        # Not fatal: without them the cluster runs without accounting and the sacct test says why it skips.
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmdbd mariadb-server) >/dev/null \
            || echo "setup.sh: slurmdbd/mariadb-server not installed; the Slurm accounting test will skip" >&2
    fi
else
    pip_install -e .
fi
