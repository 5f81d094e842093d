#!/usr/bin/env bash
# The GPU check: one call of at most 8 minutes on a lent one-GPU machine (tools/gpu_check.py says what it runs, one
# printed line per step: versions, a Qwen3-MoE step, Megatron vs Hugging Face log-probs with a GSPO step and a
# save/reload, the staged weight path between two processes and NCCL's duplicate-GPU refusal, attention peak
# memory at 8k and 16k tokens, memory after dropping a trainer, the embedded engine on CUDA).
#
#   bash tools/gpu_check.sh --prepare   # here, once: the wheels the GPU image lacks, into .whl/ (git-ignored)
#   bash tools/gpu_check.sh             # there, from the repository root, with .whl carried along
#   bash tools/gpu_check.sh --cpu       # here: the same steps on the CPU (a smaller model); tests/test_gpu_check.py
#
# The GPU image has Python 3.12 with a CUDA torch, transformers, safetensors, numpy, pyyaml, httpx, typer, rich
# and msgpack, but neither megatron-core nor this project's other needs, and reaches no package index: --prepare
# downloads those wheels (at the versions this checkout's .venv holds) for CPython 3.12 on manylinux x86-64. What a
# device call carries is at most 64 MiB: --prepare refuses more.
set -euo pipefail
cd "$(dirname "$0")/.."

# what the image lacks, as pip names them; versions come from .venv
NEEDS=(megatron-core pydantic pydantic-core annotated-types typing-inspection fastapi starlette uvicorn httptools
       orjson pyzmq sqlalchemy submitit)

prepare() {
    local pins=() name version
    for name in "${NEEDS[@]}"; do
        version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
        pins+=("$name==$version")
    done
    rm -rf .whl && mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
    local mib=$(( $(du -sb .whl | cut -f1) / 1048576 ))
    echo "gpu check: $(ls .whl | wc -l) wheels, ${mib} MiB (at most 64 MiB can be carried), in .whl/ (carry it along)"
    (( mib <= 64 )) || { echo "gpu check: .whl/ is over 64 MiB: a device call cannot carry it" >&2; exit 1; }
}

case "${1:-}" in
    --prepare) prepare; exit 0 ;;
    --cpu) exec .venv/bin/python tools/gpu_check.py --device cpu --hidden 256 --layers 2 --new-tokens 16 \
               --attn-lengths 256,512 --budget-s 300 ;;
    "") ;;
    *) echo "usage: bash tools/gpu_check.sh [--prepare | --cpu]" >&2; exit 2 ;;
esac

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu check: no .whl/ here: run 'bash tools/gpu_check.sh --prepare' first" \
    "and carry .whl" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gyre-site .whl/*.whl
export PYTHONPATH=/tmp/gyre-site:$PWD PYTHONUNBUFFERED=1
exec timeout 480 python3 tools/gpu_check.py --device cuda
