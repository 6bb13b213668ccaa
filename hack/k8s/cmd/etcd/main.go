// Command etcd is the etcd server at the version k8s.io/kubernetes itself requires, so the
// apiserver's etcd client and the server come from one consistent module graph.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
