#!/usr/bin/env bash
# Runs the pagedq command line (default: the main job, `pagedq batch`, on the embedded model).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
if [[ $# -eq 0 ]]; then set -- batch; fi
exec "$root/.venv/bin/python" -m pagedq "$@"
