#!/usr/bin/env bash
# Builds the test control plane (etcd, kube-apiserver, kube-controller-manager) from the Go
# modules pinned in this folder and caches the binaries outside the repository:
#   ${LOCKSTEP_KUBE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/lockstep/kube}/<version>/
# Prints that directory on stdout. Binaries already there are not rebuilt.
#   build.sh --check   builds nothing: prints the directory if every binary is there, else exits 1
#                      naming what is missing.
# When KUBEBUILDER_ASSETS names a directory, the etcd and kube-apiserver found there are used and
# only what it lacks (envtest ships no kube-controller-manager) is built into the cache.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
command -v go >/dev/null 2>&1 || export PATH="$PATH:/usr/local/go/bin"
version="$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$here/go.mod")"
etcd_version="$(awk '$1 == "go.etcd.io/etcd/server/v3" { print $2 }' "$here/go.mod")"
cache_root="${LOCKSTEP_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lockstep/kube}"
out="$cache_root/$version"

minor="${version#v1.}"; minor="${minor%%.*}"
version_pkgs=(k8s.io/component-base/version k8s.io/client-go/pkg/version)
ldflags="-s -w"
for pkg in "${version_pkgs[@]}"; do
  ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

have() {
  local name="$1"
  [[ -n "${KUBEBUILDER_ASSETS:-}" && -x "$KUBEBUILDER_ASSETS/$name" ]] || [[ -x "$out/$name" ]]
}

build() {
  local name="$1" pkg="$2" flags="$3"
  if have "$name"; then return; fi
  command -v go >/dev/null 2>&1 || { echo "build.sh: $name is missing and no Go toolchain is on PATH" >&2; exit 1; }
  mkdir -p "$out"
  echo "building $name ($pkg) into $out" >&2
  local start=$SECONDS
  # Build to a temporary name and rename, so an interrupted build never leaves a broken binary.
  (cd "$here" && CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags="$flags" -o "$out/.$name.tmp" "$pkg")
  mv -f "$out/.$name.tmp" "$out/$name"
  echo "built $name in $((SECONDS - start)) s" >&2
}

if [[ "${1:-}" == "--check" ]]; then
  missing=()
  for name in etcd kube-apiserver kube-controller-manager; do
    have "$name" || missing+=("$name")
  done
  if ((${#missing[@]})); then
    echo "missing in $out${KUBEBUILDER_ASSETS:+ and $KUBEBUILDER_ASSETS}: ${missing[*]}; run make k8s-bins" >&2
    exit 1
  fi
  echo "$out"
  exit 0
fi

build etcd ./etcd "-s -w"
build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "$ldflags"
build kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager "$ldflags"
[[ -d "$out" ]] && echo "etcd $etcd_version" > "$out/VERSIONS"
echo "$out"
