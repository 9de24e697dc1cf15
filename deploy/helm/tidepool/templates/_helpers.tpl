{{- /*
Names. Every object this chart makes is named after the release, so several releases (say one
per memberSelector shard) can share a namespace and a cluster:
  tidepool.name      the chart name, or nameOverride
  tidepool.fullname  fullnameOverride; else the release name when it already holds the name
                     (release "tidepool" gives "tidepool"); else "<release>-<name>"
All at most 63 characters, no trailing "-".
*/ -}}
{{- define "tidepool.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tidepool.fullname" -}}
{{- $full := "" -}}
{{- if .Values.fullnameOverride -}}
{{- $full = .Values.fullnameOverride -}}
{{- else -}}
{{- $name := include "tidepool.name" . -}}
{{- $full = ternary .Release.Name (printf "%s-%s" .Release.Name $name) (contains $name .Release.Name) -}}
{{- end -}}
{{- $full | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /*
"<fullname>-<suffix>", the fullname shortened so the whole stays within 63 characters.
Call with (list . "suffix").
*/ -}}
{{- define "tidepool.suffixed" -}}
{{- $ctx := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $base := include "tidepool.fullname" $ctx | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" -}}
{{- printf "%s-%s" $base $suffix -}}
{{- end -}}

{{- define "tidepool.serviceAccountName" -}}
{{- .Values.serviceAccount.name | default (include "tidepool.fullname" .) -}}
{{- end -}}

{{- define "tidepool.leaseName" -}}
{{- .Values.leaderElection.leaseName | default (include "tidepool.fullname" .) -}}
{{- end -}}

{{- /*
"true" when this release (target member) makes the offload ClusterRole, else empty. There is one
per member cluster, shared by every tidepool identity there (tidepool binds it by its name): the
first release that finds it missing makes it and keeps it; any other leaves it alone. At
`helm template` lookup sees no cluster, so the role is always rendered there.
*/ -}}
{{- define "tidepool.makesOffloadRole" -}}
{{- $existing := lookup "rbac.authorization.k8s.io/v1" "ClusterRole" "" .Values.member.offloadRoleName -}}
{{- $owner := dig "metadata" "annotations" "meta.helm.sh/release-name" "" $existing -}}
{{- $ownerNs := dig "metadata" "annotations" "meta.helm.sh/release-namespace" "" $existing -}}
{{- $ours := or (empty $existing) (and (eq $owner .Release.Name) (eq $ownerNs .Release.Namespace)) -}}
{{- if and .Values.member.createOffloadRole $ours }}true{{ end -}}
{{- end -}}

{{- define "tidepool.labels" -}}
{{ include "tidepool.selector" . }}
app.kubernetes.io/component: {{ ternary "bridge" "member-identity" (eq .Values.target "training") }}
app.kubernetes.io/part-of: tidepool
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "tidepool.selector" -}}
app.kubernetes.io/name: {{ include "tidepool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tidepool.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- /*
The training side's ConfigMap, whole: rendered by training.yaml and hashed into the pod
template's checksum/config annotation, so any change to what it holds (config, leaderElection,
metrics, kubelet, the namespace) rolls the pods.
*/ -}}
{{- define "tidepool.configmap" -}}
{{- $ns := .Release.Namespace -}}
{{- $kubelet := dict "port" .Values.kubelet.port -}}
{{- if .Values.kubelet.tlsSecret -}}
{{- $_ := set $kubelet "tlsCertFile" "/etc/tidepool/kubelet/tls.crt" -}}
{{- $_ := set $kubelet "tlsKeyFile" "/etc/tidepool/kubelet/tls.key" -}}
{{- $_ := set $kubelet "clientCaFile" "/etc/tidepool/kubelet/ca.crt" -}}
{{- end -}}
{{- $election := merge (dict "enabled" true "leaseName" (include "tidepool.leaseName" .)) (omit .Values.leaderElection "leaseName") -}}
{{- $metrics := dict "bindAddress" (printf "0.0.0.0:%v" .Values.metrics.port) -}}
{{- $config := merge (dict "namespace" $ns "kubelet" $kubelet "leaderElection" $election "metrics" $metrics) (deepCopy .Values.config) -}}
{{- if .Values.sharding.enabled -}}
{{- $_ := set $config "sharding" (deepCopy .Values.sharding) -}}
{{- end -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "tidepool.suffixed" (list . "config") }}
  namespace: {{ $ns }}
  labels: {{- include "tidepool.labels" . | nindent 4 }}
data:
  tidepool.yaml: |
    {{- toYaml $config | nindent 4 }}
{{- end -}}
