"""What carve's controller and its kubelet plugins agree on, derived from one driver name.

The controller and the node never talk to each other directly: they meet on API objects. The
controller puts its finalizer and gate on claims and pods and reads the node's finalizer to know
that a MIG instance is gone (DESIGN invariant 4); the node publishes attributes that the
controller reads back to rebuild the GPU's geometry. Every one of those names is built here from
the driver name, so a cluster that runs carve as `mig.example.com` gets a consistent set on both
sides. A name that is built anywhere else is a bug waiting for the first renamed install.

Device, counter-set and counter names live in `driver.naming` (they encode placements, not API
agreements); everything else is in this module.

Deriving the whole-GPU class: the MIG class is the driver name itself; the whole-GPU class
replaces a leading `mig.` label with `gpu.` (`mig.carve.dev` -> `gpu.carve.dev`) and otherwise
prefixes `gpu.` (`carve.example.com` -> `gpu.carve.example.com`). Per-profile classes end in
`.<driver>` (`mig-1g-10gb.mig.carve.dev`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "ATTRIBUTES",
    "CONFIG_API_GROUP",
    "CONTRACT_SKEW",
    "CONTRACT_VERSION",
    "DEFAULT_CONTRACT",
    "DEFAULT_DRIVER_NAME",
    "DEFAULT_MIG_RESOURCE_PREFIX",
    "EXTENDED_RESOURCE_CLAIM_ANNOTATION",
    "IDENTITY_ATTRIBUTES",
    "IMPLICIT_EXTENDED_RESOURCE_PREFIX",
    "NUMA_NODE_ATTRIBUTE",
    "PCIE_ROOT_ATTRIBUTE",
    "PCI_BUS_ID_ATTRIBUTE",
    "UNVERSIONED",
    "Attr",
    "Contract",
    "ContractSkewError",
    "contract_skew",
    "parse_contract_version",
]

DEFAULT_DRIVER_NAME = "mig.carve.dev"
"""The driver name of a default install; every other name below derives from the one in use."""

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_MAX_DRIVER_NAME = 63  # resource/v1: a driver name is a DNS subdomain of at most 63 characters
_FINALIZER_NAME_MAX = 63  # the part after '/' of a finalizer is a qualified name's name part
_NODE_FINALIZER_PREFIX = "node-"


class Attr:
    """Device attributes carve publishes under its driver domain (the NVIDIA DRA driver's names
    where one exists, so selectors port by changing only the domain). Plain strings, not an
    enum, because they are dictionary keys of API objects that JSON and YAML dump as they are."""

    TYPE: Final = "type"
    PROFILE: Final = "profile"
    PROFILE_ID: Final = "profileId"
    PROFILE_INDEX: Final = "profileIndex"
    MAX_INSTANCES: Final = "maxInstances"
    PLACEMENT_START: Final = "placementStart"
    PLACEMENT_SIZE: Final = "placementSize"
    PARENT_UUID: Final = "parentUUID"
    UUID: Final = "uuid"
    PRODUCT_NAME: Final = "productName"
    ARCHITECTURE: Final = "architecture"
    CUDA_COMPUTE_CAPABILITY: Final = "cudaComputeCapability"
    DRIVER_VERSION: Final = "driverVersion"
    BRAND: Final = "brand"
    CUDA_DRIVER_VERSION: Final = "cudaDriverVersion"
    ADDRESSING_MODE: Final = "addressingMode"


ATTRIBUTES: tuple[str, ...] = tuple(
    v for k, v in vars(Attr).items() if k.isupper() and isinstance(v, str)
)
"""Every attribute name above, in declaration order."""

CONFIG_API_GROUP = "mig.carve.dev"
"""The API group of carve's opaque config types (`mig.carve.dev/v1alpha1`, `MigDeviceConfig`).

A schema name, like a CRD's group: it stays the same whatever the driver name, so a config
written for one install works in another. Only `config[].opaque.driver` follows the driver."""

DEFAULT_MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
"""Per-profile classes name the extended resource `<prefix><profile>` (the chart's
`deviceClasses.extendedResources.migPrefix`): the NVIDIA device plugin's names, so pods written
for it (`nvidia.com/mig-1g.10gb: 1`) work unchanged."""

IMPLICIT_EXTENDED_RESOURCE_PREFIX = "deviceclass.resource.kubernetes.io/"
"""Kubernetes maps `<this><class name>` to every DeviceClass, whether or not the class names an
extended resource of its own (k8s.io/dynamic-resource-allocation extendedresourcecache)."""

EXTENDED_RESOURCE_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
"""kube-scheduler marks the claim it creates for a pod's extended resources with this
annotation set to "true" (resource.k8s.io/v1 `ExtendedResourceClaimAnnotation`)."""

PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
"""The standard (Kubernetes-domain) attribute for a device's PCI address (`0000:3b:00.0`)."""

PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"
"""The standard attribute for the PCIe root complex above a device (`pci0000:3a`), the one that
lines a GPU up with a NIC through `matchAttribute` (derived as `driver.pcie` explains)."""

NUMA_NODE_ATTRIBUTE = "resource.kubernetes.io/numaNode"
"""The NUMA node of a device (an int), as NVIDIA's driver publishes it."""

IDENTITY_ATTRIBUTES = frozenset(
    {
        Attr.UUID,
        Attr.PARENT_UUID,
        Attr.PLACEMENT_START,
        "pciBusID",
        "pcieRoot",
        "numaNode",
    }
)
"""Attribute names (without domain) that differ between GPUs of one kind, or between placements
of one profile. The controller groups GPUs whose devices agree on everything else; a selector
that reads one of these is evaluated per GPU. `pcieRoot` and `numaNode` (standard attributes)
say where a GPU sits, which GPUs of one kind need not share."""


CONTRACT_VERSION = 1
"""The version of everything in this module and of what the names in it label: the
ResourceSlice layout (devices, attributes, counters, `driver.resourceslice`), claim status the
node writes, finalizers, gate, annotations. The controller declares it on its leader Lease and
each plugin on its ResourceSlices (`Contract.contract_version_key`); the bump rules are in
docs/architecture.md ("Version skew"). Read it through this module at call time
(`driver.contract.CONTRACT_VERSION`), never copied into a constant of another module, so that
a test can bump it."""

CONTRACT_SKEW = 1
"""How far apart the controller's and a plugin's contract versions may be, in either direction
(an upgrade or a rollback of one release at a time)."""

UNVERSIONED = 1
"""The version of a publisher that declares none: every release before the declaration was
added spoke contract 1, so a slice or Lease without it is read as 1, never refused."""


class ContractSkewError(ValueError):
    """A declared contract version that cannot be read at all (not a positive integer)."""


def parse_contract_version(value: object, *, where: str) -> int:
    """The contract version a label or annotation declares; `None` (absent) is `UNVERSIONED`.

    Raises ContractSkewError naming `where` for anything but a positive decimal integer."""
    if value is None:
        return UNVERSIONED
    text = value if isinstance(value, str) else None
    if text is None or not text.isdigit() or int(text) < 1:
        raise ContractSkewError(
            f"{where} declares contract version {value!r}, not a positive integer (e.g. "
            f'"{CONTRACT_VERSION}")'
        )
    return int(text)


def contract_skew(theirs: int, *, ours: int | None = None, other: str, me: str) -> str:
    """ "" when contract version `theirs` may work with `ours` (this build's, read now), else
    why not, naming both sides (`other` and `me`, e.g. "the plugin on node n1")."""
    mine = CONTRACT_VERSION if ours is None else ours
    if abs(theirs - mine) <= CONTRACT_SKEW:
        return ""
    newer = "newer" if theirs > mine else "older"
    return (
        f"{other} speaks carve contract version {theirs}, {newer} than {me} ({mine}) by more "
        f"than {CONTRACT_SKEW}: they are at most {CONTRACT_SKEW} version apart during an "
        "upgrade; upgrade or roll back one of them (docs/architecture.md, Version skew)"
    )


HANDED_TO_SCHEDULER = "kube-scheduler"
"""The value of `Contract.allocator_annotation` on a claim handed to kube-scheduler."""


