#!/usr/bin/env bash
# Local single-machine Slurm cluster for gyre_slurm tests and development.
#
#   bash tools/slurm/local_cluster.sh up      # install if needed, configure, start, wait until healthy
#   bash tools/slurm/local_cluster.sh down    # stop every daemon this script started
#   bash tools/slurm/local_cluster.sh status  # show sinfo + accounting; exit 0 iff healthy
#
# Emulates N nodes (multiple-slurmd: one `slurmd -N nodeK` per node, all on 127.0.0.1
# with distinct ports), with fake GPUs and slurmdbd/MariaDB accounting, so that the
# real sbatch/srun/scancel/sacct behave as on a real cluster. Written for Debian 12
# (slurm-wlm 22.05), as root, without systemd or cgroups.
#
# Environment (all optional):
#   GYRE_SLURM_NODES          number of emulated nodes            (default 4)
#   GYRE_SLURM_CPUS           CPUs advertised per node            (default 8)
#   GYRE_SLURM_MEM_MB         RealMemory advertised per node, MB  (default 16000)
#   GYRE_SLURM_GPUS           fake GPUs per node, 0 disables      (default 2)
#   GYRE_SLURM_CLUSTER        ClusterName                         (default gyre)
#   GYRE_SLURM_STATE_DIR      spool, state, logs, pid files       (default /var/lib/gyre-slurm)
#   GYRE_SLURM_TIMEOUT        seconds to wait for each daemon     (default 90)
#   GYRE_SLURM_DB_PASS        MariaDB password of the slurm user  (default gyre-slurm)
#
# Config files go to the default locations (/etc/slurm/slurm.conf, gres.conf,
# slurmdbd.conf) so that plain `sinfo`/`sbatch`/`sacct` work without SLURM_CONF.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"   # daemons and admin tools live in sbin

NODES="${GYRE_SLURM_NODES:-4}"
CPUS="${GYRE_SLURM_CPUS:-8}"
MEM_MB="${GYRE_SLURM_MEM_MB:-16000}"
GPUS="${GYRE_SLURM_GPUS:-2}"
CLUSTER="${GYRE_SLURM_CLUSTER:-gyre}"
STATE_DIR="${GYRE_SLURM_STATE_DIR:-/var/lib/gyre-slurm}"
TIMEOUT="${GYRE_SLURM_TIMEOUT:-90}"
DB_PASS="${GYRE_SLURM_DB_PASS:-gyre-slurm}"

for v in NODES CPUS MEM_MB GPUS TIMEOUT; do
    [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "slurm: ERROR: GYRE_SLURM_$v must be a number, got '${!v}'" >&2; exit 2; }
done
((NODES >= 1 && CPUS >= 1)) || { echo "slurm: ERROR: need at least 1 node and 1 CPU" >&2; exit 2; }

ETC=/etc/slurm
LOG_DIR="$STATE_DIR/log"
RUN_DIR="$STATE_DIR/run"
HOST="$(uname -n)"
NODE_PREFIX=node
BASE_PORT=17000          # nodeK listens on BASE_PORT+K
MUNGE_PID=/run/munge/munged.pid
MARIADB_PID=/run/mysqld/mysqld.pid
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)

T0="$(date +%s.%N)"

say() { echo "slurm: $*"; }

# die MESSAGE [LOGFILE...]: explain, show the end of the relevant logs, fail.
die() {
    local msg="$1"; shift
    echo "slurm: ERROR: $msg" >&2
    local f
    for f in "$@"; do
        [[ -f "$f" ]] || continue
        echo "---- tail of $f ----" >&2
        # The pmix plugin complains on every start (libpmix is not installed); noise here.
        grep -vE 'pmix|MPI: Cannot create context' "$f" | tail -n 30 >&2 || true
    done
    exit 1
}

elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

node_names() { local i; for ((i = 1; i <= NODES; i++)); do echo "$NODE_PREFIX$i"; done; }

# ---------------------------------------------------------------- processes

