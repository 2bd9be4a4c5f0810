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

{{- define "tpuft.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if hasPrefix "@" $tag -}}
{{- printf "%s%s" .Values.image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Checks the schema cannot express; each fails the install with what to change. */}}
{{- define "tpuft.validate" -}}
{{- if eq (int .Values.metrics.port) (int .Values.health.port) -}}
{{- fail (printf "metrics.port and health.port must differ (both are %v)" .Values.metrics.port) -}}
{{- end -}}
{{- end -}}

{{/* The repository of trainerImage (no tag, no digest): runs may always name it in spec.image.
The same as api/policy.py image_repository. */}}
{{- define "tpuft.trainerRepository" -}}
{{- regexReplaceAll ":[^:/]*$" (regexReplaceAll "@.*$" .Values.trainerImage "") "" -}}
{{- end -}}

{{- define "tpuft.selectorLabels" -}}
app.kubernetes.io/name: tpuft-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The operator's permissions: exactly the verbs and resources it uses, each justified. The same
rules form the ClusterRole (all namespaces) or one Role per watched namespace. */}}
{{- define "tpuft.rules" -}}
# Watch TPUFineTunes: kopf lists and watches them into its in-memory index (nothing else reads
# them). No get/update/patch/delete: the operator never writes spec, metadata or finalizers.
- apiGroups: ["tpuft.dev"]
  resources: ["tpufinetunes"]
  verbs: ["list", "watch"]
# Write the status it derives (merge patch of status only); the namespace's progress Role grants
# patch on this subresource, and RBAC lets a subject create a Role only with permissions it holds
# itself: this is what avoids the escalate and bind verbs. get: reading a run back after a conflict.
# operate: no API verb, a marker the chart's progress policy checks to exempt the operator (of any
# release) from the rule that only a run's own pods may write its status.
- apiGroups: ["tpuft.dev"]
  resources: ["tpufinetunes/status"]
  verbs: ["get", "patch", "operate"]
# The run's JobSet: create it; get it to adopt one an earlier attempt made (409 on create); list and
# watch it for status; patch spec.suspend to suspend and resume. Never deletes: the garbage
# collector does, through the owner reference.
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["get", "list", "watch", "create", "patch"]
# The run's prepare Job (spec.prepare: the data prepared on CPU before the JobSet is created): create
# it; get it to adopt one an earlier attempt made (409 on create); list and watch the prepare Jobs
# (by label) for their outcome; delete it only when the run's data settings changed and it must be
# made again. The garbage collector deletes it with the run, through the owner reference.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete"]
# Watch the run's pods (by label) to tell Pending, and why, from Running, and on which node each runs;
# the prepare pod's termination message carries the prepared data's figures or the trainer's error.
# patch: only the annotation tpuft.dev/checkpoint-request, when GKE announces maintenance of a node
# of the run (its trainer then saves a checkpoint now). Never creates, reads the logs of, or deletes
# pods: the JobSet and Job controllers do that.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
# The progress channel's identity: once per namespace the trainer ServiceAccount and a Role +
# RoleBinding for run statuses (the chart's progress-policy.yaml limits each pod to its own run's
# status.progress); per run only a RoleBinding when the user names the pods' ServiceAccount.
# create; get to adopt after a restart. No update, delete, escalate or bind.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create"]
# Kubernetes Events on TPUFineTunes for phase transitions (kopf posts core/v1 Events; it never
# patches or aggregates them). list: a pod the apiserver refuses (PodSecurity, ResourceQuota, a
# webhook) is recorded only as the Job controller's FailedCreate Event on the Job (a Job's status
# has no condition for it, and the operator watches only its prepare Jobs): while a run's pods are missing it
# lists them, filtered by the apiserver (involvedObject.kind=Job, reason=FailedCreate), to say why
# in the run's status. No watch, no get: nothing else of Events is read.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "list"]
# Kueue's Workloads (Kueue makes one per JobSet that carries a queue label, i.e. per run with
# spec.queueName): list and watch them to say in a queued run's status why it waits (no such
# LocalQueue, inactive ClusterQueue, not enough quota, pending admission checks) and to post Events
# when Kueue admits or evicts it. patch: only spec.active, Kueue's own switch to hold a workload,
# when a queued run's spec.suspend is set (Kueue unsuspends a JobSet whose Workload it admits, so
# suspending the JobSet alone would not hold it). No create, delete, get or status writes. Granted
# with or without Kueue installed (a rule may name a resource that does not exist yet).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "watch", "patch"]
{{- if and .Values.networkPolicy.enabled .Values.networkPolicy.trainers }}
# networkPolicy.trainers: one NetworkPolicy per run (its pods accept connections only from the
# same run's pods), owned by the run and deleted with it by the garbage collector. create; get to
# adopt after a restart. No update or delete.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create"]
{{- end }}
{{- end -}}

{{/* Whether the operator watches TPU nodes for maintenance signals: watchNodes, else on in
all-namespaces mode and off in namespaced mode (which asks for nothing cluster-wide). */}}
{{- define "tpuft.watchNodes" -}}
{{- if kindIs "bool" .Values.watchNodes -}}
{{- .Values.watchNodes -}}
{{- else -}}
{{- not .Values.watchNamespaces -}}
{{- end -}}
{{- end -}}

{{/* Read the TPU nodes (cluster-scoped): GKE announces maintenance there (label
cloud.google.com/scheduled-maintenance-time, active-node-maintenance, taint
impending-node-termination), and the operator checkpoints the runs on a node before it. Reads only,
filtered to TPU nodes by label. */}}
{{- define "tpuft.nodeRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
{{- end -}}

{{/* Cluster-scoped reads, only in the ClusterRole (all-namespaces mode). */}}
{{- define "tpuft.clusterRules" -}}
# kopf watches CRDs to notice API changes while it runs, e.g. JobSet installed after the operator
# (without this it logs a warning and only sees what existed at start-up). Reads only.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
# The JobSet CRD, that one only: at start-up (and again while it falls short) the operator checks
# that the installed JobSet knows every field it sets; an older one drops
# failurePolicy.rules[].onJobFailureMessagePatterns (JobSet v0.10.0), and a checkpointed stop would
# then fail the whole run. Without this read (namespaced mode) runs get their JobSets unchecked.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  resourceNames: ["jobsets.jobset.x-k8s.io"]
  verbs: ["get"]
{{- end -}}
