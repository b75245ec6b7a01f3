{{- define "stoker.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "stoker.labels" -}}
app.kubernetes.io/name: stoker-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "stoker.selectorLabels" -}}
app.kubernetes.io/name: stoker-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "stoker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "stoker.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "stoker.webhookService" -}}
{{- printf "%s-webhook" (include "stoker.fullname" .) -}}
{{- end -}}

{{- define "stoker.webhookSecret" -}}
{{- printf "%s-webhook-tls" (include "stoker.fullname" .) -}}
{{- end -}}

{{- /* The one image: stoker-operator and stoker-loader, tagged with the chart's appVersion. */ -}}
{{- define "stoker.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- /*
The autoscaler's queries (src/autoscale/prometheus.rs) select series by `namespace`, `pipeline`
and `role`, and key them by `pod` and `node`. The Prometheus Operator adds `namespace`, `pod`
and `container` to every PodMonitor target; these relabelings add the rest from the pod.
*/ -}}
{{- define "stoker.podRelabelings" -}}
relabelings:
  - sourceLabels: [__meta_kubernetes_pod_label_stoker_dev_pipeline]
    targetLabel: pipeline
  - sourceLabels: [__meta_kubernetes_pod_label_stoker_dev_role]
    targetLabel: role
  - sourceLabels: [__meta_kubernetes_pod_node_name]
    targetLabel: node
{{- end -}}