# pid_alive PIDFILE COMM: the pid file names a live process with that command
# name (pid files under the state dir survive reboots, so a bare pid may be reused).
pid_alive() {
    local pidfile="$1" comm="$2" pid
    [[ -r "$pidfile" ]] || return 1
    pid="$(tr -dc '0-9' <"$pidfile" 2>/dev/null)" || return 1
    [[ -n "$pid" ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$comm" ]] && running "$pid"
}

# spawn LOGFILE CMD...: start a daemon fully detached from this script. It must not
# keep any of our descriptors (stdout/stderr pipes of a caller such as
# subprocess.run(capture_output=True), or the flock fd), or the caller never sees EOF.
spawn() {
    local log="$1"; shift
    (
        for fd in /proc/self/fd/*; do
            fd="${fd##*/}"
            if [[ "$fd" =~ ^[0-9]+$ ]] && ((fd > 2)); then
                eval "exec $fd>&-" 2>/dev/null || true
            fi
        done
        exec setsid -f "$@" </dev/null >>"$log" 2>&1
    )
}

# wait_for DESCRIPTION PIDFILE COMM "LOGFILES" CHECK...: poll CHECK until it succeeds;
# fail early (showing LOGFILES) if the daemon died, or after TIMEOUT seconds.
wait_for() {
    local what="$1" pidfile="$2" comm="$3" logs="$4"; shift 4
    local deadline=$((SECONDS + TIMEOUT)) grace=$((SECONDS + 5))
    until "$@" >/dev/null 2>&1; do
        # Daemons write their pid file only after forking; give them a moment.
        if ((SECONDS > grace)) && ! pid_alive "$pidfile" "$comm"; then
            # shellcheck disable=SC2086
            die "$what is not running" $logs
        fi
        if ((SECONDS >= deadline)); then
            # shellcheck disable=SC2086
            die "$what did not become ready within ${TIMEOUT}s" $logs
        fi
        sleep 0.2
    done
}

# running PID: the process exists and is not a zombie (our daemons are reparented
# to whatever pid 1 is, which in containers may reap them only lazily).
running() {
    local stat
    stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
    stat="${stat##*) }"
    [[ "${stat:0:1}" != Z ]]
}

# stop_pids COMM PIDFILE...: SIGTERM every live one at once, wait, then SIGKILL.
stop_pids() {
    local comm="$1"; shift
    local f p pid pids=() names=() i
    for f in "$@"; do
        if pid_alive "$f" "$comm"; then
            pids+=("$(tr -dc '0-9' <"$f")")
            p="$(basename "$f" .pid)"
            [[ "$p" == "$comm"* ]] || p="$comm"
            names+=("$p")
        else
            rm -f "$f"   # stale
        fi
    done
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for ((i = 0; i < 300; i++)); do
        for pid in "${pids[@]}"; do running "$pid" && break; done
        running "$pid" || break
        sleep 0.05
    done
    for pid in "${pids[@]}"; do
        if running "$pid"; then
            say "$comm (pid $pid) ignored SIGTERM, killing"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    # Daemons remove their own pid files; not after SIGKILL.
    for f in "$@"; do pid_alive "$f" "$comm" || rm -f "$f"; done
    say "stopped ${names[*]}"
}

# ---------------------------------------------------------------- packages

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    say "installing ${missing[*]}"
    # Packages must not start their own daemons (munge, mariadb) during install:
    # we start and own them below. policy-rc.d is Debian's switch for that.
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; made_policy=1
    fi
    local log="$STATE_DIR/log/apt.log" rc=0
    mkdir -p "$STATE_DIR/log"
    {
        DEBIAN_FRONTEND=noninteractive apt-get update &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
    } </dev/null >"$log" 2>&1 || rc=$?
    ((made_policy)) && rm -f "$policy"
    ((rc == 0)) || die "apt-get failed (rc=$rc)" "$log"
}

# ---------------------------------------------------------------- configuration

gen_slurm_conf() {
    cat <<EOF
# Generated by tools/slurm/local_cluster.sh -- local emulated cluster, do not edit.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Short job credential lifetime (default 120 s): a requeued job can start again sooner.
AuthInfo=cred_expire=10
SlurmctldPort=6817
StateSaveLocation=$STATE_DIR/ctld
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
# Multiple-slurmd emulation: %n is the node name given with slurmd -N.
SlurmdSpoolDir=$STATE_DIR/spool/slurmd-%n
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmdParameters=config_overrides
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in this container/VM.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
# Finished jobs leave squeue/scontrol after 60 s; sacct keeps them for good.
MinJobAge=60
Waittime=0
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
$( ((GPUS > 0)) && echo "GresTypes=gpu" )
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
$( ((GPUS > 0)) && echo "AccountingStorageTRES=gres/gpu" )
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
EOF
    local i gres=""
    ((GPUS > 0)) && gres=" Gres=gpu:$GPUS"
    for ((i = 1; i <= NODES; i++)); do
        echo "NodeName=$NODE_PREFIX$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((BASE_PORT + i)) CPUs=$CPUS RealMemory=$MEM_MB$gres State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=${NODE_PREFIX}[1-$NODES] Default=YES MaxTime=INFINITE State=UP"
}

