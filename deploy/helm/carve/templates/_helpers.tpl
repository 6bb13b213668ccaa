{{/*
Names derived from .Values.driverName, the same way driver/contract.py derives them, so the
chart, the controller and the kubelet plugin agree on every class, gate and finalizer name.
*/}}

{{/* The whole-GPU class: a leading "mig." label becomes "gpu.", otherwise "gpu." is prefixed. */}}
{{- define "carve.gpuClass" -}}
{{- if and (hasPrefix "mig." .Values.driverName) (gt (len .Values.driverName) 4) -}}
gpu.{{ trimPrefix "mig." .Values.driverName }}
{{- else -}}
gpu.{{ .Values.driverName }}
{{- end -}}
{{- end -}}

{{/* The MIG class is the driver name itself. */}}
{{- define "carve.migClass" -}}
{{ .Values.driverName }}
{{- end -}}

{{/*
Suffix of cluster-scoped object names: empty for the default driver name, "-<driver with dots
as dashes>" otherwise, so an install under another driver name can share a cluster with a
default one (namespaced objects are told apart by their namespace).
*/}}
{{- define "carve.suffix" -}}
{{- if ne .Values.driverName "mig.carve.dev" -}}
-{{ .Values.driverName | replace "." "-" }}
{{- end -}}
{{- end -}}

{{- define "carve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "carve.labels" -}}
app.kubernetes.io/part-of: carve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Leader election: "auto" turns it on exactly when more than one replica runs. */}}
{{- define "carve.controller.leaderElect" -}}
{{- $mode := toString .Values.controller.leaderElection.enabled -}}
{{- if eq $mode "auto" -}}
{{ gt (int .Values.controller.replicas) 1 }}
{{- else -}}
{{ $mode }}
{{- end -}}
{{- end -}}

{{/* Each component's HTTP port (/metrics, /healthz, /readyz): its own, else metrics.port. */}}
{{- define "carve.controller.port" -}}
{{ .Values.controller.httpPort | default .Values.metrics.port }}
{{- end -}}
{{- define "carve.plugin.port" -}}
{{ .Values.plugin.httpPort | default .Values.metrics.port }}
{{- end -}}

{{/*
The kube-apiserver address for clusters where pods cannot reach the `kubernetes` Service: the
client libraries' in-cluster config reads these two variables, and a container's own env wins
over the ones the kubelet injects.
*/}}
{{- define "carve.apiServerEnv" -}}
{{- if .Values.apiServer.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ .Values.apiServer.host | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ .Values.apiServer.port | quote }}
{{- end }}
{{- end -}}

{{/*
The controller's settings (the environment twins of its flags, deploy/README.md), held in a
ConfigMap; their checksum is a pod-template annotation, so any change rolls the Deployment.
*/}}
{{- define "carve.controller.env" -}}
CARVE_DRIVER_NAME: {{ .Values.driverName | quote }}
CARVE_DEVICE_CLASSES: {{ printf "%s,%s" (include "carve.migClass" .) (include "carve.gpuClass" .) | quote }}
CARVE_NATIVE_FALLBACK_AFTER: {{ .Values.controller.nativeFallbackAfter | quote }}
CARVE_PREEMPTION: {{ .Values.controller.preemption | quote }}
CARVE_PREEMPTION_HOLD: {{ .Values.controller.preemptionHold | quote }}
CARVE_HOLD_GATE_UNTIL_CARVED: {{ .Values.controller.holdGateUntilCarved | toString | quote }}
CARVE_CARVE_WAIT: {{ .Values.controller.carveWait | quote }}
CARVE_PACKING_POLICY: {{ .Values.controller.packingPolicy | quote }}
CARVE_NAMESPACE_POD_SHARE: {{ .Values.controller.namespacePodShare | toString | quote }}
CARVE_LEADER_ELECT: {{ include "carve.controller.leaderElect" . | quote }}
CARVE_LEASE_NAME: "carve-controller"
CARVE_HTTP_ADDRESS: {{ printf ":%s" (include "carve.controller.port" .) | quote }}
CARVE_LOG_FORMAT: {{ .Values.logging.format | quote }}
CARVE_LOG_LEVEL: {{ .Values.logging.level | quote }}
{{- end -}}

