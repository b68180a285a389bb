{{/* Chart name, overridable. */}}
{{- define "rawmm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified name of the release's objects; the release name alone when it already says "rawmm". */}}
{{- define "rawmm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rawmm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "rawmm.labels" -}}
helm.sh/chart: {{ include "rawmm.chart" . }}
{{ include "rawmm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rawmm
{{- end }}

{{/* Labels that select the operator pod; never change them in an upgrade (Deployment selectors are immutable). */}}
{{- define "rawmm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rawmm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "rawmm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rawmm.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference; the tag defaults to the chart's appVersion (the rawmm release). */}}
{{- define "rawmm.image" -}}
{{- $image := index . 0 }}
{{- $root := index . 1 }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}

{{/*
The operator's rules on RLRuns and their children: exactly the verbs its handlers use (kopf watches and
patches RLRuns and their status, posts events; the reconciler reads, creates and patches each child kind).
*/}}
{{- define "rawmm.operatorRules" -}}
- apiGroups: [rawmm.dev]
  resources: [rlruns]
  verbs: [get, list, watch, patch]
- apiGroups: [rawmm.dev]
  resources: [rlruns/status]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [""]
  resources: [persistentvolumeclaims, configmaps, services]
  verbs: [get, list, watch, create, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch]
{{- if .Values.runs.podMonitor.enabled }}
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, create, patch]
{{- end }}
{{- end }}

{{/* Matches the scrape targets of engine pods (labels the operator's PodMonitors put on every target). */}}
{{- define "rawmm.engineTargetSelector" -}}
component="engine"
{{- end }}
