{{/* Names, labels and the pieces every pod of the chart shares. */}}

{{- define "trainyard.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "trainyard.apiName" -}}{{ include "trainyard.fullname" . }}-api{{- end -}}
{{- define "trainyard.workerName" -}}{{ include "trainyard.fullname" . }}-worker{{- end -}}
{{- define "trainyard.dataName" -}}{{ include "trainyard.fullname" . }}-data{{- end -}}

{{- define "trainyard.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "trainyard.labels" -}}
{{ include "trainyard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "trainyard.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The configurations that cannot work, refused at render time rather than found on the cluster. */}}
{{- define "trainyard.check" -}}
{{- if and (not .Values.database.external) (not .Values.data.persistence.enabled) -}}
{{- fail "database.external is false (SQLite in the data volume) but data.persistence.enabled is false: the API and the workers would each have a database of their own. Enable data.persistence, or use PostgreSQL (database.external)." -}}
{{- end -}}
{{- if and (not .Values.data.persistence.enabled) (not .Values.storage.url) -}}
{{- fail "data.persistence.enabled is false and storage.url is empty: the files would live in each pod's emptyDir and be lost with it. Set storage.url to an s3:// bucket, or enable data.persistence." -}}
{{- end -}}
{{- range $name, $_ := merge (dict) .Values.env .Values.api.env .Values.worker.env -}}
{{- if regexMatch "(?i)token|password|secret|database_url|access_key" $name -}}
{{- fail (printf "%s is a credential: put it in the Secret %s (docs/containers.md), not in a values file" $name $.Values.secret.name) -}}
{{- end -}}
{{- end -}}
{{- if and (not .Values.database.external) .Values.database.upgradeJob -}}
{{- fail "database.upgradeJob needs database.external: SQLite upgrades itself when the API starts." -}}
{{- end -}}
{{- end -}}

{{/* The pod-level part of every pod's spec: no root (Dockerfile.gpu's uid), no API credentials, no service links. */}}
{{- define "trainyard.podSecurity" -}}
# Service links would put <SERVICE>_PORT=tcp://... variables in the environment, and a Service named
# "trainyard" would set TRAINYARD_PORT to a URL; the pods find the API by its DNS name instead.
enableServiceLinks: false
# Nothing in trainyard talks to the Kubernetes API.
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  runAsNonRoot: true
  runAsUser: {{ .Values.securityContext.uid }}
  runAsGroup: {{ .Values.securityContext.gid }}
  # The data volume is made writable for that group.
  fsGroup: {{ .Values.securityContext.gid }}
  fsGroupChangePolicy: OnRootMismatch
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{- define "trainyard.containerSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: {{ .Values.securityContext.uid }}
  runAsGroup: {{ .Values.securityContext.gid }}
  allowPrivilegeEscalation: false
  privileged: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{/* The environment every trainyard container shares: the database, the bucket, the chart's env. */}}
{{- define "trainyard.env" -}}
- name: TRAINYARD_DATA_DIR
  value: /data
{{- if .Values.database.external }}
- name: TRAINYARD_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.secret.name }}
      key: database-url
{{- end }}
{{- with .Values.storage.url }}
- name: TRAINYARD_STORAGE_URL
  value: {{ . | quote }}
{{- with $.Values.storage.s3.endpoint }}
- name: AWS_ENDPOINT_URL_S3
  value: {{ . | quote }}
{{- end }}
- name: AWS_DEFAULT_REGION
  value: {{ $.Values.storage.s3.region | quote }}
{{- if $.Values.storage.s3.credentialsFromSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $.Values.secret.name }}
      key: aws-access-key-id
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $.Values.secret.name }}
      key: aws-secret-access-key
{{- end }}
{{- end }}
{{- range $name, $value := .Values.env }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{/* For the pods that get no GPU from the device plugin: the image's NVIDIA_VISIBLE_DEVICES=all would hand
them every GPU of a node whose default runtime is NVIDIA's, outside the plugin's count. */}}
{{- define "trainyard.noGpuEnv" -}}
- name: NVIDIA_VISIBLE_DEVICES
  value: void
{{- end -}}

{{/* Settings read from the Secret: (list $ {"ENV_NAME": "secret-key", ...}). */}}
{{- define "trainyard.secretEnv" -}}
{{- $root := index . 0 -}}
{{- range $name, $key := index . 1 }}
- name: {{ $name }}
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.secret.name }}
      key: {{ $key }}
{{- end -}}
{{- end -}}

{{/* The data volume: the shared claim, or an emptyDir that only caches the bucket. */}}
{{- define "trainyard.dataVolume" -}}
- name: data
{{- if .Values.data.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "trainyard.dataName" . }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.data.cacheSizeLimit }}
{{- end }}
{{- end -}}

{{/* Writable places under a read-only root: temporary files, and the home's caches (Triton's kernels). */}}
{{- define "trainyard.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
{{- end -}}

{{- define "trainyard.mounts" -}}
- name: data
  mountPath: /data
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/trainyard
{{- end -}}
