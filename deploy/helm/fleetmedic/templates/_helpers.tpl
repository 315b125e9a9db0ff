{{/* Labels of one component: {"root": $, "component": "worker"} */}}
{{- define "fleetmedic.labels" -}}
app.kubernetes.io/name: fleetmedic
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: fleetmedic
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end }}

{{/* What a component's selector matches: the same two labels as deploy/kubernetes/base. */}}
{{- define "fleetmedic.selector" -}}
app.kubernetes.io/name: fleetmedic
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "fleetmedic.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The policy: the shipped default with .Values.policy merged over it. */}}
{{- define "fleetmedic.policy" -}}
{{- $default := .Files.Get "files/default-policy.yaml" | fromYaml -}}
{{- mergeOverwrite $default (deepCopy .Values.policy) | toYaml -}}
{{- end }}

{{- define "fleetmedic.optionalSecret" -}}
- name: {{ .env }}
  valueFrom: {secretKeyRef: {name: {{ .name }}, key: {{ .key }}, optional: true}}
{{- end }}

{{/* mTLS to Temporal when .Values.temporal.tlsSecret names a Secret: the SDK's environment
configuration (the temporal CLI's variables), the files from the Secret's volume. */}}
{{- define "fleetmedic.temporalTlsEnv" -}}
{{- with .Values.temporal.tlsSecret }}
- {name: TEMPORAL_TLS, value: "true"}
- {name: TEMPORAL_TLS_CLIENT_CERT_PATH, value: /etc/temporal-tls/tls.crt}
- {name: TEMPORAL_TLS_CLIENT_KEY_PATH, value: /etc/temporal-tls/tls.key}
- {name: TEMPORAL_TLS_SERVER_CA_CERT_PATH, value: /etc/temporal-tls/ca.crt}
{{- end }}
{{- with .Values.temporal.tlsServerName }}
- {name: TEMPORAL_TLS_SERVER_NAME, value: {{ . | quote }}}
{{- end }}
{{- end }}

{{- define "fleetmedic.temporalTlsMount" -}}
{{- if .Values.temporal.tlsSecret }}
- {name: temporal-tls, mountPath: /etc/temporal-tls, readOnly: true}
{{- end }}
{{- end }}

{{- define "fleetmedic.temporalTlsVolume" -}}
{{- with .Values.temporal.tlsSecret }}
- name: temporal-tls
  secret: {secretName: {{ . }}}
{{- end }}
{{- end }}

{{- define "fleetmedic.restricted" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: ["ALL"]}
{{- end }}
