{{/*
Names and labels shared by every template. Kept in one place so the operator's Deployment
selector, the RBAC subjects and NOTES.txt always agree.
*/}}

{{- define "embedding-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "embedding-operator.fullname" -}}
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

{{- define "embedding-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "embedding-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "embedding-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The gateway's pods: a name of their own, so that no selector of the operator's (its
Deployment, its PodMonitor) overlaps them. */}}
{{- define "embedding-operator.gatewaySelectorLabels" -}}
app.kubernetes.io/name: {{ include "embedding-operator.name" . }}-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "embedding-operator.labels" -}}
helm.sh/chart: {{ include "embedding-operator.chart" . }}
{{ include "embedding-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: embedding-operator
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "embedding-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "embedding-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create=false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: tag defaults to the chart's appVersion. */}}
{{- define "embedding-operator.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The embedding-server image the operator puts into EmbeddingService pods by default. */}}
{{- define "embedding-operator.serverImage" -}}
{{- $tag := default .Chart.AppVersion .Values.serverImage.tag }}
{{- printf "%s:%s" .Values.serverImage.repository $tag }}
{{- end }}

{{/* True (non-empty) when the operator watches every namespace. */}}
{{- define "embedding-operator.clusterWide" -}}
{{- if not .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{/*
prometheus-adapter rules: each autoscaling gauge, per pod, as a custom metric of the same name.
The HPA asks for `<metric>` on the pods of one Deployment; the adapter maps the request onto
the series' `namespace` and `pod` labels (which Prometheus' pod discovery adds).
*/}}
{{- define "embedding-operator.adapterRules" -}}
{{- range .Values.prometheusAdapter.metrics }}
- seriesQuery: '{{ . }}{namespace!="",pod!=""}'
  resources:
    overrides:
      namespace: {resource: namespace}
      pod: {resource: pod}
  name:
    matches: "^{{ . }}$"
    as: "{{ . }}"
  metricsQuery: 'sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)'
{{- end }}
{{- end }}

{{/*
The operator settings the chart sets, as EMBEDDING_OPERATOR_* variables (a YAML mapping).
*/}}
{{- define "embedding-operator.settingsEnv" -}}
EMBEDDING_OPERATOR_NAMESPACES: {{ join "," .Values.watchNamespaces | quote }}
EMBEDDING_OPERATOR_DEFAULT_IMAGE: {{ include "embedding-operator.serverImage" . | quote }}
EMBEDDING_OPERATOR_ALLOWED_IMAGES: {{ join "," .Values.policy.allowedImages | quote }}
EMBEDDING_OPERATOR_ALLOWED_PRIORITY_CLASSES: {{ join "," .Values.policy.allowedPriorityClasses | quote }}
EMBEDDING_OPERATOR_ALLOWED_ENV: {{ join "," .Values.policy.allowedEnv | quote }}
EMBEDDING_OPERATOR_ALLOW_CONTROL_PLANE: {{ .Values.policy.allowControlPlane | toString | quote }}
EMBEDDING_OPERATOR_ALLOWED_EXTENDED_RESOURCES: {{ join "," .Values.policy.allowedExtendedResources | quote }}
EMBEDDING_OPERATOR_ALLOWED_SERVICE_TYPES: {{ join "," .Values.policy.allowedServiceTypes | quote }}
EMBEDDING_OPERATOR_ALLOWED_SERVICE_ANNOTATIONS: {{ join "," .Values.policy.allowedServiceAnnotations | quote }}
EMBEDDING_OPERATOR_GPU_PROFILES: /etc/embedding-operator/gpu-profiles.yaml
EMBEDDING_OPERATOR_LIVENESS: {{ printf "http://0.0.0.0:%d/healthz" (int .Values.operator.healthPort) | quote }}
EMBEDDING_OPERATOR_METRICS_PORT: {{ .Values.operator.metricsPort | toString | quote }}
EMBEDDING_OPERATOR_DEFAULT_AUTOSCALER: {{ .Values.autoscaling.defaultAutoscaler | quote }}
EMBEDDING_OPERATOR_KEDA_PROMETHEUS_ADDRESS: {{ .Values.autoscaling.keda.prometheusAddress | quote }}
EMBEDDING_OPERATOR_KEDA_GATEWAY_NAMESPACE: {{ .Values.autoscaling.keda.gatewayNamespace | default .Release.Namespace | quote }}
EMBEDDING_OPERATOR_KEDA_GATEWAY_JOB: {{ .Values.autoscaling.keda.gatewayJob | quote }}
EMBEDDING_OPERATOR_LOG_FORMAT: {{ .Values.operator.logFormat | quote }}
EMBEDDING_OPERATOR_LOG_LEVEL: {{ .Values.operator.logLevel | quote }}
EMBEDDING_OPERATOR_RESYNC_SECONDS: {{ .Values.operator.resyncSeconds | toString | quote }}
EMBEDDING_OPERATOR_FULL_RESYNC_SECONDS: {{ .Values.operator.fullResyncSeconds | toString | quote }}
EMBEDDING_OPERATOR_WORKERS: {{ .Values.operator.workers | toString | quote }}
EMBEDDING_OPERATOR_LEADER_ELECT: {{ .Values.leaderElection.enabled | toString | quote }}
EMBEDDING_OPERATOR_LEASE_NAME: {{ include "embedding-operator.leaseName" . | quote }}
EMBEDDING_OPERATOR_LEASE_NAMESPACE: {{ .Release.Namespace | quote }}
EMBEDDING_OPERATOR_LEASE_DURATION_SECONDS: {{ .Values.leaderElection.leaseDurationSeconds | toString | quote }}
EMBEDDING_OPERATOR_RENEW_DEADLINE_SECONDS: {{ .Values.leaderElection.renewDeadlineSeconds | toString | quote }}
EMBEDDING_OPERATOR_RETRY_PERIOD_SECONDS: {{ .Values.leaderElection.retryPeriodSeconds | toString | quote }}
{{- end }}

{{- define "embedding-operator.leaseName" -}}
{{- default (include "embedding-operator.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/*
What the operator does in the namespaces it watches (operator/embedding_operator: handlers.py,
reconcile.py, apply.py). Writes are server-side apply PATCHes that may create; deletes remove
children a spec no longer wants (an HPA after autoscaling is switched off, ...).
*/}}
{{- define "embedding-operator.workloadRules" -}}
# The custom resource: watched by kopf, read per reconcile, annotated by kopf (progress),
# status written by the operator.
- apiGroups: [embedding-operator.dev]
  resources: [embeddingservices]
  verbs: [get, list, watch, patch]
- apiGroups: [embedding-operator.dev]
  resources: [embeddingservices/status]
  verbs: [patch]
# Children carry ownerReferences with blockOwnerDeletion; clusters running the
# OwnerReferencesPermissionEnforcement admission plugin (OpenShift, hardened clusters) only
# allow that to whoever may update the owner's finalizers.
- apiGroups: [embedding-operator.dev]
  resources: [embeddingservices/finalizers]
  verbs: [update]
# Owned children: watched (label-selected) and created/patched/deleted by reconcile.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, persistentvolumeclaims]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, patch, delete]
# KEDA ScaledObjects (spec.autoscaling.autoscaler keda); harmless where KEDA is not installed.
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
# The optional NetworkPolicy (spec.networkPolicy.enabled).
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
# The golden-vectors record of each EmbeddingService (the ConfigMap <name>-golden it owns):
# read per reconcile, written when a model's first pod turns Ready. No other ConfigMap is read.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
# Server pods (label-selected): a container the kubelet cannot create (a missing Secret) is
# reported from the pod's status. No access to Secrets at all.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
# Events about EmbeddingServices and EmbeddingJobs (kopf's and the operator's own).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# EmbeddingJobs: watched, read per reconcile, status written, deleted once their
# ttlSecondsAfterFinished has passed; finalizers for blockOwnerDeletion, as above.
- apiGroups: [embedding-operator.dev]
  resources: [embeddingjobs]
  verbs: [get, list, watch, delete]
- apiGroups: [embedding-operator.dev]
  resources: [embeddingjobs/status]
  verbs: [patch]
- apiGroups: [embedding-operator.dev]
  resources: [embeddingjobs/finalizers]
  verbs: [update]
# An EmbeddingJob's planner and worker Jobs: created once, then only suspend and parallelism
# patched; garbage collection deletes them with the EmbeddingJob. Their pods are read through
# the pods rule above (list: termination messages).
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch]
# The job pods' own ServiceAccount, bound to no Role (the pods call no Kubernetes API; the
# kubelet resolves their credentials Secret). Created by a server-side apply, which needs
# patch as well. No access to Secrets, and no token requests (serviceaccounts/token).
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch]
{{- end }}
