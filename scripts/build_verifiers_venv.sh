#!/usr/bin/env bash
# verifiers' own environment (it pins openai<3, this project's tests use openai 3): built once per
# version, outside the clone, like vLLM's.  scripts/build_verifiers_venv.sh VENV VERSION
set -euo pipefail
venv=$1 version=$2
py=${PY:-python3.11}
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  echo "building verifiers $version in $venv (once: ~60 s, ~600 MB)"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "verifiers==$version"
  "$venv/bin/python" -c "import verifiers.v1, verifiers, sys; print('verifiers', verifiers.__version__, 'in', sys.prefix)"
  touch "$venv/.complete"
fi
