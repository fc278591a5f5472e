# shellcheck shell=bash
# Helpers shared by start.sh and stop.sh (sourced, not run).

log() { echo "${0##*/}: $*" >&2; }
die() {
  log "$*"
  exit 1
}

# alive PID: is PID a live process (a zombie counts as gone)?
alive() {
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ -n $state && $state != Z ]]
}

# running PIDFILE NAME: is the process named in PIDFILE alive, and is it NAME?
running() {
  local pid
  [[ -r $1 ]] || return 1
  pid=$(<"$1")
  [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2" ]]
}

# wait_for WHAT SECONDS COMMAND...: poll COMMAND until it succeeds; after SECONDS die with WHAT
# and the last output of COMMAND.
wait_for() {
  local what=$1 limit=$2 output
  local deadline=$((SECONDS + limit))
  shift 2
  until output=$("$@" 2>&1); do
    ((SECONDS < deadline)) ||
      die "$what not ready after ${limit}s; \`$*\` said: ${output:-nothing} (logs: /var/log/slurm)"
    sleep 0.5
  done
}

# stop_pidfile PIDFILE NAME: TERM the daemon in PIDFILE (if it is NAME), KILL it after 30 s.
stop_pidfile() {
  running "$1" "$2" || return 0
  local pid deadline=$((SECONDS + 30))
  pid=$(<"$1")
  kill -TERM "$pid"
  while alive "$pid"; do
    if ((SECONDS >= deadline)); then
      log "$2 (pid $pid) ignored TERM for 30 s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.2
  done
  log "stopped $2 (pid $pid)"
}
