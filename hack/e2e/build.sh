#!/usr/bin/env bash
# Builds what the e2e cluster needs beyond hack/kube (etcd, kube-apiserver, kube-controller-manager):
#   kube-scheduler, kubelet, kube-proxy  from k8s.io/kubernetes (kube/go.mod: the same release)
#   coredns                              coredns/main.go: CoreDNS with the five plugins the Corefile uses (coredns/go.mod)
#   kube-router-netpol-<digest>          netpol/main.go: kube-router's NetworkPolicy controller alone (netpol/go.mod);
#                                        <digest>: of netpol/'s files, so a change there builds a new binary
#   pause                                Kubernetes' own build/pause/linux/pause.c, static (gcc)
# and the two cluster images (no registry: built with buildah from scratch, exported as archives):
#   localhost/lockstep-e2e/pause:<version>, localhost/lockstep-e2e/coredns:<version>
# Binaries go into hack/kube's cache directory (printed on stdout), archives into
# ${LOCKSTEP_IMAGE_CACHE:-~/.cache/lockstep/images}/archives. Nothing already there is rebuilt.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
command -v go >/dev/null 2>&1 || export PATH="$PATH:/usr/local/go/bin"
out="$(bash "$here/../kube/build.sh")"
version="$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$here/kube/go.mod")"
coredns_version="$(awk '$1 == "github.com/coredns/coredns" { print $2; exit }' "$here/coredns/go.mod")"
netpol_binary="kube-router-netpol-$(cat "$here"/netpol/{go.mod,go.sum,main.go} | sha256sum | cut -c1-12)"
archives="${LOCKSTEP_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lockstep/images}/archives"
mkdir -p "$out" "$archives"

minor="${version#v1.}"; minor="${minor%%.*}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

build() {  # NAME MODULE_DIR PACKAGE LDFLAGS
  local name="$1" dir="$2" pkg="$3" flags="$4" start=$SECONDS
  [[ -x "$out/$name" ]] && return
  echo "building $name ($pkg) into $out" >&2
  (cd "$dir" && CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags="$flags" -o "$out/.$name.tmp" "$pkg")
  mv -f "$out/.$name.tmp" "$out/$name"
  echo "built $name in $((SECONDS - start)) s" >&2
}

build kube-scheduler "$here/kube" k8s.io/kubernetes/cmd/kube-scheduler "$ldflags"
build kubelet "$here/kube" k8s.io/kubernetes/cmd/kubelet "$ldflags"
build kube-proxy "$here/kube" k8s.io/kubernetes/cmd/kube-proxy "$ldflags"
build coredns "$here/coredns" . "-s -w"
build "$netpol_binary" "$here/netpol" . "-s -w"
if [[ ! -x "$out/pause" ]]; then
  src="$(cd "$here/kube" && go mod download -json k8s.io/kubernetes | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')"
  gcc -Os -static -DVERSION="$version-lockstep" -o "$out/.pause.tmp" "$src/build/pause/linux/pause.c"
  mv -f "$out/.pause.tmp" "$out/pause"
fi

image() {  # NAME TAG BINARY ENTRYPOINT_JSON: one static binary in an otherwise empty image
  local name="$1" tag="$2" binary="$3" entrypoint="$4" archive="$archives/$1.tar"
  local ref="localhost/lockstep-e2e/$name:$tag"
  [[ -s "$archive" ]] && return
  local ctr
  ctr="$(buildah from scratch)"
  buildah copy --quiet "$ctr" "$out/$binary" "/$binary" >/dev/null
  buildah config --entrypoint "$entrypoint" --user 65535:65535 "$ctr"
  buildah commit --quiet --rm "$ctr" "$ref" >/dev/null
  buildah push --quiet "$ref" "docker-archive:$archive.tmp:$ref"
  mv -f "$archive.tmp" "$archive"
  echo "image $ref -> $archive" >&2
}
image pause "$version" pause '["/pause"]'
image coredns "$coredns_version" coredns '["/coredns"]'
echo "$out"
