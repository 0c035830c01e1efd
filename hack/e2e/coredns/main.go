// CoreDNS with only the plugins the e2e cluster's Corefile (../coredns.yaml) uses: the same server
// as upstream's main package, without the cloud and other plugins that made the build take 30 min
// on a 2-core machine. Nothing here is imported by the Python project.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	// The plugin chain's order, as upstream's plugin.cfg has these five.
	dnsserver.Directives = []string{"ready", "health", "errors", "cache", "kubernetes"}
}

func main() { coremain.Run() }
