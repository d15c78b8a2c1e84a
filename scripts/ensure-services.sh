#!/usr/bin/env bash
# Make sure the services Kiln's integration tests need are answering:
#   PostgreSQL on 127.0.0.1:5432 (user postgres, trust auth)
#   Redis      on 127.0.0.1:6379
# For each one: already answering -> nothing to do; installed but down -> start it;
# not installed -> install with apt-get (root only), then start it.
# Exits 1 with a sentence on stderr if a service still does not answer after 30 s
# (ENSURE_SERVICES_WAIT=seconds to change that).
set -euo pipefail

PG_HOST=127.0.0.1
PG_PORT=5432
REDIS_HOST=127.0.0.1
REDIS_PORT=6379
WAIT_SECONDS=${ENSURE_SERVICES_WAIT:-30}
REDIS_DIR=/var/lib/redis
REDIS_LOG_DIR=/var/log/redis
REDIS_LOG="$REDIS_LOG_DIR/ci.log"

say() { printf '%s\n' "$*"; }
die() { printf 'ensure-services: %s\n' "$*" >&2; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }

# --- probes ---------------------------------------------------------------------------------

port_open() { # host port
  (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

pg_answers() {
  if have pg_isready; then
    pg_isready -q -t 2 -h "$PG_HOST" -p "$PG_PORT"
  else
    port_open "$PG_HOST" "$PG_PORT"
  fi
}

redis_answers() {
  local reply
  if have redis-cli; then
    local -a limit=()
    have timeout && limit=(timeout 3)
    reply=$("${limit[@]}" redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null) || return 1
  else
    # Speak just enough RESP over /dev/tcp to get a PONG back.
    reply=$(
      exec 2>/dev/null
      exec 3<>"/dev/tcp/$REDIS_HOST/$REDIS_PORT" || exit 1
      printf 'PING\r\n' >&3
      IFS= read -r -t 2 line <&3 || exit 1
      printf '%s' "$line"
    ) || return 1
  fi
  [[ $reply == *PONG* ]]
}

wait_for() { # probe-function
  local probe=$1 i
  for ((i = 0; i < WAIT_SECONDS; i++)); do
    "$probe" && return 0
    sleep 1
  done
  "$probe"
}

# --- PostgreSQL -----------------------------------------------------------------------------

pg_installed() {
  have pg_ctlcluster && [[ -d /etc/postgresql ]] && [[ -n $(ls -A /etc/postgresql 2>/dev/null) ]]
}

pg_version() { # newest installed major version
  ls /etc/postgresql | sort -V | tail -n 1
}

pg_start() {
  local ver out
  ver=$(pg_version)
  if [[ ! -d /etc/postgresql/$ver/main ]]; then
    have pg_createcluster || die "PostgreSQL $ver has no 'main' cluster and pg_createcluster is missing."
    pg_createcluster "$ver" main >/dev/null
  fi
  if ! out=$(pg_ctlcluster --skip-systemctl-redirect "$ver" main start 2>&1); then
    # Not fatal by itself (e.g. "already running" while it is still starting up);
    # the wait below decides, and its error points at the log.
    printf 'ensure-services: pg_ctlcluster %s main start said: %s\n' "$ver" "$out" >&2
  fi
}

# A fresh cluster: let local TCP connections in without a password (CI / dev only).
pg_trust_localhost() {
  local ver hba tmp
  ver=$(pg_version)
  hba=/etc/postgresql/$ver/main/pg_hba.conf
  [[ -f $hba ]] || die "PostgreSQL $ver was installed but $hba does not exist."
  tmp=$(mktemp)
  {
    printf '# Added by scripts/ensure-services.sh: trust local TCP connections (dev/CI only).\n'
    printf 'host all all 127.0.0.1/32 trust\n'
    printf 'host all all ::1/128 trust\n'
    cat "$hba"
  } >"$tmp"
  cat "$tmp" >"$hba" # keep owner and mode of the original file
  rm -f "$tmp"
  # The package may have started the cluster already; make it read the new rules.
  if pg_ctlcluster --skip-systemctl-redirect "$ver" main status >/dev/null 2>&1; then
    pg_ctlcluster --skip-systemctl-redirect "$ver" main reload >/dev/null
  fi
}

# --- Redis ----------------------------------------------------------------------------------

redis_start() {
  mkdir -p "$REDIS_DIR" "$REDIS_LOG_DIR"
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$REDIS_PORT" \
    --save "" --appendonly no --dir "$REDIS_DIR" --logfile "$REDIS_LOG" \
    || printf 'ensure-services: redis-server did not start; see %s\n' "$REDIS_LOG" >&2
}

# --- decide ---------------------------------------------------------------------------------

# ok: answering now; wait: something listens on the port but is not ready (starting up, or
# another program: the wait below decides); start: installed but down; install: not installed.
pg_action=ok
redis_action=ok

if ! pg_answers; then
  if port_open "$PG_HOST" "$PG_PORT"; then pg_action=wait
  elif pg_installed; then pg_action=start
  else pg_action=install; fi
fi
if ! redis_answers; then
  if port_open "$REDIS_HOST" "$REDIS_PORT"; then redis_action=wait
  elif have redis-server; then redis_action=start
  else redis_action=install; fi
fi

# --- install (one apt-get run for whatever is missing) --------------------------------------

packages=()
[[ $pg_action == install ]] && packages+=(postgresql)
[[ $redis_action == install ]] && packages+=(redis-server)
if ((${#packages[@]})); then
  if [[ $(id -u) -ne 0 ]] || ! have apt-get; then
    die "${packages[*]} not installed, and this script can only install them as root with apt-get; install them, or start the services yourself."
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${packages[@]}" >/dev/null
  if [[ $pg_action == install ]]; then
    pg_installed || die "apt-get installed postgresql but no cluster directory appeared under /etc/postgresql."
    pg_trust_localhost
  fi
fi

# --- start ----------------------------------------------------------------------------------

# The packages' postinst may already have started a server; only start what is still down.
if [[ $pg_action == start || $pg_action == install ]] && ! pg_answers; then pg_start; fi
if [[ $redis_action == start || $redis_action == install ]] && ! redis_answers; then redis_start; fi

# --- wait and report ------------------------------------------------------------------------

if ! wait_for pg_answers; then
  if [[ $pg_action == wait ]]; then
    die "something listens on $PG_HOST:$PG_PORT but PostgreSQL did not accept connections there within ${WAIT_SECONDS}s; check what owns that port."
  fi
  die "PostgreSQL did not answer on $PG_HOST:$PG_PORT within ${WAIT_SECONDS}s; see /var/log/postgresql/postgresql-$(pg_version 2>/dev/null || echo '*')-main.log."
fi
case $pg_action in
  ok) say "postgres: already answering on $PG_HOST:$PG_PORT" ;;
  wait) say "postgres: was starting up; now answering on $PG_HOST:$PG_PORT" ;;
  start) say "postgres: started cluster $(pg_version)/main on $PG_HOST:$PG_PORT" ;;
  install) say "postgres: installed postgresql $(pg_version) (trust on localhost) and started it on $PG_HOST:$PG_PORT" ;;
esac

if ! wait_for redis_answers; then
  if [[ $redis_action == wait ]]; then
    die "something listens on $REDIS_HOST:$REDIS_PORT but does not answer PING with PONG within ${WAIT_SECONDS}s (a password? another program?)."
  fi
  detail=""
  [[ -r $REDIS_LOG ]] && detail=" Last log lines: $(tail -n 3 "$REDIS_LOG" | tr '\n' ' ')"
  die "Redis did not answer on $REDIS_HOST:$REDIS_PORT within ${WAIT_SECONDS}s.${detail}"
fi
case $redis_action in
  ok) say "redis: already answering on $REDIS_HOST:$REDIS_PORT" ;;
  wait) say "redis: was starting up; now answering on $REDIS_HOST:$REDIS_PORT" ;;
  start) say "redis: started redis-server on $REDIS_HOST:$REDIS_PORT (no persistence)" ;;
  install) say "redis: installed redis-server and started it on $REDIS_HOST:$REDIS_PORT" ;;
esac
