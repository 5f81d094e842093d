#!/usr/bin/env bash
# Create or update the project's virtual environment in .venv (CPU machines). Safe to run again: it only
# reinstalls when pyproject.toml or this script changed. GPU clusters: install your CUDA torch first, then
# `pip install -e '.[sglang,mooncake,megatron]'` (SGLang never goes into the CPU environment).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
quiet() { "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }

# Debian packages: libibverbs1 (Mooncake's non-CUDA wheel links it; no RDMA device is needed, TCP is used here),
# bubblewrap (the harness sandbox, harness.sandbox, and the image runtime), podman with runc (the second image
# runtime, and the fixture images' builds: crun fails on this kind of machine, docs/images.md), skopeo (image pulls
# without podman), debootstrap (the fixture images' Debian base), and for tools/chaos.py's network and disk faults
# iptables and e2fsprogs (mkfs.ext4)
missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' || missing+=(libibverbs1)
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
command -v skopeo >/dev/null || missing+=(skopeo)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v iptables >/dev/null || missing+=(iptables)
command -v mkfs.ext4 >/dev/null || missing+=(e2fsprogs)
if ((${#missing[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian's ${missing[*]}"
    (apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; })
  else
    echo "setup: warning: ${missing[*]} missing (apt-get install ${missing[*]}): Mooncake transfers fail without" \
      "libibverbs1, harnesses run unsandboxed and tasks with images not at all without bubblewrap, tools/chaos.py" \
      "makes no partitions without iptables, the fixture images need podman, runc and debootstrap" >&2
  fi
fi

[ -x .venv/bin/python ] || { echo "setup: creating .venv"; "$PY" -m venv .venv; }
want=$(cat pyproject.toml tools/setup_env.sh | sha256sum | cut -c1-16)
if [ "$(cat .venv/.gyre-installed 2>/dev/null)" != "$want" ]; then
  echo "setup: installing gyre_slurm and its dependencies into .venv (about a minute the first time)"
  # torch pinned first (and again beside the extras, so none of them can move it): an unpinned torch on a CPU
  # machine pulls a multi-GB CUDA build
  quiet .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
  quiet .venv/bin/pip install -q --disable-pip-version-check -e '.[dev,mooncake-cpu,megatron,tracking]' torch==2.13.0
  echo "$want" > .venv/.gyre-installed
fi
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch, gyre_slurm; print("gyre_slurm", gyre_slurm.__version__, "torch", torch.__version__)'))"
