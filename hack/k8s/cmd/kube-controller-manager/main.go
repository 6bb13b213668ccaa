// Command kube-controller-manager is the upstream kube-controller-manager, built as a dependency of carve's test tooling
// so that tests run the real control plane without a container runtime.
package main

import (
	"os"
	_ "time/tzdata" // CronJob time zones need the embedded database on minimal hosts.

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() {
	os.Exit(cli.Run(app.NewControllerManagerCommand()))
}