{{/* The kubelet plugin's settings, as for the controller. */}}
{{- define "carve.plugin.env" -}}
{{- $kubelet := trimSuffix "/" .Values.plugin.kubeletDir -}}
CARVE_DRIVER_NAME: {{ .Values.driverName | quote }}
CARVE_FOREIGN_INSTANCES: {{ .Values.plugin.foreignInstances | quote }}
CARVE_WARM_SLICES_TTL: {{ .Values.plugin.warmSlices.ttl | quote }}
CARVE_WARM_SLICES_ACROSS_NAMESPACES: {{ .Values.plugin.warmSlices.acrossNamespaces | toString | quote }}
CARVE_REGISTRY_DIR: {{ printf "%s/plugins_registry" $kubelet | quote }}
CARVE_PLUGINS_DIR: {{ printf "%s/plugins" $kubelet | quote }}
CARVE_CDI_ROOT: {{ .Values.plugin.cdiDir | quote }}
CARVE_DRIVER_ROOT: {{ .Values.plugin.driverRoot | quote }}
CARVE_DEV_ROOT: {{ .Values.plugin.devRoot | quote }}
CARVE_RESYNC_PERIOD: {{ .Values.plugin.resyncPeriod | quote }}
CARVE_FATAL_XIDS: {{ .Values.plugin.health.fatalXids | quote }}
CARVE_IGNORED_XIDS: {{ .Values.plugin.health.ignoredXids | quote }}
CARVE_FATAL_TAINT_EFFECT: {{ .Values.plugin.health.fatalTaintEffect | quote }}
CARVE_DEGRADED_TAINT_EFFECT: {{ .Values.plugin.health.degradedTaintEffect | quote }}
CARVE_HEALTH_RECOVERY: {{ .Values.plugin.health.recovery | quote }}
CARVE_HEALTH_POLL_PERIOD: {{ .Values.plugin.health.pollPeriod | quote }}
CARVE_BINDING_CONDITIONS: {{ .Values.plugin.bindingConditions | toString | quote }}
CARVE_CARVE_FAILURE_COOLDOWN: {{ .Values.plugin.carveFailureCooldown | quote }}
{{- if eq (include "carve.controller.leaderElect" .) "true" }}
CARVE_CONTROLLER_LEASE: {{ printf "%s/carve-controller" .Release.Namespace | quote }}
{{- end }}
CARVE_CLEANUP_ON_EXIT: {{ .Values.plugin.cleanupOnExit | toString | quote }}
CARVE_HTTP_ADDRESS: {{ printf ":%s" (include "carve.plugin.port" .) | quote }}
CARVE_LOG_FORMAT: {{ .Values.logging.format | quote }}
CARVE_LOG_LEVEL: {{ .Values.logging.level | quote }}
{{- end -}}

{{/*
The simulator's config as the plugin reads it: the state file on the host (so it outlives the
pod, as a GPU's state outlives its driver) and a UUID seed that the init container appends per
node (every node reads the same ConfigMap).
*/}}
{{- define "carve.simulator.config" -}}
{{ toYaml .Values.plugin.simulate.config }}
state: {{ printf "%s/state.json" (trimSuffix "/" .Values.plugin.simulate.stateDir) }}
{{- end -}}

{{/*
Checks that values.schema.json cannot say readably; each message names the value and the fix.
*/}}
{{- define "carve.validate" -}}
{{- $dns := "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" -}}
{{- if not (regexMatch $dns .Values.driverName) -}}
{{- fail (printf "driverName %q is not a DNS subdomain of at most 63 characters (lower-case letters, digits and '-', in labels separated by dots, e.g. mig.carve.dev)" .Values.driverName) -}}
{{- end -}}
{{- $sim := .Values.plugin.simulate.config -}}
{{- if or (hasKey $sim "state") (hasKey $sim "uuid_seed") -}}
{{- fail "plugin.simulate.config must not set state or uuid_seed: the chart puts the state file in plugin.simulate.stateDir on the host and seeds each node's UUIDs with the node name" -}}
{{- end -}}
{{- if and (eq (toString .Values.controller.leaderElection.enabled) "false") (gt (int .Values.controller.replicas) 1) -}}
{{- fail (printf "controller.replicas=%v needs leader election: set controller.leaderElection.enabled to auto or true, or run one replica" .Values.controller.replicas) -}}
{{- end -}}
{{- $pdb := .Values.controller.podDisruptionBudget -}}
{{- if and $pdb.enabled (gt (int .Values.controller.replicas) 1) (ge (int $pdb.minAvailable) (int .Values.controller.replicas)) -}}
{{- fail (printf "controller.podDisruptionBudget.minAvailable=%v with controller.replicas=%v would block every node drain: keep it below the replicas (e.g. 1)" $pdb.minAvailable .Values.controller.replicas) -}}
{{- end -}}
{{- end -}}

{{/*
The controller pods' affinity: controller.affinity, with a preferred pod anti-affinity on the
node merged in (controller.podAntiAffinity) unless controller.affinity sets its own.
*/}}
{{- define "carve.controller.affinity" -}}
{{- $c := .Values.controller -}}
{{- $affinity := deepCopy $c.affinity -}}
{{- if and (eq $c.podAntiAffinity "preferred") (not (hasKey $affinity "podAntiAffinity")) -}}
{{- $term := dict "weight" 100 "podAffinityTerm" (dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (dict "app.kubernetes.io/name" "carve-controller" "app.kubernetes.io/instance" .Release.Name))) -}}
{{- $_ := set $affinity "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list $term)) -}}
{{- end -}}
{{- if $affinity }}{{ toYaml $affinity }}{{ end -}}
{{- end -}}
