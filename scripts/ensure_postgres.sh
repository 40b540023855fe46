#!/usr/bin/env bash
# Make sure the PostgreSQL the tests use is reachable; start the local cluster if it is not.
set -euo pipefail
url="${PRODRL_TEST_PG_URL:-postgresql+psycopg2://postgres@127.0.0.1:5432/test}"
py="${PYTHON:-.venv/bin/python}"
probe() { "$py" - "$url" <<'PY'
import sys, psycopg2
url = sys.argv[1].replace("postgresql+psycopg2://", "postgresql://")
try:
    psycopg2.connect(url, connect_timeout=3).close()
except Exception as e:
    print(f"PostgreSQL not reachable at {sys.argv[1]}: {e}".strip(), file=sys.stderr)
    sys.exit(1)
PY
}
if probe 2>/dev/null; then exit 0; fi
if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
  echo "starting the local PostgreSQL cluster ..."
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
  for _ in $(seq 1 20); do probe 2>/dev/null && exit 0; sleep 0.5; done
fi
probe || { echo "Set PRODRL_TEST_PG_URL to a PostgreSQL the tests may use (see README)." >&2; exit 1; }
