#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environments outside the repo, keyed by their pinned
# requirement files and the Python version, and installs this checkout into them in editable mode.
#   scripts/venv.sh                 ensure the main venv (torch_xla backend, tests, linters); print its path last
#   scripts/venv.sh --path          print the main venv's path only
#   scripts/venv.sh native          ensure the native-backend venv (torch 2.15, no torch_xla); print its path last
#   scripts/venv.sh native --path   print the native venv's path only
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
python=${TPUFT_PYTHON:-python3.11}
command -v "$python" >/dev/null || { echo "error: $python not found; install Python 3.11 (a shared-library build: torch_xla links libpython3.11.so)" >&2; exit 1; }
cache=${TPUFT_CACHE:-$HOME/.cache/tpuft}
req=$here/requirements
flavour=main
if [[ "${1:-}" == "native" ]]; then flavour=native; shift; fi
if [[ $flavour == main ]]; then
  # The files in the order the glob requirements/*.txt gave before native.txt existed: the key (and so
  # every existing cached venv) is unchanged by adding the native set.
  files=("$req/constraints.txt" "$req/dev.txt" "$req/operator.txt" "$req/trainer.txt")
  install=(-c "$req/constraints.txt" -r "$req/operator.txt" -r "$req/trainer.txt" -r "$req/dev.txt")
  prefix=py311
  what="torch + torch_xla, ~4 GB"
else
  # The native trainer needs the operator set too (`tpuft` is the operator package's entry point).
  files=("$req/operator.txt" "$req/native.txt")
  install=(-r "$req/operator.txt" -r "$req/native.txt")
  prefix=native-py311
  what="torch 2.15 with its CUDA libraries, ~6 GB"
fi
key=$(cat "${files[@]}" <("$python" -VV) | sha256sum | cut -c1-12)
venv="$cache/venvs/$prefix-$key"
if [[ "${1:-}" == "--path" ]]; then echo "$venv"; exit 0; fi
mkdir -p "$cache/venvs"
# One builder at a time per venv: a second make (another clone, a parallel job) waits here.
exec 9>"$venv.lock"
flock 9
if [[ ! -f "$venv/.complete" ]]; then
  echo ">> creating $venv (first run installs $what; later runs reuse it)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip==25.3 setuptools==80.9.0 wheel >&2
  "$venv/bin/pip" install --quiet "${install[@]}" >&2
  touch "$venv/.complete"
fi
# Cheap on every run: points the venv at this checkout (CI clones elsewhere).
"$venv/bin/pip" install --quiet --no-deps --no-build-isolation -e "$here" >&2
flock -u 9
echo "$venv"
