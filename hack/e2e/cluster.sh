#!/usr/bin/env bash
# A real single-node Kubernetes cluster on this machine, for tests/e2e. Needs root.
#   cluster.sh up     starts containerd (its own root, state and socket), etcd, kube-apiserver,
#                     kube-controller-manager, kube-scheduler, kube-proxy, a kubelet and the
#                     NetworkPolicy enforcer (kube-router's policy controller, netpol/main.go); imports
#                     the image archives (no registry); deploys CoreDNS; waits for the node and DNS.
#   cluster.sh down   stops everything it started and removes every trace: processes (by the pids it
#                     recorded), containers, mounts, the bridge, iptables rules and ipsets, its
#                     directories; restores the sysctls it set.
#   cluster.sh env    prints `export KUBECONFIG=... LOCKSTEP_E2E_CONTAINERD_SOCK=...` (its containerd).
# Network: the bridge lockstep0 (10.244.0.1/24) carries pods; services are 10.96.0.0/24 (kube-proxy,
# iptables mode); the API server and kubelet listen on 10.244.0.1 only. Pod traffic is dropped
# unless it stays on the bridge or goes to 10.244.0.1, so nothing reaches the LAN or the internet.
# NetworkPolicies are enforced in the filter table (bridged pod-to-pod traffic reaches it through
# br_netfilter: net.bridge.bridge-nf-call-iptables=1 for the run).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
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

kubectl_() { kubectl --kubeconfig "$kubeconfig" "$@"; }

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

network_up() {
  cat /proc/sys/net/ipv4/ip_forward > "$state/ip_forward.orig"
  ip link add "$bridge" type bridge
  ip addr add "$node_ip/24" dev "$bridge"
  ip link set "$bridge" up
  # Pods talk to each other on the bridge and to the node address; everything else is dropped.
  iptables -N LOCKSTEP-E2E-FWD
  iptables -A LOCKSTEP-E2E-FWD -i "$bridge" -o "$bridge" -j ACCEPT
  iptables -A LOCKSTEP-E2E-FWD -i "$bridge" -j DROP
  iptables -A LOCKSTEP-E2E-FWD -o "$bridge" -j DROP
  iptables -I FORWARD 1 -j LOCKSTEP-E2E-FWD
  iptables -N LOCKSTEP-E2E-IN
  iptables -A LOCKSTEP-E2E-IN -i "$bridge" -d "$node_ip" -j ACCEPT
  iptables -A LOCKSTEP-E2E-IN -i "$bridge" -j DROP
  iptables -I INPUT 1 -j LOCKSTEP-E2E-IN
  # The bridge plugin turns on forwarding (pod -> service -> pod is routed through the node).
  echo 1 > /proc/sys/net/ipv4/ip_forward
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
  cat /proc/sys/net/bridge/bridge-nf-call-iptables > "$state/bridge-nf-call-iptables.orig"
  echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables
  spawn netpol "$bins/kube-router-netpol-$(cat "$here"/netpol/{go.mod,go.sum,main.go} | sha256sum | cut -c1-12)" --kubeconfig "$kubeconfig" --node "$node" \
    --service-cidr "$service_cidr" --v 1
  # Ready once its jump into KUBE-ROUTER-FORWARD comes ahead of LOCKSTEP-E2E-FWD, which accepts
  # bridge-to-bridge traffic. Not necessarily first: kube-proxy prepends its own jumps (KUBE-FORWARD,
  # KUBE-SERVICES, ...: drops, rejects and established flows) whenever it finds them missing, so which of
  # the two is first depends on which synced last (a loaded machine once had kube-proxy's on top).
  wait_until 60 "NetworkPolicy enforcer (kube-router $netpol_version)" \
    bash -c 'iptables -S FORWARD | awk "/-j KUBE-ROUTER-FORWARD/ { r = NR } /-j LOCKSTEP-E2E-FWD/ { l = NR }
                                        END { exit !(r && (!l || r < l)) }"' ||
    { log "the NetworkPolicy enforcer is not running: $(tail -5 "$state/logs/netpol.log")"
      log "FORWARD: $(iptables -S FORWARD | tr '\n' ';')"; return 1; }
}

netpol_sweep() {  # what the enforcer leaves if it was killed before its own cleanup: chains, jumps, ipsets
  local chains chain hook rule
  chains="$(iptables -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-(ROUTER-|POD-FW-|NWPLCY-)/ { print $2 }')"
  for hook in INPUT FORWARD OUTPUT; do
    while rule="$(iptables -S "$hook" 2>/dev/null | grep -m1 -- "-j KUBE-ROUTER-")"; do
      eval "iptables ${rule/#-A/-D}" 2>/dev/null || break
    done
  done
  for chain in $chains; do iptables -F "$chain" 2>/dev/null || true; done
  for chain in $chains; do iptables -X "$chain" 2>/dev/null || true; done
  local set
  for set in $(ipset list -n 2>/dev/null | grep -E '^KUBE-(SRC|DST)-'); do ipset destroy "$set" 2>/dev/null || true; done
}

coredns_up() {
  sed -e "s|@IMAGE@|$coredns_ref|" -e "s|@DNS_IP@|$dns_ip|" "$here/coredns.yaml" | kubectl_ apply -f - >/dev/null
  wait_until 180 "CoreDNS ready" kubectl_ -n kube-system wait --for=condition=Available deploy/coredns --timeout=5s
}

