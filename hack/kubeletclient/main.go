// Command kubeletclient speaks the kubelet's side of the DRA kubelet-plugin protocol using the
// upstream k8s.io/kubelet API packages. It exists to prove that carve's Python plugin is wire
// compatible with the real kubelet independently of carve's own generated stubs: if carve's
// .proto files drifted from upstream (package, service, field numbers), this client would fail.
//
// Usage:
//
//	kubeletclient -registration /path/<driver>-reg.sock -driver mig.carve.dev \
//	    -claim <namespace>/<name>/<uid> [-claim ...] [-api v1|v1beta1] [-timeout 45s]
//
// It prints one JSON document on stdout and exits non-zero when the plugin's answer violates the
// contract the kubelet checks.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	drav1 "k8s.io/kubelet/pkg/apis/dra/v1"
	drav1beta1 "k8s.io/kubelet/pkg/apis/dra/v1beta1"
	registration "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

type claimList []claimRef

type claimRef struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
}

func (c *claimList) String() string { return fmt.Sprint(*c) }

func (c *claimList) Set(value string) error {
	parts := strings.Split(value, "/")
	if len(parts) != 3 || parts[2] == "" {
		return fmt.Errorf("claim %q: want <namespace>/<name>/<uid>", value)
	}
	*c = append(*c, claimRef{Namespace: parts[0], Name: parts[1], UID: parts[2]})
	return nil
}

type pluginInfo struct {
	Type              string   `json:"type"`
	Name              string   `json:"name"`
	Endpoint          string   `json:"endpoint"`
	SupportedVersions []string `json:"supported_versions"`
}

type device struct {
	RequestNames []string `json:"request_names"`
	PoolName     string   `json:"pool_name"`
	DeviceName   string   `json:"device_name"`
	CDIDeviceIDs []string `json:"cdi_device_ids"`
	ShareID      *string  `json:"share_id"`
}

type prepareResult struct {
	Devices []device `json:"devices"`
	Error   string   `json:"error"`
}

type unprepareResult struct {
	Error string `json:"error"`
}

type report struct {
	Info      pluginInfo                 `json:"info"`
	API       string                     `json:"api"`
	Prepare   map[string]prepareResult   `json:"prepare"`
	Unprepare map[string]unprepareResult `json:"unprepare"`
}

func main() {
	regSocket := flag.String("registration", "", "path of the plugin's registration socket")
	driver := flag.String("driver", "", "expected driver name")
	api := flag.String("api", "v1", "DRAPlugin API version to call: v1 or v1beta1")
	timeout := flag.Duration("timeout", 45*time.Second, "timeout of each call (the kubelet uses 45s)")
	var claims claimList
	flag.Var(&claims, "claim", "claim as <namespace>/<name>/<uid>; repeatable")
	flag.Parse()

	out, err := run(*regSocket, *driver, *api, *timeout, claims)
	if out != nil {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		_ = enc.Encode(out)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubeletclient:", err)
		os.Exit(1)
	}
}

