#!/usr/bin/env bash
# Bring up (or reuse) the rlctl virtual Slurm cluster on this host: node[1-4] with 8 fake GPUs each
# in partition `gpu`, node5 in partition `cpu`, accounting through slurmdbd + MariaDB.
# Idempotent: a running cluster with the same configuration is reused. Needs root and apt-get.
# State lives in $VSLURM_STATE (default /var/lib/rlctl-vslurm); configs go to /etc/slurm.
# Usage: tests/slurm/cluster.sh [--restart]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE="${VSLURM_STATE:-/var/lib/rlctl-vslurm}"
ETC=/etc/slurm
NODES=(node1 node2 node3 node4 node5)
HOST="$(hostname)"

say() { echo "[vslurm] $*"; }
die() { echo "[vslurm] error: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts daemons)"

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurm-wlm)
  command -v munged >/dev/null || missing+=(munge)
  command -v mysqld_safe >/dev/null || missing+=(mariadb-server)
  command -v slurmdbd >/dev/null || missing+=(slurmdbd)
  ((${#missing[@]})) || return 0
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
  say "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurm-wlm munge mariadb-server slurmdbd >/dev/null
}

render() {  # template -> destination, with placeholders filled
  sed -e "s|@HOST@|$HOST|g" -e "s|@STATE@|$STATE|g" -e "s|@DBPASS@|$DBPASS|g" "$1" > "$2.tmp"
  chmod "$3" "$2.tmp"
  mv "$2.tmp" "$2"
}

config_stamp() {
  cat "$HERE"/slurm.conf.in "$HERE"/gres.conf.in "$HERE"/slurmdbd.conf.in | sha256sum | cut -c1-16
  echo "$HOST $STATE"
}

cluster_healthy() {
  scontrol ping 2>/dev/null | grep -q UP || return 1
  local n
  n=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc)/' | sort -u | wc -l)
  [[ $n -eq ${#NODES[@]} ]]
}

stop_all() { "$HERE/stop.sh" >/dev/null 2>&1 || true; }

start_munge() {
  if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey -c -f -k /etc/munge/munge.key
  fi
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  mkdir -p /run/munge && chown munge:munge /run/munge
  if ! pgrep -u munge -x munged >/dev/null; then
    runuser -u munge -- /usr/sbin/munged
    : > "$STATE/started-munge"  # stop.sh stops only what this script started
  fi
  munge -n | unmunge >/dev/null || die "munge does not work"
}

start_mariadb() {
  mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
  if ! mysqladmin ping >/dev/null 2>&1; then
    [[ -d /var/lib/mysql/mysql ]] || mariadb-install-db --user=mysql >/dev/null
    setsid nohup mysqld_safe --user=mysql >"$STATE/log/mysqld_safe.log" 2>&1 < /dev/null &
    for _ in $(seq 60); do mysqladmin ping >/dev/null 2>&1 && break; sleep 0.5; done
    mysqladmin ping >/dev/null 2>&1 || die "MariaDB did not start (see $STATE/log/mysqld_safe.log)"
    : > "$STATE/started-mariadb"
  fi
  mysql -u root <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
SQL
}

wait_for() {  # seconds, description, command...
  local t=$1 what=$2; shift 2
  for _ in $(seq $((t * 2))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
  die "$what did not come up within ${t}s (logs: $STATE/log/)"
}

start_slurm() {
  if ! pgrep -x slurmdbd >/dev/null; then slurmdbd; fi
  wait_for 30 slurmdbd sacctmgr -n list cluster
  sacctmgr -i -Q add cluster vslurm >/dev/null 2>&1 || true
  if ! pgrep -x slurmctld >/dev/null; then slurmctld -c; fi
  wait_for 30 slurmctld scontrol ping
  local node
  for node in "${NODES[@]}"; do
    if [[ ! -f /run/slurmd-$node.pid ]] || ! kill -0 "$(cat /run/slurmd-$node.pid)" 2>/dev/null; then
      mkdir -p "$STATE/spool/slurmd-$node"
      slurmd -N "$node"
    fi
  done
}

wait_idle() {
  for _ in $(seq 120); do
    cluster_healthy && return 0
    sleep 0.5
  done
  sinfo -N >&2 || true
  sinfo -R >&2 || true
  die "nodes did not all become idle within 60s (logs: $STATE/log/)"
}

main() {
  install_packages
  mkdir -p "$STATE"/{ctld,log,spool,gpus} "$ETC"
  chmod 0755 "$STATE"
  for i in 0 1 2 3 4 5 6 7; do : > "$STATE/gpus/gpu$i"; done
  if [[ ! -s $STATE/dbpass ]]; then
    (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' > "$STATE/dbpass")
  fi
  DBPASS="$(cat "$STATE/dbpass")"
  local stamp want
  want="$(config_stamp)"
  stamp="$(cat "$STATE/config.stamp" 2>/dev/null || true)"
  if [[ ${1:-} != --restart && $stamp == "$want" ]] && cluster_healthy; then
    say "reusing the running cluster"
  else
    if [[ ${1:-} == --restart || $stamp != "$want" ]]; then
      say "(re)configuring"
      stop_all
    fi
    render "$HERE/slurm.conf.in" "$ETC/slurm.conf" 0644
    render "$HERE/gres.conf.in" "$ETC/gres.conf" 0644
    render "$HERE/slurmdbd.conf.in" "$ETC/slurmdbd.conf" 0600
    start_munge
    start_mariadb
    start_slurm
    wait_idle
    echo "$want" > "$STATE/config.stamp"
  fi
  say "cluster vslurm up: $(sinfo -h -o '%P=%D nodes %t' | tr '\n' ' ')"
  sinfo -N -o '%N %P %t %c %G' | sed 's/^/[vslurm]   /'
}

main "$@"
