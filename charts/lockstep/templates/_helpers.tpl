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

{{/* image reference; the tag defaults to the chart's appVersion. Call with (dict "root" $ "image" .Values.x.image). */}}
{{- define "lockstep.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "lockstep.operatorServiceAccount" -}}
{{- default (printf "%s-operator" (include "lockstep.fullname" .)) .Values.operator.serviceAccount.name -}}
{{- end -}}

{{- define "lockstep.gatewayServiceAccount" -}}
{{- default (printf "%s-gateway" (include "lockstep.fullname" .)) .Values.gateway.serviceAccount.name -}}
{{- end -}}

{{/* Namespaces the gateway discovers engines in. */}}
{{- define "lockstep.discoveryNamespaces" -}}
{{- if .Values.gateway.discoveryNamespaces -}}
{{- toJson .Values.gateway.discoveryNamespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/* Rules the operator needs on the objects of one LLMService (least privilege). */}}
{{- define "lockstep.operatorRules" -}}
- apiGroups: [serving.lockstep.dev]
  resources: [llmservices]
  verbs: [get, list, watch]
- apiGroups: [serving.lockstep.dev]
  resources: [llmservices/status]
  verbs: [get, patch, update]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
