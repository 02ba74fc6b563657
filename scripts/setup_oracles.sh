#!/usr/bin/env bash
# Installs the reference implementations of scripts/oracles.txt (z-lab's dflash, speculators)
# into the project's cache, each in its own --no-deps --target directory (never .venv: their
# pins must not move the project's). Idempotent: a directory with its .complete stamp is kept;
# an install lands in a temporary directory renamed into place, so a half install never counts.
#
#   scripts/setup_oracles.sh [NAME...]    (default: every oracle of scripts/oracles.txt)
#   ORACLES_DIR  where they go (default ${DFLASH_TRT_CACHE:-~/.cache/dflash-trt}/oracles)
#   PYTHON       the interpreter whose pip installs them (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
ORACLES_DIR=${ORACLES_DIR:-${DFLASH_TRT_CACHE:-$HOME/.cache/dflash-trt}/oracles}
PY=${PYTHON:-.venv/bin/python}
export PIP_DISABLE_PIP_VERSION_CHECK=1
wanted=("$@")
found=0
while read -r name reqs; do
  case "$name" in ''|'#'*) continue ;; esac
  if [ ${#wanted[@]} -gt 0 ] && [[ ! " ${wanted[*]} " =~ " $name " ]]; then continue; fi
  found=$((found + 1))
  home="$ORACLES_DIR/$name"
  if [ -f "$home/.complete" ] && [ "$(cat "$home/.complete")" = "$reqs" ]; then
    continue
  fi
  echo "[oracles] installing $name ($reqs) into $home"
  mkdir -p "$ORACLES_DIR"
  tmp=$(mktemp -d "$ORACLES_DIR/.$name.partial-XXXXXX")
  # shellcheck disable=SC2086  # the requirements are words
  if ! "$PY" -m pip install --quiet --no-deps --no-compile --target "$tmp" $reqs; then
    rm -rf "$tmp"
    echo "error: could not install $name ($reqs) from the package index; check the network and rerun scripts/setup_oracles.sh $name" >&2
    exit 1
  fi
  echo "$reqs" >"$tmp/.complete"
  rm -rf "$home"
  mv "$tmp" "$home"
done <scripts/oracles.txt
if [ ${#wanted[@]} -gt 0 ] && [ "$found" -ne ${#wanted[@]} ]; then
  echo "error: unknown oracle in '${wanted[*]}'; the names are in scripts/oracles.txt" >&2
  exit 2
fi
