#!/usr/bin/env bash
# verifiers' own environment (it pins openai<3, this project's tests use openai 3): built once per
# version, outside the clone, like vLLM's.  scripts/build_verifiers_venv.sh VENV VERSION [CONSTRAINTS]
# CONSTRAINTS (pip's -c file) pins every package: the venv is rebuilt when that file changes.
set -euo pipefail
venv=$1 version=$2 constraints=${3:-}
py=${PY:-python3.11}
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
source "$(dirname "$0")/venv_pins.sh"
if venv_stale "$venv" "$constraints"; then
  echo "building verifiers $version in $venv (once: ~60 s, ~600 MB)"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "${cflag[@]}" "verifiers==$version"
  "$venv/bin/python" -c "import verifiers.v1, verifiers, sys; print('verifiers', verifiers.__version__, 'in', sys.prefix)"
  echo "$pins" > "$venv/.complete"
fi
