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

{{/*
The operator's rules on RLRuns and their children: exactly the requests its handlers make. kopf lists and
watches RLRuns (no finalizer, no bookkeeping annotations: it never writes an RLRun) and posts events; the reconciler reads
each child, server-side applies it (a patch that creates an absent object, so create too), lists the
run's children to delete (prune) those no longer built, deletes a Job whose template changed, reads a
pending claim's events, creates the run's weights-token Secret once (never reads it), and writes the RLRun's status;
kopf watches the StatefulSets, Jobs and PVCs a run owns.
*/}}
{{- define "rawmm.operatorRules" -}}
- apiGroups: [rawmm.dev]
  resources: [rlruns]
  verbs: [get, list, watch]
- apiGroups: [rawmm.dev]
  resources: [rlruns/status]
  verbs: [patch]
# Children carry ownerReferences with blockOwnerDeletion, which clusters with the
# OwnerReferencesPermissionEnforcement admission plugin allow only to whom may update the owner's finalizers.
- apiGroups: [rawmm.dev]
  resources: [rlruns/finalizers]
  verbs: [update]
# Events are posted on the RLRuns; a pending claim's events are read into its condition.
- apiGroups: [""]
  resources: [events]
  verbs: [create, list]
# Claims are never deleted by the operator: they hold the run's data.
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [get, list, create, patch, delete]
# The run's weights-endpoint token: created once (an existing one is kept), deleted with an expired run
# (ttlSecondsAfterFinished). Never read: the operator cannot see any Secret's data.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, delete]
# The run's pods are listed to scrape trainer step and cache hit rate into the RLRun's status, and patched
# (an active deadline) to stop a failed run's other pods in place, keeping their logs.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, patch]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
{{- if .Values.runs.podMonitor.enabled }}
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, list, create, patch, delete]
{{- end }}
{{- end }}

{{/* The scrape targets of engine pods: prometheus-operator labels each target with its container, which the operator names "engine". */}}
{{- define "rawmm.engineTargetSelector" -}}
container="engine"
{{- end }}

{{/* Materialize-cache lookups per second of one engine target: hits + misses + in-flight joins. */}}
{{- define "rawmm.cacheLookupRate" -}}
rate(rawmm_materialize_cache_hits_total[10m]) + rate(rawmm_materialize_cache_misses_total[10m]) + rate(rawmm_materialize_cache_inflight_joins_total[10m])
{{- end }}
