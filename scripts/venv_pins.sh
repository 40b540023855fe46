# Sourced by scripts/build_*_venv.sh. `venv_stale VENV [CONSTRAINTS]` sets `pins` (the constraints
# file's hash, or "none") and `cflag` (pip's `-c CONSTRAINTS`), and succeeds when VENV must be
# (re)built: never completed, or completed under other pins. A build ends with `echo "$pins" > VENV/.complete`.
venv_stale() {
  pins=none cflag=()
  if [ -n "${2:-}" ]; then pins=$(sha1sum < "$2" | cut -c1-12); cflag=(-c "$2"); fi
  [ ! -f "$1/.complete" ] || [ "$(cat "$1/.complete")" != "$pins" ]
}
