#!/usr/bin/env bash
# GPU check on one H200 (not part of CI; under 8 minutes): builds the node environment with the CUDA vLLM
# (sky_tasks/setup_node.sh, default CORAL_VLLM_SPEC), a planner environment for `coral profile latency`, then
# runs `python -m bench.gpu_check`: Coral serving with vLLM, a 2-rank uneven pipeline as two nodes on one GPU, and
# per-layer prefill/decode times against Coral's profile. Writes bench/results/gpu_check.json.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${CORAL_GPU_CHECK_DIR:-/tmp/coral-gpu-check}"
mkdir -p "$work"
[ -x "$work/node/bin/python" ] || python3 -m venv "$work/node"
[ -x "$work/planner/bin/python" ] || python3 -m venv "$work/planner"
(PATH="$work/planner/bin:$PATH" python -m pip install -q -e "$root[planner]") &
planner=$!
PATH="$work/node/bin:$PATH" VIRTUAL_ENV="$work/node" bash "$root/sky_tasks/setup_node.sh"
wait "$planner"
cd "$root"
PATH="$work/node/bin:$PATH" CORAL_PLANNER_PYTHON="$work/planner/bin/python" PYTHONPATH="$root" \
  timeout 420 python -m bench.gpu_check
