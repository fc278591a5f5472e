#!/usr/bin/env bash
# Stop the test cluster that tests/slurm/start.sh started: slurmd, slurmctld, slurmdbd, MariaDB,
# munged, in that order, each by its pid file. Installed packages, configuration and the
# accounting database stay, so start.sh brings the same cluster back quickly.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[[ $EUID -eq 0 ]] || die "must run as root (the daemons belong to root, slurm, mysql and munge)"
t0=$SECONDS
stop_pidfile /run/slurmd.pid slurmd
stop_pidfile /run/slurmctld.pid slurmctld
stop_pidfile /run/slurmdbd.pid slurmdbd
stop_pidfile /run/mysqld/mysqld.pid mariadbd
stop_pidfile /run/munge/munged.pid munged
echo "slurm test cluster stopped in $((SECONDS - t0))s"
