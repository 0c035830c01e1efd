{{/* Chart name, overridable. */}}
{{- define "lockstep.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource name prefix: <release>-<name>, or the release name when it already contains the name. */}}
{{- define "lockstep.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "lockstep.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object. Call with (dict "root" $ "component" "operator"). */}}
{{- define "lockstep.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "lockstep.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: lockstep
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels: chart-owned values only, so upgrades never hit an immutable selector. */}}
{{- define "lockstep.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lockstep.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* image reference: repository@digest when a digest is set, else repository:tag (the tag defaults
to the chart's appVersion). Call with (dict "root" $ "image" .Values.x.image). */}}
{{- define "lockstep.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "lockstep.operatorServiceAccount" -}}
{{- default (printf "%s-operator" (include "lockstep.fullname" .)) .Values.operator.serviceAccount.name -}}
{{- end -}}

{{- define "lockstep.gatewayServiceAccount" -}}
{{- default (printf "%s-gateway" (include "lockstep.fullname" .)) .Values.gateway.serviceAccount.name -}}
{{- end -}}

{{/* Namespaces the operator watches when not cluster-wide (a Role in each). */}}
{{- define "lockstep.watchNamespaces" -}}
{{- if .Values.operator.clusterWide -}}
{{- toJson list -}}
{{- else if .Values.operator.watchNamespaces -}}
{{- toJson .Values.operator.watchNamespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/* Whether the gateway discovers engines in every namespace (a ClusterRole). */}}
{{- define "lockstep.discoverAll" -}}
{{- if or .Values.gateway.discoverAllNamespaces (and .Values.operator.clusterWide (not .Values.gateway.discoveryNamespaces)) -}}
true
{{- end -}}
{{- end -}}

{{/* Namespaces the gateway discovers engines in, when not all: its own list, else the operator's. */}}
{{- define "lockstep.discoveryNamespaces" -}}
{{- if include "lockstep.discoverAll" . -}}
{{- toJson list -}}
{{- else if .Values.gateway.discoveryNamespaces -}}
{{- toJson .Values.gateway.discoveryNamespaces -}}
{{- else -}}
{{- include "lockstep.watchNamespaces" . -}}
{{- end -}}
{{- end -}}

{{/* Rules the gateway needs to find engines: the EndpointSlices of LLMService leader Services. */}}
{{- define "lockstep.gatewayRules" -}}
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
{{- end -}}

{{/* Rules the operator needs on the objects of one LLMService (least privilege). */}}
{{- define "lockstep.operatorRules" -}}
- apiGroups: [serving.lockstep.dev]
  resources: [llmservices]
  verbs: [get, list, watch]
- apiGroups: [serving.lockstep.dev]
  resources: [llmservices/status]
  verbs: [get, patch, update]
# spec.autoscaling: the operator writes spec.replicas as an HPA would, through the scale subresource.
- apiGroups: [serving.lockstep.dev]
  resources: [llmservices/scale]
  verbs: [get, patch]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
# One PodDisruptionBudget per LLMService over its engine pods (spec.disruptionBudget).
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, delete]
# The group Secret is only ever created (a 409 means it exists): the operator reads no Secret.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# Events: its own, and the StatefulSet controller's FailedCreate warnings (why pods are missing).
- apiGroups: [""]
  resources: [events]
  verbs: [list, create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}

{{/*
The gateway's --workers: gateway.workers, or with 0 one per CPU of the container's CPU request, rounded
up ("250m" -> 1, "1500m" -> 2, "4" -> 4), at least 1.
*/}}
{{- define "lockstep.gatewayWorkers" -}}
{{- $workers := int .Values.gateway.workers -}}
{{- if le $workers 0 -}}
{{- $cpu := toString (dig "requests" "cpu" "1" (.Values.gateway.resources | default dict)) -}}
{{- if hasSuffix "m" $cpu -}}
{{- $workers = div (add (trimSuffix "m" $cpu | int) 999) 1000 | int -}}
{{- else -}}
{{- $workers = ceil (float64 $cpu) | int -}}
{{- end -}}
{{- end -}}
{{- max $workers 1 -}}
{{- end -}}