func dial(socket string) (*grpc.ClientConn, error) {
	return grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

func run(regSocket, driver, api string, timeout time.Duration, claims claimList) (*report, error) {
	if regSocket == "" || driver == "" {
		return nil, errors.New("-registration and -driver are required")
	}
	if api != "v1" && api != "v1beta1" {
		return nil, fmt.Errorf("-api %q: want v1 or v1beta1", api)
	}
	regConn, err := dial(regSocket)
	if err != nil {
		return nil, fmt.Errorf("dial registration socket: %w", err)
	}
	defer regConn.Close()
	reg := registration.NewRegistrationClient(regConn)

	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	info, err := reg.GetInfo(ctx, &registration.InfoRequest{})
	if err != nil {
		return nil, fmt.Errorf("GetInfo: %w", err)
	}
	out := &report{
		API: api,
		Info: pluginInfo{
			Type:              info.GetType(),
			Name:              info.GetName(),
			Endpoint:          info.GetEndpoint(),
			SupportedVersions: info.GetSupportedVersions(),
		},
	}
	if problem := checkInfo(info, driver, api); problem != "" {
		_, _ = reg.NotifyRegistrationStatus(ctx, &registration.RegistrationStatus{Error: problem})
		return out, errors.New(problem)
	}
	if _, err := reg.NotifyRegistrationStatus(ctx, &registration.RegistrationStatus{PluginRegistered: true}); err != nil {
		return out, fmt.Errorf("NotifyRegistrationStatus: %w", err)
	}

	draConn, err := dial(info.GetEndpoint())
	if err != nil {
		return out, fmt.Errorf("dial DRA endpoint: %w", err)
	}
	defer draConn.Close()
	if api == "v1" {
		err = callV1(draConn, timeout, claims, out)
	} else {
		err = callV1beta1(draConn, timeout, claims, out)
	}
	if err != nil {
		return out, err
	}
	for _, c := range claims {
		if _, ok := out.Prepare[c.UID]; !ok {
			return out, fmt.Errorf("prepare response has no entry for claim %s", c.UID)
		}
		if _, ok := out.Unprepare[c.UID]; !ok {
			return out, fmt.Errorf("unprepare response has no entry for claim %s", c.UID)
		}
	}
	return out, nil
}

// checkInfo applies the checks the kubelet applies before it accepts a DRA plugin.
func checkInfo(info *registration.PluginInfo, driver, api string) string {
	if info.GetType() != registration.DRAPlugin {
		return fmt.Sprintf("plugin type %q, want %q", info.GetType(), registration.DRAPlugin)
	}
	if info.GetName() != driver {
		return fmt.Sprintf("plugin name %q, want %q", info.GetName(), driver)
	}
	if !filepath.IsAbs(info.GetEndpoint()) {
		return fmt.Sprintf("endpoint %q is not an absolute path", info.GetEndpoint())
	}
	versions := info.GetSupportedVersions()
	if len(versions) == 0 || versions[0] != drav1.DRAPluginService {
		return fmt.Sprintf("supported versions %v must list %q first", versions, drav1.DRAPluginService)
	}
	want := drav1.DRAPluginService
	if api == "v1beta1" {
		want = drav1beta1.DRAPluginService
	}
	if !slices.Contains(versions, want) {
		return fmt.Sprintf("supported versions %v lack %q", versions, want)
	}
	return ""
}

func callV1(conn *grpc.ClientConn, timeout time.Duration, claims claimList, out *report) error {
	client := drav1.NewDRAPluginClient(conn)
	var wire []*drav1.Claim
	for _, c := range claims {
		wire = append(wire, &drav1.Claim{Namespace: c.Namespace, Name: c.Name, Uid: c.UID})
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	prep, err := client.NodePrepareResources(ctx, &drav1.NodePrepareResourcesRequest{Claims: wire})
	if err != nil {
		return fmt.Errorf("NodePrepareResources: %w", err)
	}
	out.Prepare = map[string]prepareResult{}
	for uid, r := range prep.GetClaims() {
		res := prepareResult{Error: r.GetError(), Devices: []device{}}
		for _, d := range r.GetDevices() {
			res.Devices = append(res.Devices, device{
				RequestNames: nonNil(d.GetRequestNames()),
				PoolName:     d.GetPoolName(),
				DeviceName:   d.GetDeviceName(),
				CDIDeviceIDs: nonNil(d.GetCdiDeviceIds()),
				ShareID:      d.ShareId,
			})
		}
		out.Prepare[uid] = res
	}
	unprep, err := client.NodeUnprepareResources(ctx, &drav1.NodeUnprepareResourcesRequest{Claims: wire})
	if err != nil {
		return fmt.Errorf("NodeUnprepareResources: %w", err)
	}
	out.Unprepare = map[string]unprepareResult{}
	for uid, r := range unprep.GetClaims() {
		out.Unprepare[uid] = unprepareResult{Error: r.GetError()}
	}
	return nil
}

func callV1beta1(conn *grpc.ClientConn, timeout time.Duration, claims claimList, out *report) error {
	client := drav1beta1.NewDRAPluginClient(conn)
	var wire []*drav1beta1.Claim
	for _, c := range claims {
		wire = append(wire, &drav1beta1.Claim{Namespace: c.Namespace, Name: c.Name, Uid: c.UID})
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	prep, err := client.NodePrepareResources(ctx, &drav1beta1.NodePrepareResourcesRequest{Claims: wire})
	if err != nil {
		return fmt.Errorf("NodePrepareResources: %w", err)
	}
	out.Prepare = map[string]prepareResult{}
	for uid, r := range prep.GetClaims() {
		res := prepareResult{Error: r.GetError(), Devices: []device{}}
		for _, d := range r.GetDevices() {
			res.Devices = append(res.Devices, device{
				RequestNames: nonNil(d.GetRequestNames()),
				PoolName:     d.GetPoolName(),
				DeviceName:   d.GetDeviceName(),
				CDIDeviceIDs: nonNil(d.GetCdiDeviceIds()),
			})
		}
		out.Prepare[uid] = res
	}
	unprep, err := client.NodeUnprepareResources(ctx, &drav1beta1.NodeUnprepareResourcesRequest{Claims: wire})
	if err != nil {
		return fmt.Errorf("NodeUnprepareResources: %w", err)
	}
	out.Unprepare = map[string]unprepareResult{}
	for uid, r := range unprep.GetClaims() {
		out.Unprepare[uid] = unprepareResult{Error: r.GetError()}
	}
	return nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
