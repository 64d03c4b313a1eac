#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine (Debian/Ubuntu, as root), for trying the SLURM
# recipes (sbatch, srun, hydra/launcher=slurm) and for tests/test_slurm.py:
#
#     sudo bash scripts/slurm/local_cluster.sh        # then: sinfo, sbatch, srun ...
#
# Idempotent: installs with apt only what is missing (slurmctld slurmd slurm-client munge),
# creates the munge key if there is none, (re)writes /etc/slurm/slurm.conf (partition `debug`,
# one node: this host, CPUs = nproc, memory = MemTotal minus a margin), starts munged, slurmctld
# and slurmd if they are not running, and returns once `sinfo` shows the node idle. A second run
# takes seconds. Not root, or no apt-get: it says so in one line and exits 0 (CI without
# privileges skips the SLURM tests). A slurm.conf that this script did not write (a real
# cluster's node) is left alone. Everything it does is printed.
#
# Environment: EQTRAIN_SLURM_TIMEOUT_S (default 90) bounds the wait for the idle node.
set -euo pipefail

if [[ "$(id -u)" != 0 ]]; then
  echo "local_cluster.sh: not root, nothing done (a local SLURM cluster needs root)"; exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "local_cluster.sh: no apt-get on this machine, nothing done (Debian/Ubuntu only)"; exit 0
fi

say() { echo "local_cluster.sh: $*"; }
timeout_s=${EQTRAIN_SLURM_TIMEOUT_S:-90}
host=$(hostname -s)
conf=/etc/slurm/slurm.conf
marker="# Written by eqtrain's scripts/slurm/local_cluster.sh"

# One run at a time (several agents or CI steps may call it together). The lock and the apt log are
# opened as root: never at a fixed name in a world-writable directory (/tmp, /var/lock = /run/lock),
# where another user could plant a symlink that the redirection follows and truncates.
lock=/run/eqtrain-local-cluster.lock  # /run: root's own
exec 9>"$lock"
if ! flock -w "$timeout_s" 9; then
  echo "local_cluster.sh: another run holds $lock for more than ${timeout_s} s"; exit 1
fi

if [[ -f $conf ]] && ! grep -qF "$marker" "$conf"; then  # a real cluster's node: change nothing
  say "$conf exists and was not written by this script: leaving this machine's SLURM as it is"; exit 0
fi

# ---------------------------------------------------------------- packages
missing=()
for pkg in munge slurm-client slurmctld slurmd; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if (( ${#missing[@]} )); then
  say "installing ${missing[*]} with apt (about a minute)"
  export DEBIAN_FRONTEND=noninteractive
  apt_log=$(mktemp -t eqtrain-slurm-apt.XXXXXX)  # a new file of its own (O_EXCL, mode 600)
  # Package postinst scripts may try to start services: in a container without an init that
  # fails harmlessly, and this script starts the daemons itself below.
  if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$apt_log" 2>&1; then
    say "apt-get install failed; running apt-get update and trying again"
    apt-get update -q >>"$apt_log" 2>&1 || true
    if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$apt_log" 2>&1; then
      say "apt-get install ${missing[*]} failed, see $apt_log"; exit 1
    fi
  fi
  rm -f "$apt_log"
else
  say "packages present (munge slurm-client slurmctld slurmd)"
fi

# ---------------------------------------------------------------- munge
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
  say "creating /etc/munge/munge.key"
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if pgrep -x munged >/dev/null; then
  say "munged running"
else
  say "starting munged"
  runuser -u munge -- /usr/sbin/munged 9>&-  # daemons must not inherit the lock
fi
for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n </dev/null | unmunge >/dev/null || { say "munge does not answer (see /var/log/munge/munged.log)"; exit 1; }

# ---------------------------------------------------------------- slurm.conf
cpus=$(nproc)
mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
margin_mb=$(( mem_mb / 10 > 1024 ? mem_mb / 10 : 1024 ))  # slurmd drains a node that has less than RealMemory
real_mb=$(( mem_mb - margin_mb ))
install -d -m 0755 /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
new_conf=$(cat <<EOF
$marker: a one-node cluster on $host.
ClusterName=eqtrain
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
# A requeued job may start again cred_expire + 1 s after its requeue (default 120 s).
AuthInfo=cred_expire=10
# ...and is started by the next periodic scheduling pass (default every 60 s, backfill 30 s).
SchedulerParameters=sched_interval=5,bf_interval=5
# A job runs at the niceness of the command that submitted it (nice -n 10 sbatch ...), not slurmd's:
# on a workstation (or a test suite) a background job then yields to interactive work.
PropagatePrioProcess=1
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host CPUs=$cpus RealMemory=$real_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
)
conf_changed=0
if [[ -f $conf ]] && [[ "$(cat "$conf")" == "$new_conf" ]]; then
  say "$conf up to date (node $host, CPUs=$cpus, RealMemory=$real_mb)"
else
  say "writing $conf (node $host, CPUs=$cpus, RealMemory=$real_mb MB)"
  printf '%s\n' "$new_conf" >"$conf"
  conf_changed=1
fi

# ---------------------------------------------------------------- daemons
# Restart a daemon that runs with an older slurm.conf: stop it by its own pid file.
stop_daemon() {  # name pidfile
  local pid
  pid=$(cat "$2" 2>/dev/null || true)
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
    say "stopping $1 (pid $pid) for the new slurm.conf"
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
}
if (( conf_changed )); then
  stop_daemon slurmd /run/slurmd.pid
  stop_daemon slurmctld /run/slurmctld.pid
fi
if pgrep -x slurmctld >/dev/null; then
  say "slurmctld running"
else
  say "starting slurmctld"
  slurmctld 9>&-
fi
if pgrep -x slurmd >/dev/null; then
  say "slurmd running"
else
  say "starting slurmd (it logs a harmless PMIx error)"
  slurmd 9>&-
fi

# ---------------------------------------------------------------- wait for the idle node
deadline=$(( SECONDS + timeout_s ))
resumed=0
while :; do
  state=$(sinfo -h -N -n "$host" -o %T 2>/dev/null | head -n1 || true)
  case $state in
    idle|mixed|allocated|completing) say "node $host is $state: sinfo, srun and sbatch are ready"; exit 0 ;;
    down*|drain*|drained*|fail*)
      if (( ! resumed )); then  # e.g. "Not responding" from an earlier run of the daemons
        say "node $host is $state; asking slurmctld to resume it"
        scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true
        resumed=1
      fi ;;
  esac
  if (( SECONDS > deadline )); then
    say "timed out after ${timeout_s} s waiting for node $host to be idle (sinfo says: '${state:-no answer}');" \
        "see /var/log/slurm/slurmctld.log and /var/log/slurm/slurmd.log"
    exit 1
  fi
  sleep 1
done
