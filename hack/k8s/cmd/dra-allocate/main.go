// Command dra-allocate runs kube-scheduler's structured allocator
// (k8s.io/dynamic-resource-allocation/structured, the library the dynamicresources plugin calls)
// over one node's ResourceSlices, for a sequence of claims allocated and released one at a time.
// It is carve's "real baseline": what a user of partitionable devices gets from the scheduler.
//
// stdin: {"node": Node, "slices": [ResourceSlice], "classes": [DeviceClass],
//
//	"steps": [{"allocate": ResourceClaim} | {"release": "claim-name"}]}
//
// stdout: one JSON object per step, in order:
//
//	{"step": i, "op": "allocate", "claim": name, "status": "allocated", "devices": [...]}
//	{"step": i, "op": "allocate", "claim": name, "status": "unschedulable", "message": ...}
//	{"step": i, "op": "allocate", "claim": name, "status": "error", "message": ...}
//	{"step": i, "op": "release", "claim": name, "status": "released" | "error"}
//
// Feature gates default to kube-scheduler v1.37's; --feature-gates takes the scheduler's syntax.
// Every step builds a fresh allocator from the allocated state, as the plugin's PreFilter does
// per pod: already-allocated claims become AllocatedDevices (or shared device IDs and consumed
// capacity with DRAConsumableCapacity), and the allocator derives consumed counters from them.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/kubernetes/pkg/api/legacyscheme"
	_ "k8s.io/kubernetes/pkg/apis/resource/install" // the apiserver's resource.k8s.io defaulting
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/feature"
	"k8s.io/utils/ptr"
)

type input struct {
	Node    v1.Node                      `json:"node"`
	Slices  []*resourceapi.ResourceSlice `json:"slices"`
	Classes []*resourceapi.DeviceClass   `json:"classes"`
	Steps   []step                       `json:"steps"`
}

type step struct {
	Allocate *resourceapi.ResourceClaim `json:"allocate,omitempty"`
	Release  string                     `json:"release,omitempty"`
}

type output struct {
	Step    int                                         `json:"step"`
	Op      string                                      `json:"op"`
	Claim   string                                      `json:"claim"`
	Status  string                                      `json:"status"`
	Devices []resourceapi.DeviceRequestAllocationResult `json:"devices,omitempty"`
	Message string                                      `json:"message,omitempty"`
}

type classLister map[string]*resourceapi.DeviceClass

func (l classLister) List() ([]*resourceapi.DeviceClass, error) {
	out := make([]*resourceapi.DeviceClass, 0, len(l))
	for _, c := range l {
		out = append(out, c)
	}
	return out, nil
}

func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	if c, ok := l[name]; ok {
		return c, nil
	}
	return nil, apierrors.NewNotFound(resourceapi.Resource("deviceclasses"), name)
}

// allocatedState mirrors the scheduler's claimTracker.GatherAllocatedState (and, without
// DRAConsumableCapacity, ListAllAllocatedDevices) over the claims this run holds allocated.
// The per-result logic is dynamicresources.foreachAllocatedDevice's (unexported there).
func allocatedState(claims []*resourceapi.ResourceClaim, consumable bool) structured.AllocatedState {
	s := structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	for _, claim := range claims {
		if claim.Status.Allocation == nil {
			continue
		}
		for _, r := range claim.Status.Allocation.Devices.Results {
			if ptr.Deref(r.AdminAccess, false) {
				continue
			}
			id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
			if consumable && r.ShareID != nil {
				s.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, r.ShareID))
				if r.ConsumedCapacity != nil {
					s.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(id, r.ConsumedCapacity))
				}
				continue
			}
			s.AllocatedDevices.Insert(id)
		}
	}
	return s
}

func run(ctx context.Context, in input, emit func(output)) error {
	fts := feature.NewSchedulerFeaturesFromGates(utilfeature.DefaultFeatureGate)
	allocFeatures := dynamicresources.AllocatorFeatures(fts)
	// Same CEL cache setup as the plugin's New.
	celCache := cel.NewCache(10, cel.Features{
		EnableConsumableCapacity: fts.EnableDRAConsumableCapacity,
		EnableListTypeAttributes: fts.EnableDRAListTypeAttributes,
	})
	// The scheduler only ever sees objects the apiserver has defaulted (allocationMode
	// ExactCount, count 1, toleration operators, ...); apply the same defaulting functions.
	for _, s := range in.Slices {
		legacyscheme.Scheme.Default(s)
	}
	classes := classLister{}
	for _, c := range in.Classes {
		legacyscheme.Scheme.Default(c)
		classes[c.Name] = c
	}
	var held []*resourceapi.ResourceClaim
	for i, st := range in.Steps {
		switch {
		case st.Allocate != nil:
			claim := st.Allocate.DeepCopy()
			legacyscheme.Scheme.Default(claim)
			out := output{Step: i, Op: "allocate", Claim: claim.Name}
			if claim.UID == "" {
				claim.UID = types.UID("uid-" + claim.Namespace + "-" + claim.Name)
			}
			state := allocatedState(held, fts.EnableDRAConsumableCapacity)
			allocator, err := structured.NewAllocator(ctx, allocFeatures, state, classes, in.Slices, celCache)
			if err != nil {
				out.Status, out.Message = "error", err.Error()
				emit(out)
				continue
			}
			results, err := allocator.Allocate(ctx, &in.Node, []*resourceapi.ResourceClaim{claim})
			switch {
			case err != nil && errors.Is(err, structured.ErrFailedAllocationOnNode):
				out.Status, out.Message = "unschedulable", err.Error()
			case err != nil:
				out.Status, out.Message = "error", err.Error()
			case len(results) == 0:
				out.Status, out.Message = "unschedulable", "cannot allocate all claims"
			default:
				claim.Status.Allocation = &results[0]
				held = append(held, claim)
				out.Status, out.Devices = "allocated", results[0].Devices.Results
			}
			emit(out)
		case st.Release != "":
			out := output{Step: i, Op: "release", Claim: st.Release, Status: "error",
				Message: "claim not allocated"}
			for j, c := range held {
				if c.Name == st.Release {
					held = append(held[:j], held[j+1:]...)
					out.Status, out.Message = "released", ""
					break
				}
			}
			emit(out)
		default:
			return fmt.Errorf("step %d: neither allocate nor release", i)
		}
	}
	return nil
}

func main() {
	gates := flag.String("feature-gates", "", "kube-scheduler --feature-gates syntax, e.g. DRAConsumableCapacity=true")
	flag.Parse()
	if *gates != "" {
		if err := utilfeature.DefaultMutableFeatureGate.Set(*gates); err != nil {
			fmt.Fprintln(os.Stderr, "dra-allocate: --feature-gates:", err)
			os.Exit(2)
		}
	}
	_ = features.DRAPartitionableDevices // the gates above are registered by pkg/features
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dra-allocate: read stdin:", err)
		os.Exit(2)
	}
	var in input
	if err := json.Unmarshal(data, &in); err != nil {
		fmt.Fprintln(os.Stderr, "dra-allocate: parse input:", err)
		os.Exit(2)
	}
	enc := json.NewEncoder(os.Stdout)
	err = run(context.Background(), in, func(o output) {
		if err := enc.Encode(o); err != nil {
			fmt.Fprintln(os.Stderr, "dra-allocate: write:", err)
			os.Exit(2)
		}
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "dra-allocate:", err)
		os.Exit(2)
	}
}
