#!/usr/bin/env bash
# Start a single-node Slurm cluster with job accounting on this machine, for the tests.
#
# Installs Debian's slurm-wlm, slurmdbd, munge and mariadb-server; writes slurm.conf, gres.conf,
# cgroup.conf and slurmdbd.conf from the templates beside this script (this machine's CPUs and
# memory, one fake GPU); starts munged, MariaDB, slurmdbd, slurmctld and slurmd directly (no systemd);
# registers the cluster with the accounting database; waits until the node takes jobs and sacct
# answers; prints a one-line summary. Idempotent: a second run only starts what is not running
# (and restarts the Slurm daemons if their configuration changed). Needs root.
#
# Environment: SLURM_TEST_CLUSTER (default scagent), SLURM_TEST_PARTITION (default main).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/lib.sh"

readonly cluster=${SLURM_TEST_CLUSTER:-scagent}
readonly partition=${SLURM_TEST_PARTITION:-main}
host=$(hostname -s)
readonly host
readonly packages=(slurm-wlm slurmdbd munge mariadb-server)
readonly t0=$SECONDS

[[ $EUID -eq 0 ]] || die "must run as root (it installs packages and starts system daemons)"
[[ $cluster =~ ^[a-z0-9_]+$ ]] || die "SLURM_TEST_CLUSTER='$cluster': expected lower-case letters, digits, _"
[[ $partition =~ ^[A-Za-z0-9_-]+$ ]] || die "SLURM_TEST_PARTITION='$partition': expected letters, digits, _ or -"

install_packages() {
  local p missing=()
  for p in "${packages[@]}"; do
    [[ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" == installed ]] || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  log "installing ${missing[*]} (apt-get)"
  # The packages' scripts must not start the daemons through init scripts: this script does.
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 0755 "$policy"
    made_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if ((made_policy)); then rm -f "$policy"; fi
}

# The node's hardware as slurmd itself sees it, so slurmctld never marks the node invalid.
read_hardware() {
  local line
  line=$(slurmd -C | head -1)
  cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$line")
  sockets=$(sed -n 's/.* SocketsPerBoard=\([0-9]*\).*/\1/p' <<<"$line")
  cores=$(sed -n 's/.* CoresPerSocket=\([0-9]*\).*/\1/p' <<<"$line")
  threads=$(sed -n 's/.* ThreadsPerCore=\([0-9]*\).*/\1/p' <<<"$line")
  memory_mb=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$line")
  [[ -n $cpus && -n $sockets && -n $cores && -n $threads && -n $memory_mb ]] ||
    die "could not read CPUs, sockets, cores, threads and memory from 'slurmd -C': $line"
}

render() {
  sed -e "s/@CLUSTER@/$cluster/g" -e "s/@PARTITION@/$partition/g" -e "s/@HOST@/$host/g" \
    -e "s/@CPUS@/$cpus/g" -e "s/@SOCKETS@/$sockets/g" -e "s/@CORES@/$cores/g" \
    -e "s/@THREADS@/$threads/g" -e "s/@MEMORY_MB@/$memory_mb/g" -e "s#@PROCTRACK@#$proctrack#g" \
    -e "s/@DB_PASSWORD@/$db_password/g" "$1"
}

# put_config TEMPLATE DEST MODE: write the rendered template; succeed only if DEST changed.
put_config() {
  local new
  new=$(render "$1")
  if [[ -f $2 && "$(<"$2")" == "$new" ]]; then return 1; fi
  printf '%s\n' "$new" >"$2.new"
  chmod "$3" "$2.new"
  chown slurm:slurm "$2.new"
  mv "$2.new" "$2"
  log "wrote $2"
}

start_munge() {
  if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  running /run/munge/munged.pid munged && return 0
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  runuser -u munge -- /usr/sbin/munged
  wait_for munged 20 bash -c 'munge -n | unmunge'
}

start_mariadb() {
  if ! running /run/mysqld/mysqld.pid mariadbd; then
    install -d -o mysql -g mysql -m 0755 /run/mysqld
    install -d -o mysql -g adm -m 2750 /var/log/mysql
    [[ -d /var/lib/mysql/mysql ]] || mariadb-install-db --user=mysql >/dev/null
    # The InnoDB settings slurmdbd asks for (it warns at start-up otherwise).
    setsid -f mariadbd --user=mysql --pid-file=/run/mysqld/mysqld.pid \
      --innodb-lock-wait-timeout=900 --innodb-buffer-pool-size=512M \
      --log-error=/var/log/mysql/error.log \
      </dev/null >/dev/null 2>&1
    wait_for MariaDB 60 mysqladmin --connect-timeout=2 status
  fi
  mysql --batch <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$db_password';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$db_password';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
SQL
}

# The node answers and takes jobs (jobs of other users may keep it busy).
node_usable() {
  local state
  state=$(sinfo -h -n "$host" -o %T) || return 1
  echo "$state"
  [[ $state =~ ^(idle|mixed|allocated|completing)$ ]]
}
cluster_known() { sacctmgr -n -P show cluster format=cluster | grep -qx "$cluster"; }

install_packages
id slurm >/dev/null 2>&1 || die "user 'slurm' missing although slurm-wlm is installed"
# srun and slurmd reach each other by this machine's name.
getent hosts "$host" >/dev/null || echo "127.0.0.1 $host" >>/etc/hosts

install -d -o slurm -g slurm -m 0755 /var/log/slurm /var/lib/slurm /var/lib/slurm/slurmctld
install -d -m 0755 /var/lib/slurm/slurmd /etc/slurm
read_hardware
if [[ -d /sys/fs/cgroup/freezer ]]; then proctrack=proctrack/cgroup; else proctrack=proctrack/linuxproc; fi
# Keep the database password of an earlier run; a fresh machine gets a random one.
db_password=$(sed -n 's/^StoragePass=//p' /etc/slurm/slurmdbd.conf 2>/dev/null || true)
[[ -n $db_password ]] || db_password=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')

changed=0
put_config "$here/slurm.conf.in" /etc/slurm/slurm.conf 0644 && changed=1
put_config "$here/gres.conf.in" /etc/slurm/gres.conf 0644 && changed=1
put_config "$here/cgroup.conf.in" /etc/slurm/cgroup.conf 0644 && changed=1
put_config "$here/slurmdbd.conf.in" /etc/slurm/slurmdbd.conf 0600 && changed=1
if ((changed)); then
  stop_pidfile /run/slurmd.pid slurmd
  stop_pidfile /run/slurmctld.pid slurmctld
  stop_pidfile /run/slurmdbd.pid slurmdbd
fi

start_munge
start_mariadb
if ! running /run/slurmdbd.pid slurmdbd; then
  slurmdbd
fi
wait_for slurmdbd 60 sacctmgr -n show cluster
cluster_known || sacctmgr -i add cluster "$cluster" >/dev/null
running /run/slurmctld.pid slurmctld || slurmctld
wait_for slurmctld 60 bash -c 'scontrol ping | grep -q UP'
running /run/slurmd.pid slurmd || slurmd
# A node left down or drained by an earlier crash comes back here.
if sinfo -h -n "$host" -o %T | grep -Eq 'down|drain|fail'; then
  scontrol update NodeName="$host" State=RESUME
fi
wait_for "node $host" 60 node_usable
wait_for sacct 30 sacct -n -X --starttime now-1hours

echo "slurm test cluster '$cluster' up in $((SECONDS - t0))s: node $host $(node_usable)" \
  "(CPUs=$cpus RealMemory=${memory_mb}MB gres=gpu:1, $proctrack), partition $partition," \
  "accounting by slurmdbd + MariaDB (sacct answers)"
