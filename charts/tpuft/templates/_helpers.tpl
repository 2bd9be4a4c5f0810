{{- define "tpuft.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tpuft.serviceAccountName" -}}
{{- default (include "tpuft.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "tpuft.labels" -}}
app.kubernetes.io/name: tpuft-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tpuft.selectorLabels" -}}
app.kubernetes.io/name: tpuft-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The operator's permissions: exactly the verbs and resources it uses, each justified. */}}
{{- define "tpuft.rules" -}}
# Watch TPUFineTunes (kopf's watch and in-memory index). The operator never writes spec.
- apiGroups: ["tpuft.dev"]
  resources: ["tpufinetunes"]
  verbs: ["get", "list", "watch"]
# Write the status it derives. Holding get+patch here is also what lets it grant the per-run
# progress Role (RBAC forbids granting what one does not hold; no escalate/bind verbs needed).
- apiGroups: ["tpuft.dev"]
  resources: ["tpufinetunes/status"]
  verbs: ["get", "patch"]
# Create the run's JobSet, watch it for status, and suspend/resume it with a merge patch.
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Watch the run's pods to tell Pending (and why) from Running. Never creates pods.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# The trainer configuration (create; get to adopt after a restart).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create"]
# The per-run progress identity: ServiceAccount, Role, RoleBinding (create; get to adopt).
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create"]
# Kubernetes Events on TPUFineTunes for every phase transition.
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