gen_gres_conf() {
    echo "# Generated by tools/slurm/local_cluster.sh: fake GPUs (character-device symlinks to /dev/null)."
    ((GPUS > 0)) || return 0
    echo "AutoDetect=off"
    echo "NodeName=${NODE_PREFIX}[1-$NODES] Name=gpu File=/dev/gyre-fakegpu[0-$((GPUS - 1))]"
}

gen_slurmdbd_conf() {
    cat <<EOF
# Generated by tools/slurm/local_cluster.sh, do not edit.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
DebugLevel=info
LogFile=$LOG_DIR/slurmdbd.log
PidFile=$RUN_DIR/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
}

# install_conf NAME CONTENT MODE: write if different; return 0 iff it changed.
install_conf() {
    local path="$ETC/$1" content="$2" mode="$3"
    if [[ -f "$path" ]] && [[ "$(cat "$path")" == "$content" ]]; then
        return 1
    fi
    if [[ -f "$path" ]] && ! grep -q 'local_cluster.sh' "$path"; then
        cp -n "$path" "$path.before-gyre" || true
    fi
    printf '%s\n' "$content" >"$path.tmp"
    chmod "$mode" "$path.tmp"
    mv -f "$path.tmp" "$path"
    return 0
}

configs_current() {
    [[ -f "$ETC/slurm.conf" && -f "$ETC/gres.conf" && -f "$ETC/slurmdbd.conf" ]] &&
        [[ "$(cat "$ETC/slurm.conf")" == "$(gen_slurm_conf)" ]] &&
        [[ "$(cat "$ETC/gres.conf")" == "$(gen_gres_conf)" ]] &&
        [[ "$(cat "$ETC/slurmdbd.conf")" == "$(gen_slurmdbd_conf)" ]]
}

