// The NetworkPolicy enforcer of the e2e cluster: kube-router's network policy controller (iptables
// and ipset; the bridge CNI enforces nothing) run alone as a host process, without kube-router's
// routing (BGP) and service proxy. ../cluster.sh starts it after the node is registered and stops it
// with SIGTERM; it then removes every chain, rule and ipset it made. Nothing here is imported by the
// Python project.
//
// kube-network-policies (what kind ships) was the first choice; it needs the nftables `queue`
// expression (CONFIG_NFT_QUEUE), which the kernel of the machines this runs on lacks.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/cloudnativelabs/kube-router/v2/pkg/controllers/netpol"
	"github.com/cloudnativelabs/kube-router/v2/pkg/healthcheck"
	"github.com/cloudnativelabs/kube-router/v2/pkg/options"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the cluster (required)")
	node := flag.String("node", "", "name of the Node whose pods are protected (required)")
	serviceCIDR := flag.String("service-cidr", "10.96.0.0/12", "the cluster's Service IP range")
	syncPeriod := flag.Duration("sync-period", time.Minute, "full resync period (events sync at once)")
	klog.InitFlags(nil)
	flag.Parse()
	if *kubeconfig == "" || *node == "" {
		fmt.Fprintf(os.Stderr, "netpol: --kubeconfig (%q) and --node (%q) are required\n", *kubeconfig, *node)
		os.Exit(2)
	}
	if err := run(*kubeconfig, *node, *serviceCIDR, *syncPeriod); err != nil {
		fmt.Fprintf(os.Stderr, "netpol: %v\n", err)
		os.Exit(1)
	}
}

func run(kubeconfig, node, serviceCIDR string, syncPeriod time.Duration) error {
	restConfig, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("--kubeconfig %s: %w", kubeconfig, err)
	}
	client, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return err
	}
	config := options.NewKubeRouterConfig()
	config.RunFirewall = true
	config.EnableIPv4 = true
	config.HostnameOverride = node
	config.ClusterIPCIDRs = []string{serviceCIDR}
	config.IPTablesSyncPeriod = syncPeriod

	stop := make(chan struct{})
	factory := informers.NewSharedInformerFactory(client, 0)
	pods := factory.Core().V1().Pods().Informer()
	namespaces := factory.Core().V1().Namespaces().Informer()
	policies := factory.Networking().V1().NetworkPolicies().Informer()
	factory.Start(stop)
	for kind, synced := range factory.WaitForCacheSync(stop) {
		if !synced {
			return fmt.Errorf("the informer of %v did not sync", kind)
		}
	}

	iptablesHandlers, ipsetHandlers, err := netpol.NewIPTablesHandlers(config)
	if err != nil {
		return err
	}
	npc, err := netpol.NewNetworkPolicyController(client, config, pods, policies, namespaces,
		&sync.Mutex{}, iptablesHandlers, ipsetHandlers)
	if err != nil {
		return fmt.Errorf("the network policy controller: %w", err)
	}
	if _, err := pods.AddEventHandler(npc.PodEventHandler); err != nil {
		return err
	}
	if _, err := namespaces.AddEventHandler(npc.NamespaceEventHandler); err != nil {
		return err
	}
	if _, err := policies.AddEventHandler(npc.NetworkPolicyEventHandler); err != nil {
		return err
	}

	// The controller reports a heartbeat on every sync and blocks until someone reads it.
	heartbeats := make(chan *healthcheck.ControllerHeartbeat)
	go func() {
		for range heartbeats {
		}
	}()
	var wg sync.WaitGroup
	wg.Add(1)
	go npc.Run(heartbeats, stop, &wg)
	klog.Infof("enforcing NetworkPolicies for the pods of node %s", node)

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	got := <-signals
	klog.Infof("%v: stopping, then removing the iptables rules and ipsets", got)
	close(stop)
	wg.Wait()
	// Cleanup on a new controller: v2.1.0's Cleanup appends its iptables-save to the buffer the last
	// sync left filled and restores both, which doubled every other rule of the filter table.
	iptablesHandlers, ipsetHandlers, err = netpol.NewIPTablesHandlers(config)
	if err != nil {
		return err
	}
	fresh, err := netpol.NewNetworkPolicyController(client, config, pods, policies, namespaces,
		&sync.Mutex{}, iptablesHandlers, ipsetHandlers)
	if err != nil {
		return fmt.Errorf("the network policy controller for the cleanup: %w", err)
	}
	fresh.Cleanup()
	return nil
}
