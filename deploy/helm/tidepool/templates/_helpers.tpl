{{- define "tidepool.labels" -}}
app.kubernetes.io/name: tidepool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tidepool.selector" -}}
app.kubernetes.io/name: tidepool
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tidepool.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