# Node names and the controller host must resolve; none of them do by default.
ensure_hosts() {
    local name missing=()
    for name in "$HOST" $(node_names); do
        getent hosts "$name" >/dev/null || missing+=("$name")
    done
    ((${#missing[@]} == 0)) || echo "127.0.0.1 ${missing[*]}  # gyre local slurm" >>/etc/hosts ||
        die "cannot add ${missing[*]} to /etc/hosts"
}

ensure_fake_gpus() {
    local i dev
    for ((i = 0; i < GPUS; i++)); do
        dev="/dev/gyre-fakegpu$i"
        # Slurm rejects regular files; a symlink to a character device is accepted.
        [[ -L "$dev" && -c "$dev" ]] || ln -sfn /dev/null "$dev"
    done
}

ensure_dirs() {
    local n
    mkdir -p "$ETC" "$LOG_DIR" "$RUN_DIR" "$STATE_DIR/ctld"
    for n in $(node_names); do mkdir -p "$STATE_DIR/spool/slurmd-$n"; done
}

# ---------------------------------------------------------------- daemons

munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

ensure_munge() {
    munge_ok && return 0
    mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key
        else
            create-munge-key -f
        fi
    fi
    chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
    chmod 0700 /etc/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    chmod 0600 /etc/munge/munge.key
    # A stale socket/pid from a killed munged makes the new one refuse to start.
    pid_alive "$MUNGE_PID" munged || rm -f "$MUNGE_PID" /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    spawn "$LOG_DIR/munged.out" runuser -u munge -- /usr/sbin/munged
    touch "$RUN_DIR/started-munged"
    wait_for munged "$MUNGE_PID" munged "/var/log/munge/munged.log $LOG_DIR/munged.out" munge_ok
    say "munged started"
}

mariadb_ok() { mariadb-admin --protocol=socket -uroot ping >/dev/null 2>&1; }

ensure_mariadb() {
    if ! mariadb_ok; then
        if [[ ! -d /var/lib/mysql/mysql ]]; then
            say "initialising MariaDB data directory"
            mariadb-install-db --user=mysql --datadir=/var/lib/mysql --skip-test-db \
                >"$LOG_DIR/mariadb-install.log" 2>&1 </dev/null ||
                die "mariadb-install-db failed" "$LOG_DIR/mariadb-install.log"
        fi
        mkdir -p /run/mysqld
        chown mysql:mysql /run/mysqld
        pid_alive "$MARIADB_PID" mariadbd || rm -f "$MARIADB_PID"
        # Test cluster: durability of accounting rows across power loss does not
        # matter. The other two are what slurmdbd asks for.
        spawn "$LOG_DIR/mariadb.out" /usr/sbin/mariadbd --user=mysql \
            --pid-file="$MARIADB_PID" \
            --innodb-flush-log-at-trx-commit=0 \
            --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900
        touch "$RUN_DIR/started-mariadb"
        wait_for mariadb "$MARIADB_PID" mariadbd "$LOG_DIR/mariadb.out" mariadb_ok
        say "mariadb started"
    fi
    # Idempotent; cheap enough to run on every (re)start.
    mariadb --protocol=socket -uroot <<EOF >"$LOG_DIR/mariadb-setup.log" 2>&1 ||
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF
        die "creating the slurm database/user failed" "$LOG_DIR/mariadb-setup.log"
}

# A port probe, not sacctmgr: sacctmgr also parses slurm.conf, and a broken
# slurm.conf must not be reported as a slurmdbd failure.
slurmdbd_ok() { (: </dev/tcp/127.0.0.1/6819) 2>/dev/null; }

ensure_slurmdbd() {
    pid_alive "$RUN_DIR/slurmdbd.pid" slurmdbd && slurmdbd_ok && return 0
    stop_pids slurmdbd "$RUN_DIR/slurmdbd.pid"
    spawn "$LOG_DIR/slurmdbd.out" /usr/sbin/slurmdbd
    wait_for slurmdbd "$RUN_DIR/slurmdbd.pid" slurmdbd "$LOG_DIR/slurmdbd.log $LOG_DIR/slurmdbd.out" slurmdbd_ok
    say "slurmdbd started"
    # slurmctld would register the cluster itself, but only once it is up; doing it
    # here means the very first jobs are already accounted.
    if ! sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >"$LOG_DIR/sacctmgr.log" 2>&1 ||
            die "sacctmgr add cluster failed" "$LOG_DIR/sacctmgr.log"
        say "cluster '$CLUSTER' registered in accounting"
    fi
}

slurmctld_ok() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

ensure_slurmctld() {
    pid_alive "$RUN_DIR/slurmctld.pid" slurmctld && slurmctld_ok && return 0
    stop_pids slurmctld "$RUN_DIR/slurmctld.pid"
    # -i: a state file written by another config (e.g. other node count) must not
    # keep the controller down.
    spawn "$LOG_DIR/slurmctld.out" /usr/sbin/slurmctld -i
    wait_for slurmctld "$RUN_DIR/slurmctld.pid" slurmctld "$LOG_DIR/slurmctld.log $LOG_DIR/slurmctld.out" slurmctld_ok
    say "slurmctld started"
}

ensure_slurmds() {
    local n started=()
    for n in $(node_names); do
        pid_alive "$RUN_DIR/slurmd-$n.pid" slurmd && continue
        rm -f "$RUN_DIR/slurmd-$n.pid"
        spawn "$LOG_DIR/slurmd-$n.out" /usr/sbin/slurmd -N "$n"
        started+=("$n")
    done
    ((${#started[@]} == 0)) || say "slurmd started for ${started[*]}"
}

# ---------------------------------------------------------------- health

# All nodes known to slurmctld and in a usable state (no down/drain/not-responding).
nodes_ok() {
    local out
    out="$(sinfo -h -N -o '%N %t' 2>/dev/null)" || return 1
    [[ "$(grep -cE '^[^ ]+ (idle|mix|alloc|comp|resv|plnd)$' <<<"$out")" -eq "$NODES" ]] &&
        [[ "$(wc -l <<<"$out")" -eq "$NODES" ]]
}

accounting_ok() { sacct -n -X -a -S now -o JobID >/dev/null 2>&1; }

daemons_alive() {
    local n
    pid_alive "$RUN_DIR/slurmdbd.pid" slurmdbd && pid_alive "$RUN_DIR/slurmctld.pid" slurmctld || return 1
    for n in $(node_names); do pid_alive "$RUN_DIR/slurmd-$n.pid" slurmd || return 1; done
}

healthy() {
    [[ -x /usr/sbin/slurmctld ]] && configs_current && daemons_alive &&
        munge_ok && nodes_ok && accounting_ok
}

wait_nodes() {
    local deadline=$((SECONDS + TIMEOUT)) resumed=0 n
    until nodes_ok; do
        for n in $(node_names); do
            if ((SECONDS > deadline - TIMEOUT + 5)) && ! pid_alive "$RUN_DIR/slurmd-$n.pid" slurmd; then
                die "slurmd for $n is not running" "$LOG_DIR/slurmd-$n.log" "$LOG_DIR/slurmd-$n.out"
            fi
        done
        # Nodes left down/drained by an earlier run (e.g. killed mid-job) stay so
        # even after their slurmd re-registers; bring them back once.
        if ((!resumed && SECONDS > deadline - TIMEOUT + 3)); then
            local bad
            bad="$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(down|drain|drng|fail)/ { print $1 }' | paste -sd, -)"
            [[ -z "$bad" ]] || { scontrol update NodeName="$bad" State=RESUME >/dev/null 2>&1 || true; say "resumed $bad"; }
            resumed=1
        fi
        if ((SECONDS >= deadline)); then
            sinfo -N >&2 || true
            die "nodes did not become idle within ${TIMEOUT}s" "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd-${NODE_PREFIX}1.log"
        fi
        sleep 0.2
    done
}

# ---------------------------------------------------------------- commands

# slurmctld first: stopped after the slurmds, its shutdown hangs for seconds on
# RPCs to them.
stop_slurm() {
    stop_pids slurmctld "$RUN_DIR/slurmctld.pid"
    # All slurmd pid files, including nodes beyond the current NODES.
    stop_pids slurmd "$RUN_DIR"/slurmd-*.pid
}

cmd_up() {
    if healthy; then
        say "up ($NODES nodes, accounting on) in $(elapsed)s (already running)"
        return 0
    fi
    [[ $EUID -eq 0 ]] || die "must run as root"
    mkdir -p "$STATE_DIR"
    exec 9>"$STATE_DIR/lock"
    flock -w 600 9 || die "could not lock $STATE_DIR/lock"
    # Another `up` may have finished while we waited for the lock.
    if healthy; then
        say "up ($NODES nodes, accounting on) in $(elapsed)s (already running)"
        return 0
    fi

    install_packages
    ensure_dirs
    ensure_hosts
    ensure_fake_gpus

    local slurm_changed=0 dbd_changed=0
    install_conf slurm.conf "$(gen_slurm_conf)" 0644 && slurm_changed=1
    install_conf gres.conf "$(gen_gres_conf)" 0644 && slurm_changed=1
    install_conf slurmdbd.conf "$(gen_slurmdbd_conf)" 0600 && dbd_changed=1
    if ((slurm_changed)); then
        say "slurm.conf/gres.conf written"
        stop_slurm
    fi
    if ((dbd_changed)); then
        say "slurmdbd.conf written"
        stop_pids slurmdbd "$RUN_DIR/slurmdbd.pid"
    fi

    ensure_munge
    ensure_mariadb
    ensure_slurmdbd
    ensure_slurmctld
    ensure_slurmds
    wait_nodes
    wait_for "accounting (sacct)" "$RUN_DIR/slurmdbd.pid" slurmdbd "$LOG_DIR/slurmdbd.log" accounting_ok
    say "up ($NODES nodes, accounting on) in $(elapsed)s"
}

cmd_down() {
    mkdir -p "$STATE_DIR"
    exec 9>"$STATE_DIR/lock"
    flock -w 600 9 || die "could not lock $STATE_DIR/lock"
    stop_slurm
    stop_pids slurmdbd "$RUN_DIR/slurmdbd.pid"
    # MariaDB and munged only if we started them (they may serve something else).
    if [[ -e "$RUN_DIR/started-mariadb" ]]; then
        stop_pids mariadbd "$MARIADB_PID"
        rm -f "$RUN_DIR/started-mariadb"
    fi
    if [[ -e "$RUN_DIR/started-munged" ]]; then
        stop_pids munged "$MUNGE_PID"
        rm -f "$RUN_DIR/started-munged"
    fi
    say "down in $(elapsed)s"
}

cmd_status() {
    if ! command -v sinfo >/dev/null 2>&1; then
        say "not installed"; return 1
    fi
    sinfo 2>&1 || true
    if accounting_ok; then say "accounting: ok"; else say "accounting: NOT answering"; fi
    if healthy; then
        say "healthy ($NODES nodes)"
    else
        local why=()
        configs_current || why+=("configs outdated")
        daemons_alive || why+=("daemon(s) not running")
        munge_ok || why+=("munge not working")
        nodes_ok || why+=("nodes not all usable")
        accounting_ok || why+=("accounting down")
        say "NOT healthy: ${why[*]:-unknown}"
        return 1
    fi
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
