#!/usr/bin/env bash
# Installs a one-node Slurm (Debian slurm-wlm: slurmctld, slurmd, client tools) and munge.
# Idempotent and quick when everything is already there (no apt-get call at all then).
# Needs root (apt-get). Used by CI before the Slurm integration tests:
#   sudo scripts/install_slurm.sh    # or as root: scripts/install_slurm.sh
set -euo pipefail

# slurm-wlm: slurmctld + slurmd + client tools. libpmix-dev: the unversioned libpmix.so that
# Slurm's mpi/pmix plugin dlopens (without it `srun --mpi=pmix` fails: "can not load PMIx
# library"). libopenmpi3: an MPI that speaks PMIx, which mpi4py's wheel loads with
# MPI4PY_MPIABI=openmpi (the pip `mpich` only speaks PMI-1/2: `srun --mpi=pmi2`).
# libslurm-dev + gcc: slurm/spank.h and a compiler for the pyxis stand-in (scripts/pyxis_standin.c).
PACKAGES=(slurm-wlm munge libpmix-dev libopenmpi3 libslurm-dev gcc libc6-dev)
installed() { [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]; }
need=()
for pkg in "${PACKAGES[@]}"; do installed "$pkg" || need+=("$pkg"); done
if [ "${#need[@]}" -eq 0 ]; then
  echo "[install_slurm] ${PACKAGES[*]} already installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "[install_slurm] error: missing ${need[*]}; run this script as root (it uses apt-get)" >&2
  exit 1
fi
echo "[install_slurm] installing slurm-wlm and munge (missing: ${need[*]})"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${need[@]}"
echo "[install_slurm] done: slurm-wlm $(dpkg-query -W -f='${Version}' slurm-wlm)"
