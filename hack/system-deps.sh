#!/usr/bin/env bash
# The Debian packages `make images` and `make e2e` need (not pip-installable), in one place.
#   hack/system-deps.sh install        installs whatever is missing (apt-get; root or sudo)
#   hack/system-deps.sh check images   exits 1 naming what `make images` lacks and the install line
#   hack/system-deps.sh check e2e      the same for `make e2e` (the cluster and the e2e tests)
# `make system-deps` runs `install`. Go (for the Kubernetes binaries) is not a Debian package here:
# hack/kube/build.sh names the Go release it needs.
set -euo pipefail

# command -> the Debian package that provides it
declare -A images=(
  [buildah]=buildah
  [debootstrap]=debootstrap
)
declare -A e2e=(
  [containerd]=containerd
  [ctr]=containerd
  [runc]=runc
  [/usr/lib/cni/bridge]=containernetworking-plugins
  [iptables]=iptables
  [ipset]=ipset
  [ip]=iproute2
  [openssl]=openssl
  [curl]=curl
  [gcc]=gcc
  [/usr/lib/x86_64-linux-gnu/libc.a]=libc6-dev
  [prometheus]=prometheus
)

missing_packages() {  # NAME of an associative array: prints the packages whose command is absent
  local -n wanted="$1"
  local what
  for what in "${!wanted[@]}"; do
    if [[ "$what" == /* ]]; then
      [[ -e "$what" ]] || echo "${wanted[$what]}"
    else
      command -v "$what" >/dev/null 2>&1 || [[ -x "/usr/sbin/$what" ]] || echo "${wanted[$what]}"
    fi
  done | sort -u
}

check() {  # images|e2e
  local -a missing
  case "$1" in
    images) mapfile -t missing < <(missing_packages images) ;;
    e2e) mapfile -t missing < <(missing_packages e2e) ;;
    *) echo "system-deps.sh: unknown target '$1': expected images or e2e" >&2; exit 2 ;;
  esac
  ((${#missing[@]} == 0)) && return 0
  echo "make $1: missing Debian packages: ${missing[*]}" >&2
  echo "  install them with: make system-deps   (or: apt-get install -y --no-install-recommends ${missing[*]})" >&2
  exit 1
}

install() {
  local -a missing
  mapfile -t missing < <({ missing_packages images; missing_packages e2e; } | sort -u)
  if ((${#missing[@]} == 0)); then
    echo "system-deps: everything is installed"
    return 0
  fi
  local sudo=""
  [[ "$(id -u)" == 0 ]] || sudo=sudo
  echo "system-deps: installing ${missing[*]} (apt-get)"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

case "${1:-}" in
  install) install ;;
  check) check "${2:-}" ;;
  *) echo "usage: system-deps.sh install | check images|e2e" >&2; exit 2 ;;
esac
