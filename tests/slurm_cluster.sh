#!/usr/bin/env bash
# A throw-away SLURM cluster on this one host, for tests/test_slurm.py and for trying the job scripts
# without a cluster (docs/SLURM.md). Debian 12 / slurm 22.05, as root, works without systemd or cgroups.
#   bash tests/slurm_cluster.sh up     # installs the packages if needed; controller + NNODES slurmd (n1, n2, ...)
#   bash tests/slurm_cluster.sh down   # stops the daemons it started (packages and config stay)
# All "nodes" are this machine: each claims all its CPUs, and nothing limits a job's CPUs or memory.
# PARTITIONS="debug=n[1-3] spare=n[4-6]": partitions of these nodes, the first the default; by default one,
# debug, of every node. Jobs in different partitions never wait for each other's nodes.
set -euo pipefail
NNODES=${NNODES:-2}
PARTITIONS=${PARTITIONS:-debug=n[1-$NNODES]}
HOSTS_TAG="# slurm-ci-nodes"
CONF_TAG="# written by tests/slurm_cluster.sh"

down() {
  local f pid pids=()
  for f in /run/slurmd-*.pid /run/slurmctld.pid /run/munge/munged.pid; do
    pid=$(cat "$f" 2>/dev/null) || continue
    ! kill "$pid" 2>/dev/null || pids+=("$pid")
    rm -f "$f"
  done
  # each daemon takes 1-2 s to exit: signal them all first, then wait
  for pid in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
  [ ! -f /etc/hosts ] || sed -i "/$HOSTS_TAG/d" /etc/hosts
}

install_packages() {
  local pkgs=(slurmctld slurmd slurm-client munge)
  dpkg -s "${pkgs[@]}" >/dev/null 2>&1 && return
  export DEBIAN_FRONTEND=noninteractive
  # --no-install-recommends: slurm-wlm's recommends pull ~30 plugin and -dev packages we do not need
  apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null; }
}

start_munge() {
  [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  install -d -o munge -g munge -m 755 /run/munge
  runuser -u munge -- /usr/sbin/munged </dev/null >>/var/log/slurm/daemons.out 2>&1
  for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null
}

write_config() {
  local host ncpu node_mem
  host=$(hostname -s)
  ncpu=$(nproc)
  # a bit under the real memory, split over the fake nodes (slurmd refuses a node claiming more)
  node_mem=$(( $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) * 9 / 10 / NNODES ))
  # the job scripts use the first node's name as the rendezvous address, so the fake names must resolve
  echo "127.0.0.1 $(seq -f 'n%g' -s ' ' 1 "$NNODES") $HOSTS_TAG" >> /etc/hosts
  mkdir -p /etc/slurm /var/spool/slurmctld
  rm -rf /var/spool/slurmctld/*
  cat > /etc/slurm/slurm.conf <<EOF
$CONF_TAG
ClusterName=ci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
# cred_expire is also the delay before a requeued job may start again (default 120 s)
AuthInfo=cred_expire=10
MailProg=/bin/true
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
# a requeued job restarts within seconds instead of minutes
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# reject at submission (instead of pending forever) a job asking for more than the cluster has
EnforcePartLimits=ALL
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=5
MinJobAge=300
NodeName=DEFAULT CPUs=$ncpu RealMemory=$node_mem State=UNKNOWN
NodeName=n[1-$NNODES] NodeHostname=$host NodeAddr=127.0.0.1 Port=17001-$((17000 + NNODES))
EOF
  local spec default=YES
  for spec in $PARTITIONS; do
    echo "PartitionName=${spec%%=*} Nodes=${spec#*=} Default=$default MaxTime=INFINITE State=UP" >> /etc/slurm/slurm.conf
    default=NO
  done
}

up() {
  [ "$(id -u)" = 0 ] || { echo "slurm_cluster.sh: needs root (it installs packages and starts daemons)" >&2; exit 1; }
  if [ -f /etc/slurm/slurm.conf ] && ! grep -qx "$CONF_TAG" /etc/slurm/slurm.conf; then
    echo "slurm_cluster.sh: /etc/slurm/slurm.conf exists and is not ours: a real SLURM host? not touching it" >&2
    exit 1
  fi
  down
  install_packages
  mkdir -p /var/log/slurm
  start_munge
  write_config
  # daemons must not hold on to our stdout: a caller reading it (pytest) would wait ~10 s for them
  /usr/sbin/slurmctld </dev/null >>/var/log/slurm/daemons.out 2>&1
  for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
  for n in $(seq "$NNODES"); do
    mkdir -p "/var/spool/slurmd/n$n"
    /usr/sbin/slurmd -N "n$n" </dev/null >>/var/log/slurm/daemons.out 2>&1
  done
  for _ in $(seq 300); do [ "$(sinfo -h -o %T | sort -u)" = idle ] && break; sleep 0.1; done
  [ "$(sinfo -h -o %T | sort -u)" = idle ] \
    || { echo "slurm_cluster.sh: nodes did not come up:" >&2; sinfo >&2; tail -20 /var/log/slurm/*.log >&2; exit 1; }
  sinfo
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: bash tests/slurm_cluster.sh up|down" >&2; exit 2 ;;
esac
