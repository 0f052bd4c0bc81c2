#!/usr/bin/env bash
# Build kvcanary's images from deploy/Containerfile with buildah (Debian's package), as root.
#
#   deploy/build-image.sh [--worker] [TAG]      # default tag: localhost/kvcanary:<version>
#
# BASE names a Debian 12 image to build on (default: docker.io/library/debian:bookworm-slim). With
# BASE=debootstrap the base is made here from Debian's own packages (debootstrap, minbase, with
# python3 and python3-venv) and imported as localhost/kvcanary-debian:bookworm: what this project's
# machines do, since they reach Debian's mirror and PyPI but no container registry.
# RUN steps use buildah's chroot isolation, which needs no OCI runtime: it builds inside a container
# (a CI runner, these machines) where podman's runtime cannot start one (docs/operating.md).
# --worker builds the reference worker's image (torch 2.13 CPU); WHEELS=DIR offers a local torch
# wheel in place of its index. CA_BUNDLE=FILE 
# is the CA pip trusts while building, for a TLS-inspecting proxy (default: $PIP_CERT, as pip reads
# it); it is mounted for the build, never copied into the image.
set -euo pipefail
cd "$(dirname "$0")/.."
target=monitor
if [ "${1:-}" = "--worker" ]; then target=worker; shift; fi
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
name=kvcanary; [ "$target" = worker ] && name=kvcanary-worker
tag=${1:-localhost/$name:$version}
base=${BASE:-docker.io/library/debian:bookworm-slim}

if [ "$base" = debootstrap ]; then
  base=localhost/kvcanary-debian:bookworm
  if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root/fs" \
      "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$root/debootstrap.log" 2>&1 \
      || { tail -n 20 "$root/debootstrap.log" >&2; exit 1; }
    rm -rf "$root"/fs/var/cache/apt/archives/*.deb "$root"/fs/var/lib/apt/lists/*
    tar -C "$root/fs" -cf "$root/fs.tar" .
    c=$(buildah from scratch)
    buildah add --quiet "$c" "$root/fs.tar" / >/dev/null  # a local tar is unpacked where it lands
    buildah config --cmd /bin/bash "$c"
    buildah commit --quiet --rm "$c" "$base" >/dev/null
  fi
fi

args=(--isolation=chroot --layers -f deploy/Containerfile --target "$target" --build-arg "BASE=$base" -t "$tag")
ca=${CA_BUNDLE:-${PIP_CERT:-}}
if [ -n "$ca" ]; then
  args+=(-v "$ca:/run/kvcanary-build-ca.crt:ro" --build-arg BUILD_CA=/run/kvcanary-build-ca.crt)
fi
if [ -n "${WHEELS:-}" ]; then
  args+=(-v "$WHEELS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_INDEX_URL=)
fi
start=$(date +%s)
buildah bud "${args[@]}" .
echo "build-image: $tag ($target) on $base in $(( $(date +%s) - start ))s"
