#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment outside the repo, keyed by the pinned
# requirement files, and installs this checkout into it in editable mode.
#   scripts/venv.sh          ensure the venv exists and is current; print its path last
#   scripts/venv.sh --path   print the path only
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
python=${TPUFT_PYTHON:-python3.11}
command -v "$python" >/dev/null || { echo "error: $python not found; install Python 3.11 (a shared-library build: torch_xla links libpython3.11.so)" >&2; exit 1; }
cache=${TPUFT_CACHE:-$HOME/.cache/tpuft}
key=$(cat "$here"/requirements/*.txt <("$python" -VV) | sha256sum | cut -c1-12)
venv="$cache/venvs/py311-$key"
if [[ "${1:-}" == "--path" ]]; then echo "$venv"; exit 0; fi
mkdir -p "$cache/venvs"
# One builder at a time per venv: a second make (another clone, a parallel job) waits here.
exec 9>"$venv.lock"
flock 9
if [[ ! -f "$venv/.complete" ]]; then
  echo ">> creating $venv (first run installs torch + torch_xla, ~4 GB; later runs reuse it)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip==25.3 setuptools==80.9.0 wheel >&2
  "$venv/bin/pip" install --quiet -c "$here/requirements/constraints.txt" \
    -r "$here/requirements/operator.txt" -r "$here/requirements/trainer.txt" -r "$here/requirements/dev.txt" >&2
  touch "$venv/.complete"
fi
# Cheap on every run: points the venv at this checkout (CI clones elsewhere).
"$venv/bin/pip" install --quiet --no-deps --no-build-isolation -e "$here" >&2
flock -u 9
echo "$venv"
