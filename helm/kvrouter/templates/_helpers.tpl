{{- define "kvrouter.fullname" -}}
{{- printf "%s-kvrouter" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvrouter.labels" -}}
app.kubernetes.io/name: kvrouter
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvrouter.selector" -}}
app.kubernetes.io/name: kvrouter
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvrouter.serviceAccount" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvrouter.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvrouter.adminSecret" -}}
{{- default (printf "%s-admin" (include "kvrouter.fullname" .)) .Values.adminToken.existingSecret -}}
{{- end -}}

{{- define "kvrouter.redisUrl" -}}
{{- if .Values.redis.bundled -}}
{{- printf "redis://%s-redis:6379/0" (include "kvrouter.fullname" .) -}}
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{- define "kvrouter.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- $url := include "kvrouter.redisUrl" . -}}
{{- if $url -}}
{{- $state := default (dict) $config.state -}}
{{- $_ := set $state "url" $url -}}
{{- $_ := set $config "state" $state -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{- define "kvrouter.clientSecret" -}}
{{- default (printf "%s-clients" (include "kvrouter.fullname" .)) .Values.clientTokens.existingSecret -}}
{{- end -}}
