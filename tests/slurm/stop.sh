#!/usr/bin/env bash
# Stop the rlctl virtual Slurm cluster started by tests/slurm/cluster.sh (jobs are lost).
# Stops only the daemons it started, by their pid files.
set -uo pipefail

stop_pidfile() {  # pidfile, name
  local pidfile=$1 pid
  [[ -f $pidfile ]] || return 0
  pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$pidfile"
  echo "[vslurm] stopped $2"
}

for pidfile in /run/slurmd-node*.pid; do
  [[ -e $pidfile ]] && stop_pidfile "$pidfile" "slurmd $(basename "$pidfile" .pid)"
done
stop_pidfile /run/slurmctld.pid slurmctld
stop_pidfile /run/slurmdbd.pid slurmdbd
# MariaDB and munge may be the host's own services: stop them only when cluster.sh started them.
STATE="${VSLURM_STATE:-/var/lib/rlctl-vslurm}"
if [[ -e $STATE/started-mariadb ]]; then
  mysqladmin ping >/dev/null 2>&1 && mysqladmin shutdown && echo "[vslurm] stopped mariadb"
  rm -f "$STATE/started-mariadb"
fi
if [[ -e $STATE/started-munge ]]; then
  stop_pidfile /run/munge/munged.pid munged
  rm -f "$STATE/started-munge"
fi
exit 0
