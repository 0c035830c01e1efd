#!/usr/bin/env bash
# Builds the Debian base image every Lockstep image starts from, without pulling anything:
# debootstrap (Debian packages only) -> a root filesystem -> `buildah from scratch` -> one layer.
#   images/base.sh   prints the image name; an image already in buildah's storage is not rebuilt.
# Contents: Debian $SUITE minbase + python3, ca-certificates and tini; docs, man pages, locales and
# apt's caches removed; the non-root user `lockstep` (uid/gid 65532, as the chart's securityContext).
# The package list with versions is kept in the image at /usr/share/lockstep/base-packages.txt.
set -euo pipefail

SUITE="${LOCKSTEP_DEBIAN_SUITE:-bookworm}"
MIRROR="${LOCKSTEP_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
cache="${LOCKSTEP_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lockstep/images}"
image="localhost/lockstep/debian:$SUITE"

if buildah inspect --type image "$image" >/dev/null 2>&1; then
  echo "$image"
  exit 0
fi

rootfs="$cache/rootfs-$SUITE"
mkdir -p "$cache/debootstrap-cache"
start=$SECONDS
if [[ ! -x "$rootfs/usr/bin/python3" ]]; then
  rm -rf "$rootfs" "$rootfs.partial"
  echo "base: debootstrap $SUITE from $MIRROR (minbase + python3, ca-certificates, tini)" >&2
  debootstrap --variant=minbase --include=python3,ca-certificates,tini \
    --cache-dir="$cache/debootstrap-cache" "$SUITE" "$rootfs.partial" "$MIRROR" >&2
  mv "$rootfs.partial" "$rootfs"
fi

# Trim on a copy, so a rerun starts from the untouched debootstrap output.
work="$(mktemp -d "$cache/base.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp -a "$rootfs/." "$work/"
chroot "$work" groupadd --gid 65532 lockstep
chroot "$work" useradd --uid 65532 --gid 65532 --home-dir /home/lockstep --create-home --shell /usr/sbin/nologin lockstep
mkdir -p "$work/usr/share/lockstep"
chroot "$work" dpkg-query -W -f '${Package}=${Version}\n' > "$work/usr/share/lockstep/base-packages.txt"
rm -rf "$work"/usr/share/doc/* "$work"/usr/share/man/* "$work"/usr/share/info/* "$work"/var/cache/apt/* \
  "$work"/var/lib/apt/lists/* "$work"/var/log/* "$work"/tmp/* "$work"/var/tmp/*
find "$work/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
# No Python bytecode of the base's own stdlib build-time leftovers; images compile what they install.
find "$work/usr/lib/python3" "$work/usr/lib/python3.11" -name '__pycache__' -type d -prune -exec rm -rf {} + 2>/dev/null || true

ctr="$(buildah from scratch)"
mnt="$(buildah mount "$ctr")"
tar -C "$work" -c . | tar -C "$mnt" -x
buildah umount "$ctr" >/dev/null
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
  --label org.opencontainers.image.description="Debian $SUITE minbase + python3 for Lockstep" "$ctr"
buildah commit --quiet --rm "$ctr" "$image" >/dev/null
echo "base: $image in $((SECONDS - start)) s" >&2
echo "$image"
