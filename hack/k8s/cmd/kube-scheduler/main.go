// Command kube-scheduler is the upstream kube-scheduler, built as a dependency of carve's test tooling
// so that tests run the real control plane without a container runtime.
package main

import (
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"
	"os"
)

func main() {
	os.Exit(cli.Run(app.NewSchedulerCommand()))
}
