#!/usr/bin/env bash
# The whole GPU run in one command (issue 29): wheels shipped in .whl/ installed, the package
# imported, nvidia-smi / commit / versions recorded, every check under its own time limit, one JSON
# and one markdown table in OUT_DIR. See benchmarks/gpu/device_run.py and docs/gpu.md.
#
#   bash benchmarks/gpu/device_run.sh OUT_DIR [COMMIT]
#   DEVICE_RUN_TOY=1 bash benchmarks/gpu/device_run.sh OUT_DIR    # CPU rehearsal at toy sizes
#
# Exit status: 0 when every check is ok, 1 otherwise (the files are written either way), 2 on usage.
set -u
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: bash benchmarks/gpu/device_run.sh OUT_DIR [COMMIT]" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# The device copy has no .git: the caller passes the commit; a checkout with one can say it itself.
COMMIT="${2:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
PYTHON="${PYTHON:-python3}"
exec "$PYTHON" "$ROOT/benchmarks/gpu/device_run.py" "$1" --commit "$COMMIT"
