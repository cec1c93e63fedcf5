#!/usr/bin/env bash
# A one-node Slurm cluster on loopback, for the `slurm` tests and for trying `trainjob slurm render`.
#
#   scripts/slurm.sh install      slurm-wlm and munge from apt (root only); a no-op where installed
#   scripts/slurm.sh up DIR       start the cluster under DIR (installing first where it may);
#                                 prints `export SLURM_CONF=DIR/slurm.conf`, the one variable clients need
#   scripts/slurm.sh down DIR     cancel its jobs, stop the daemons it started (by their recorded PIDs)
#
# Everything lives under DIR: its own munge key and socket, slurm.conf on free loopback ports, state,
# spool and logs. No systemd, no cgroups, no accounting database: Debian's slurm-wlm (22.05) runs as
# root with linuxproc process tracking, and each daemon runs in the foreground (`munged -F`,
# `slurmctld -D`, `slurmd -D`) as a background process of this script whose PID goes to DIR/pids.
# Three partitions: `debug` (the default), and `low`, whose jobs a job in `high` preempts by
# requeueing them after a GraceTime (what a shared cluster's preemption does). A requeued job waits
# cred_expire (5 s here, Slurm's least; 120 by default) and a scheduling cycle before it starts again.
# The node claims at least 8 CPUs whatever the machine has, so that jobs that mostly wait run side by side.
set -euo pipefail

die() { echo "slurm.sh: $*" >&2; exit 1; }

install() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return 0
    command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] \
        || die "Slurm is not installed and cannot be here (needs root and apt): apt-get install slurm-wlm munge"
    local log
    log=$(mktemp)
    if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge \
           || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
                apt-get install -y -qq --no-install-recommends slurm-wlm munge; }; } >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        die "could not install slurm-wlm and munge"
    fi
    rm -f "$log"
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

start() {  # start NAME COMMAND...: a foreground daemon in the background, its PID recorded
    local name=$1; shift
    "$@" >>"$dir/log/$name.out" 2>&1 &
    echo "$! $name" >>"$dir/pids"
}

up() {
    [ "$(id -u)" = 0 ] || die "the loopback cluster runs its daemons as root (SlurmUser=root)"
    install
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    [ ! -s "$dir/pids" ] || die "$dir/pids exists: a cluster may be running there (scripts/slurm.sh down $dir)"
    mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/log"
    chmod 700 "$dir/munge"
    mungekey --create --keyfile "$dir/munge/munge.key" --force
    chmod 600 "$dir/munge/munge.key"
    local node ctld_port slurmd_port cpus
    node=$(hostname -s)
    # At least 8 CPUs, whatever the machine has (config_overrides below: slurmd takes the node as
    # slurm.conf describes it): the tests' jobs mostly wait (a requeue's cred_expire, a process
    # starting), so several run at once, as a real cluster's would, instead of queueing for cores.
    cpus=$(getconf _NPROCESSORS_ONLN)  # not nproc, which OMP_NUM_THREADS=1 makes say 1
    [ "$cpus" -ge 8 ] || cpus=8
    ctld_port=$(free_port)
    slurmd_port=$(free_port)
    while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port=$(free_port); done
    cat >"$dir/slurm.conf" <<EOF
ClusterName=trainjob
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SlurmdParameters=config_overrides
MinJobAge=3600
KillWait=20
ReturnToService=2
MpiDefault=none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
PartitionName=low Nodes=$node MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=20
PartitionName=high Nodes=$node MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
    export SLURM_CONF=$dir/slurm.conf
    : >"$dir/pids"
    start munged munged --foreground --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
    for _ in $(seq 50); do [ -S "$dir/munge/socket" ] && break; sleep 0.1; done
    [ -S "$dir/munge/socket" ] || { cat "$dir/log/munged.out" "$dir/log/munged.log" >&2 || true; down; die "munged did not start"; }
    start slurmctld slurmctld -D -i -f "$dir/slurm.conf"
    start slurmd slurmd -D -f "$dir/slurm.conf" -N "$node"
    for _ in $(seq 150); do
        state=$(sinfo -h -n "$node" -p debug -o %T 2>/dev/null || true)
        [ "$state" = idle ] && break
        sleep 0.2
    done
    if [ "$state" != idle ]; then
        tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" "$dir/log/"*.out >&2 || true
        down
        die "the node did not come up idle (it is ${state:-unknown})"
    fi
    echo "export SLURM_CONF=$dir/slurm.conf"
}

down() {
    dir=$(cd "$dir" 2>/dev/null && pwd) || return 0
    [ -s "$dir/pids" ] || return 0
    export SLURM_CONF=$dir/slurm.conf
    # Jobs first: a job's slurmstepd outlives slurmd, so cancel them and give them a moment.
    if scancel --full --quiet --state=RUNNING 2>/dev/null || true; then
        for _ in $(seq 50); do [ -z "$(squeue -h -t R,CG 2>/dev/null)" ] && break; sleep 0.2; done
    fi
    scancel --quiet 2>/dev/null || true
    local pid name
    # Stop them in reverse order of start: slurmd, slurmctld, munged.
    tac "$dir/pids" | while read -r pid name; do
        kill -TERM "$pid" 2>/dev/null || continue
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "slurm.sh: $name ($pid) ignored SIGTERM for 5 s; SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    : >"$dir/pids"
}

case "${1:-}" in
    install) install ;;
    up) [ $# = 2 ] || die "usage: $0 up DIR"; dir=$2; up ;;
    down) [ $# = 2 ] || die "usage: $0 down DIR"; dir=$2; down ;;
    *) die "usage: $0 install | up DIR | down DIR" ;;
esac
