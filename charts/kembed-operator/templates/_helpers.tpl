{{- define "kembed-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kembed-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kembed-operator.labels" -}}
{{ include "kembed-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kembed-operator.serviceAccountName" -}}
{{- default (include "kembed-operator.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* What the operator does in every namespace it serves: kembed_operator.permissions.IN_NAMESPACE. */}}
{{- define "kembed-operator.namespaceRules" -}}
- apiGroups: [kembed.io]
  resources: [embeddingservices]
  verbs: [get, list, watch, patch]
- apiGroups: [kembed.io]
  resources: [embeddingservices/status]
  verbs: [patch]
- apiGroups: [kembed.io]
  resources: [embeddingjobs]
  verbs: [list, watch, patch]
- apiGroups: [kembed.io]
  resources: [embeddingjobs/status]
  verbs: [patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}