up() {
  [[ "$(id -u)" == 0 ]] || { echo "cluster.sh: needs root (containerd, the bridge, iptables)" >&2; exit 1; }
  bash "$here/../system-deps.sh" check e2e
  if [[ -d "$state" ]]; then
    log "$state exists: tearing the previous cluster down first"
    down
  fi
  local start=$SECONDS
  bins="$(bash "$here/build.sh")"
  local k8s_version coredns_version
  k8s_version="$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$here/kube/go.mod")"
  coredns_version="$(awk '$1 == "github.com/coredns/coredns" { print $2; exit }' "$here/coredns/go.mod")"
  netpol_version="$(awk '$1 == "github.com/cloudnativelabs/kube-router/v2" { print $2; exit }' "$here/netpol/go.mod")"
  pause_ref="localhost/lockstep-e2e/pause:$k8s_version"
  coredns_ref="localhost/lockstep-e2e/coredns:$coredns_version"
  mkdir -p "$state/logs" "$state/pids"
  certs
  write_kubeconfig "$kubeconfig" admin
  netfilter_names > "$state/netfilter.before"
  network_up
  containerd_up
  control_plane_up
  kubelet_up
  netpol_up
  coredns_up
  log "cluster up in $((SECONDS - start)) s; export KUBECONFIG=$kubeconfig"
}

stop_pid() {  # NAME: SIGTERM, then SIGKILL after 15 s, for a process this script started
  local pid
  pid="$(cat "$state/pids/$1" 2>/dev/null)" || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null || true
}

down() {
  local start=$SECONDS
  [[ -d "$state" ]] || { log "nothing to tear down ($state does not exist)"; return 0; }
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
  # The enforcer removes its rules and ipsets on SIGTERM; netpol_sweep catches what a kill left.
  for name in netpol kube-proxy kube-scheduler kube-controller-manager kube-apiserver etcd containerd; do stop_pid "$name"; done
  netpol_sweep
  if [[ -f "$state/kube-proxy.yaml" ]]; then
    "$(bash "$here/../kube/build.sh" --check)/kube-proxy" --cleanup --config "$state/kube-proxy.yaml" >/dev/null 2>&1 || true
  fi
  # Mounts left by the kubelet (volumes), containerd (snapshots, shm) and the CNI (network namespaces).
  local mounts
  mounts="$(awk -v a="$state" -v b="$run" 'index($5, a) == 1 || index($5, b) == 1 { print $5 }' /proc/self/mountinfo | sort -r)"
  for m in $mounts; do umount -l "$m" 2>/dev/null || true; done
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    if ip netns exec "$ns" ip -br addr 2>/dev/null | grep -q "${pod_cidr%.*}\."; then ip netns delete "$ns" || true; fi
  done
  ip link delete "$bridge" 2>/dev/null || true
  for chain in FORWARD:LOCKSTEP-E2E-FWD INPUT:LOCKSTEP-E2E-IN; do
    while iptables -D "${chain%%:*}" -j "${chain#*:}" 2>/dev/null; do :; done  # every copy of the jump
    iptables -F "${chain#*:}" 2>/dev/null || true
    iptables -X "${chain#*:}" 2>/dev/null || true
  done
  # The kubelet's own chains (kube-proxy --cleanup leaves them): its localnet firewall and canaries.
  local table
  for table in filter nat mangle; do
    for hook in INPUT OUTPUT; do while iptables -t "$table" -D "$hook" -j KUBE-FIREWALL 2>/dev/null; do :; done; done
    for chain in KUBE-FIREWALL KUBE-KUBELET-CANARY KUBE-IPTABLES-HINT; do
      iptables -t "$table" -F "$chain" 2>/dev/null && iptables -t "$table" -X "$chain" 2>/dev/null || true
    done
  done
  [[ -f "$state/ip_forward.orig" ]] && cat "$state/ip_forward.orig" > /proc/sys/net/ipv4/ip_forward
  [[ -f "$state/bridge-nf-call-iptables.orig" ]] &&
    cat "$state/bridge-nf-call-iptables.orig" > /proc/sys/net/bridge/bridge-nf-call-iptables
  # The pod cgroups the kubelet created (cgroup v1: one tree per controller), innermost first.
  local dir
  for dir in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/*/kubepods.slice; do
    [[ -d "$dir" ]] && find "$dir" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  local left=()
  [[ -f "$state/netfilter.before" ]] &&
    mapfile -t left < <(netfilter_names | comm -13 "$state/netfilter.before" -)
  ip link show "$bridge" >/dev/null 2>&1 && left+=("the bridge $bridge")
  awk -v a="$state" -v b="$run" 'index($5, a) == 1 || index($5, b) == 1 { print "mount " $5 }' /proc/self/mountinfo |
    grep -q . && left+=("mounts under $state or $run")
  rm -rf "$state" "$run"
  log "cluster down in $((SECONDS - start)) s"
  if ((${#left[@]})); then
    log "left behind (not there before up): $(printf '%s; ' "${left[@]}")"
    return 1
  fi
}

netfilter_names() {  # the cluster's kind of iptables rules and chains and ipsets on this host, sorted
  { iptables-save 2>/dev/null | grep -E 'KUBE-|LOCKSTEP-E2E-|kube-router' | sed 's/ \[[0-9]*:[0-9]*\]$//' || true
    ipset list -n 2>/dev/null | grep -E '^KUBE-' | sed 's/^/ipset /' || true; } | sort
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) echo "export KUBECONFIG=$kubeconfig LOCKSTEP_E2E_CONTAINERD_SOCK=$sock" ;;
  *) echo "usage: cluster.sh up|down|env" >&2; exit 2 ;;
esac