@dataclass(frozen=True)
class Contract:
    """Every API-level name of one carve installation. Build it once per process from the
    `--driver-name` flag and hand it to whatever writes or reads these names."""

    driver: str = DEFAULT_DRIVER_NAME

    def __post_init__(self) -> None:
        if len(self.driver) > _MAX_DRIVER_NAME or not _DNS_SUBDOMAIN.fullmatch(self.driver):
            raise ValueError(
                f"driver name {self.driver!r} is not a DNS subdomain of at most "
                f"{_MAX_DRIVER_NAME} characters (lower-case labels separated by dots, e.g. "
                f"{DEFAULT_DRIVER_NAME})"
            )

    # -- controller-owned names ----------------------------------------------------------------

    @property
    def allocation_finalizer(self) -> str:
        """On every claim the controller allocated, until the allocation is cleared."""
        return f"{self.driver}/allocation"

    @property
    def scheduling_gate(self) -> str:
        """Added at admission to pods using carve classes; removed once their claims are placed."""
        return f"{self.driver}/placement"

    @property
    def placed_condition(self) -> str:
        """Pod condition: True once carve allocated the pod's claims, False with why it waits."""
        return f"{self.driver}/Placed"

    @property
    def movable_annotation(self) -> str:
        """On a pod, with the value "true": its user opts it in as movable, so carve does not
        mark it `cluster-autoscaler.kubernetes.io/safe-to-evict: "false"` when it is placed
        (docs/guide/autoscaling.md)."""
        return f"{self.driver}/movable"

    @property
    def event_source(self) -> str:
        """`reportingController` of the controller's events."""
        return f"{self.driver}/controller"

    @property
    def allocator_annotation(self) -> str:
        """On a claim the controller handed to kube-scheduler (native fallback), with the value
        `HANDED_TO_SCHEDULER`: the one mark that lets kube-scheduler allocate a claim of carve's
        classes (the chart's carve-sole-allocator policy), and that only the controller sets."""
        return f"{self.driver}/allocator"

    @property
    def contract_version_key(self) -> str:
        """Label on every ResourceSlice a plugin publishes and annotation on the controller's
        leader Lease: the `CONTRACT_VERSION` its writer speaks."""
        return f"{self.driver}/contract-version"

    # -- node-owned names ----------------------------------------------------------------------

    def node_finalizer(self, node: str) -> str:
        """The finalizer a node's plugin keeps on a claim while its MIG instance exists there.

        A long node name is shortened with a hash of the full name so the name part stays
        within the 63-character limit and two long names still differ."""
        name = f"{_NODE_FINALIZER_PREFIX}{node}"
        if len(name) > _FINALIZER_NAME_MAX:
            digest = hashlib.sha256(node.encode()).hexdigest()[:10]
            name = f"{name[: _FINALIZER_NAME_MAX - 11].rstrip('.-')}-{digest}"
        return f"{self.driver}/{name}"

    @property
    def health_taint_key(self) -> str:
        """Device taint a node's plugin puts on the devices of a GPU it finds unhealthy (XID or
        ECC errors); claims tolerate it by this key."""
        return f"{self.driver}/gpu-unhealthy"

    @property
    def unresponsive_taint_key(self) -> str:
        """Device taint a node's plugin puts on the devices of a GPU whose NVML call overran its
        deadline (`NoSchedule`; `NoExecute` on a device whose claim is stuck on it), until the
        call returns."""
        return f"{self.driver}/gpu-unresponsive"

    @property
    def carved_condition(self) -> str:
        """Device condition (in a claim's `status.devices`) and binding condition: the node
        carved the device's MIG instance, so kube-scheduler may bind the pod."""
        return f"{self.driver}/Carved"

    @property
    def carve_failed_condition(self) -> str:
        """Binding failure condition: the node could not carve the device; kube-scheduler gives
        up on the allocation and carve's controller places the claim again."""
        return f"{self.driver}/CarveFailed"

    @property
    def carve_failed_taint_key(self) -> str:
        """Device taint (`NoSchedule`) a node's plugin puts on a GPU for a while after NVML
        refused to carve on it, so that the claim is placed again elsewhere."""
        return f"{self.driver}/carve-failed"

    @property
    def foreign_instance_taint_key(self) -> str:
        """Device taint a node's plugin puts on the devices a MIG instance carve did not create
        blocks (`NoSchedule`; `NoExecute` on one a claim was allocated and could not get)."""
        return f"{self.driver}/foreign-instance"

    def node_field_manager(self, node: str) -> str:
        """The server-side-apply field manager of a node's plugin on claims' `status.devices`
        (per node: a claim allocated again elsewhere is written by another node's plugin)."""
        return f"{self.driver}/node-{node}"[:128]

    def is_node_finalizer(self, finalizer: str) -> bool:
        """Whether `finalizer` is some node's (the controller waits for all of them to go)."""
        return finalizer.startswith(f"{self.driver}/{_NODE_FINALIZER_PREFIX}")

    # -- classes and attributes ----------------------------------------------------------------

    @property
    def mig_class(self) -> str:
        return self.driver

    @property
    def gpu_class(self) -> str:
        head, _, rest = self.driver.partition(".")
        return f"gpu.{rest}" if head == "mig" and rest else f"gpu.{self.driver}"

    @property
    def default_classes(self) -> frozenset[str]:
        return frozenset({self.mig_class, self.gpu_class})

    @property
    def profile_class_suffix(self) -> str:
        """Any class named `<x>.<driver>` is carve's too (per-profile classes)."""
        return f".{self.driver}"

    def profile_class(self, profile: str) -> str:
        """The per-profile class the chart renders: `1g.10gb` -> `mig-1g-10gb.<driver>`."""
        return f"mig-{profile.replace('.', '-')}{self.profile_class_suffix}"

    def asks_mig_only(self, device_class: str) -> bool:
        """Classes the chart renders that match MIG devices only: the MIG class and the
        per-profile classes (`mig-<profile>.<driver>`)."""
        return device_class == self.mig_class or (
            device_class.startswith("mig-") and device_class.endswith(self.profile_class_suffix)
        )

    def attribute(self, name: str) -> str:
        """The fully qualified attribute name, as `matchAttribute` spells it."""
        if name not in ATTRIBUTES:
            raise ValueError(
                f"{name!r} is not an attribute carve publishes ({', '.join(ATTRIBUTES)})"
            )
        return f"{self.driver}/{name}"


DEFAULT_CONTRACT = Contract()
