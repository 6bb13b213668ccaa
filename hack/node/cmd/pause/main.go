// Command pause is the entry point of carve's local sandbox image (carve.local/pause): the
// process that holds a pod's namespaces open while its containers come and go. It does
// nothing but wait: SIGTERM or SIGINT ends it with status 0, and as the pod's PID 1 it reaps
// every orphan re-parented to it, so exited processes never pile up as zombies.
//
// It is carve's own, built statically (CGO_ENABLED=0) so the image needs no libc; there is
// no registry here to pull the upstream pause image from.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		fmt.Println("carve pause")
		return
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		if sig == syscall.SIGCHLD {
			reap()
			continue
		}
		fmt.Fprintf(os.Stderr, "pause: %v, exiting\n", sig)
		os.Exit(0)
	}
}

// reap collects every child that has exited; several SIGCHLDs may have merged into one.
func reap() {
	for {
		var status syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}
