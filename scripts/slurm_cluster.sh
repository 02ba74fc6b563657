#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, without systemd: munged + slurmctld + slurmd.
#
#   scripts/slurm_cluster.sh start   # writes $DIR/slurm.conf, starts the daemons, waits until idle
#   scripts/slurm_cluster.sh stop    # stops what `start` started (munged only if it started it)
#   scripts/slurm_cluster.sh status
#   eval "$(scripts/slurm_cluster.sh env)"   # SLURM_CONF for sbatch/srun/squeue/scancel
#
# DIR = $DFLASH_SLURM_DIR (default /tmp/dflash-slurm) holds the config, state, logs and pid files;
# nothing under /etc/slurm is touched, so client commands need SLURM_CONF=$DIR/slurm.conf.
# The node is NodeName=localhost with the CPUs and memory `slurmd -C` reports (no GPUs, no gres),
# one partition `debug`, MpiDefault=none (jobs ask for `srun --mpi=pmix` themselves), no accounting.
# pyxis is not installed here: a STAND-IN SPANK plugin (scripts/pyxis_standin.c, compiled into $DIR)
# gives srun pyxis's --container-* options, so the generated job scripts run unchanged; it checks
# the mounts and working directory and runs the task on the host (no container, no image).
# Needs root (slurmd starts job steps as the submitting user) and scripts/install_slurm.sh.
set -euo pipefail

DIR=${DFLASH_SLURM_DIR:-/tmp/dflash-slurm}
CONF="$DIR/slurm.conf"
CTLD_PORT=${DFLASH_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${DFLASH_SLURMD_PORT:-6818}
export SLURM_CONF="$CONF"

log() { echo "[slurm_cluster] $*" >&2; }
die() { echo "[slurm_cluster] error: $*" >&2; exit 1; }

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

build_standin() {
  # The pyxis stand-in (see scripts/pyxis_standin.c); needs gcc and libslurm-dev's spank.h.
  local src
  src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/pyxis_standin.c"
  [ -f /usr/include/slurm/spank.h ] || die "slurm/spank.h missing; run scripts/install_slurm.sh (libslurm-dev)"
  cc -shared -fPIC -O2 -Wall -o "$DIR/pyxis_standin.so" "$src" || die "could not compile $src"
  echo "required $DIR/pyxis_standin.so" >"$DIR/plugstack.conf"
}

write_conf() {
  # Declare what the machine really has: a node declaring more CPUs/memory than slurmd finds
  # is set to INVALID and never runs jobs.
  local hw cpus mem
  hw=$(slurmd -C | head -1)
  cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
  mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
  [ -n "$cpus" ] && [ -n "$mem" ] || die "cannot parse \`slurmd -C\` output: $hw"
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
  cat >"$CONF" <<CONF
# Written by scripts/slurm_cluster.sh: a one-node test cluster.
ClusterName=dflash
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
PlugStackConfig=$DIR/plugstack.conf
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
# scancel: SIGTERM, then SIGKILL after KillWait seconds (servers shut down gracefully in between).
KillWait=10
MinJobAge=120
InactiveLimit=0
SlurmdTimeout=60
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
}

start() {
  for bin in slurmctld slurmd sbatch munged; do
    command -v "$bin" >/dev/null 2>&1 || die "$bin not found; run scripts/install_slurm.sh (as root) first"
  done
  [ "$(id -u)" -eq 0 ] || die "run as root (slurmd must start job steps as the submitting user)"
  mkdir -p "$DIR"
  if ! munge_ok; then
    log "starting munged"
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 0755 /run/munge
    if [ ! -s /etc/munge/munge.key ]; then
      runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
        || die "no /etc/munge/munge.key and mungekey failed; reinstall munge"
    fi
    runuser -u munge -- /usr/sbin/munged
    touch "$DIR/munged.started"
    for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
    munge_ok || die "munged did not start; see /var/log/munge/munged.log"
  fi
  if pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid"; then
    log "already running (SLURM_CONF=$CONF)"
  else
    write_conf
    build_standin
    pid_alive "$DIR/slurmctld.pid" || slurmctld -f "$CONF" -i
    # -N: this host's node name in slurm.conf is `localhost`, whatever `hostname` says.
    pid_alive "$DIR/slurmd.pid" || slurmd -f "$CONF" -N localhost
  fi
  local state=""
  for _ in $(seq 100); do
    state=$(sinfo -h -N -o %t 2>/dev/null | head -1 || true)
    case "$state" in idle|mix|alloc) break ;; esac
    sleep 0.2
  done
  case "$state" in
    idle|mix|alloc) log "up: node localhost $state (SLURM_CONF=$CONF)" ;;
    *) die "node never became idle (state '${state:-none}'); see $DIR/log/slurmctld.log and slurmd.log" ;;
  esac
}

stop_daemon() {  # name pidfile
  local pidfile=$2 pid
  pid_alive "$pidfile" || return 0
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  log "$1 ($pid) did not stop on SIGTERM; killing it"
  kill -KILL "$pid" 2>/dev/null || true
}

stop() {
  if [ -f "$CONF" ] && pid_alive "$DIR/slurmctld.pid"; then
    scancel --user="$(id -un)" 2>/dev/null || true  # leave no job processes behind
  fi
  stop_daemon slurmctld "$DIR/slurmctld.pid"
  stop_daemon slurmd "$DIR/slurmd.pid"
  if [ -f "$DIR/munged.started" ]; then
    munged --stop >/dev/null 2>&1 || true
    rm -f "$DIR/munged.started"
  fi
  log "stopped"
}

status() {
  pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid" || { echo "down"; return 1; }
  sinfo -N -o "%N %t %c %m" && squeue
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|status|env   (state in \$DFLASH_SLURM_DIR, default /tmp/dflash-slurm)" >&2; exit 2 ;;
esac
