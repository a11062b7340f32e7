#!/bin/sh
# agent-cert.sh: this node's toolsrv agent certificate, from cert-manager.
#
# cert-manager cannot put a node name into a certificate for a DaemonSet pod
# (a Certificate is one object for all pods; the csi-driver expands only
# POD_NAME, POD_NAMESPACE, POD_UID and SERVICE_ACCOUNT_NAME). So the agent
# pod requests its own: this script makes a private key that never leaves the
# pod (an in-memory emptyDir), sends a CSR with the URI SAN
# toolsrv://agent/$NODE_NAME as a cert-manager CertificateRequest, waits for
# the signed certificate and the CA, and installs all three under
# $CERT_DIR/current/ with one atomic symlink swap. It then keeps checking and
# requests a new certificate (with a new key) before the old one expires. The
# agent reads its TLS files on every (re)connect.
#
# Needs: sh, openssl, curl, jq, base64 (all in the toolsrv image); a service
# account allowed to create/get/delete certificaterequests.cert-manager.io in
# its namespace; NODE_NAME from the downward API (spec.nodeName).
#
# Environment (defaults in brackets):
#   NODE_NAME               required
#   CERT_DIR                [/etc/toolsrv/tls]
#   CERT_ISSUER             [toolsrv-ca]
#   CERT_ISSUER_KIND        [Issuer]  (or ClusterIssuer)
#   CERT_DURATION           [24h]
#   CERT_RENEW_BEFORE_SECS  [28800]   renew when less than this is left
#   CERT_CHECK_SECS         [300]     how often to check
#   CERT_WAIT_SECS          [300]     how long to wait for one request
#   SERVICE_ACCOUNT_DIR     [/var/run/secrets/kubernetes.io/serviceaccount]
set -eu

: "${NODE_NAME:?NODE_NAME must be set from the downward API (spec.nodeName)}"
dir=${CERT_DIR:-/etc/toolsrv/tls}
issuer=${CERT_ISSUER:-toolsrv-ca}
issuer_kind=${CERT_ISSUER_KIND:-Issuer}
duration=${CERT_DURATION:-24h}
renew_before=${CERT_RENEW_BEFORE_SECS:-28800}
check_every=${CERT_CHECK_SECS:-300}
wait_secs=${CERT_WAIT_SECS:-300}

sa=${SERVICE_ACCOUNT_DIR:-/var/run/secrets/kubernetes.io/serviceaccount}
ns=$(cat "$sa/namespace")
api="https://${KUBERNETES_SERVICE_HOST:?}:${KUBERNETES_SERVICE_PORT:?}"
crs="$api/apis/cert-manager.io/v1/namespaces/$ns/certificaterequests"

log() { printf '%s agent-cert[%s]: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$NODE_NAME" "$*" >&2; }

# kube METHOD URL [curl args...]: one API call with the (rotating) pod token.
kube() {
  method=$1 url=$2
  shift 2
  curl -sS --fail-with-body --max-time 30 --cacert "$sa/ca.crt" \
    -H "Authorization: Bearer $(cat "$sa/token")" \
    -H 'Accept: application/json' -H 'Content-Type: application/json' \
    -X "$method" "$@" "$url"
}

# True when the installed certificate is valid for at least $renew_before more seconds.
fresh() {
  [ -s "$dir/current/tls.crt" ] && [ -s "$dir/current/tls.key" ] && [ -s "$dir/current/ca.crt" ] &&
    openssl x509 -noout -checkend "$renew_before" -in "$dir/current/tls.crt" >/dev/null 2>&1
}

# issue: one request, start to finish. Runs with `set -e` off (called from an
# `if`), so every step checks its own status.
issue() {
  new=$(mktemp -d "$dir/.issue.XXXXXX") || return 1
  if ! openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$new/tls.key" -out "$new/req.csr" -subj "/CN=$NODE_NAME" \
    -addext "subjectAltName=URI:toolsrv://agent/$NODE_NAME" 2>"$new/openssl.err"; then
    log "openssl: $(cat "$new/openssl.err")"
    rm -rf "$new"
    return 1
  fi
  chmod 0400 "$new/tls.key"
  jq -n --arg node "$NODE_NAME" --arg csr "$(base64 -w0 "$new/req.csr")" \
    --arg issuer "$issuer" --arg kind "$issuer_kind" --arg duration "$duration" '{
      apiVersion: "cert-manager.io/v1", kind: "CertificateRequest",
      metadata: {
        generateName: "toolsrv-agent-",
        labels: {"app.kubernetes.io/name": "toolsrv", "app.kubernetes.io/component": "agent"},
        annotations: {"toolsrv.dev/node": $node}
      },
      spec: {
        request: $csr, duration: $duration,
        usages: ["digital signature", "client auth"],
        issuerRef: {name: $issuer, kind: $kind, group: "cert-manager.io"}
      }
    }' >"$new/request.json" || { rm -rf "$new"; return 1; }
  if ! created=$(kube POST "$crs" --data-binary @"$new/request.json"); then
    log "cannot create a CertificateRequest: $created"
    rm -rf "$new"
    return 1
  fi
  name=$(printf '%s' "$created" | jq -r '.metadata.name // empty')
  if [ -z "$name" ]; then
    log "unexpected answer to the CertificateRequest: $created"
    rm -rf "$new"
    return 1
  fi
  log "created CertificateRequest $name for toolsrv://agent/$NODE_NAME"

  waited=0
  while :; do
    if ! cr=$(kube GET "$crs/$name"); then
      log "cannot read CertificateRequest $name (will retry): $cr"
      cr='{}'
    fi
    state=$(printf '%s' "$cr" | jq -r '
      def cond(t): [.status.conditions[]? | select(.type == t)][0];
      if (cond("Denied").status // "") == "True" then "denied: \(cond("Denied").message // "")"
      elif (cond("InvalidRequest").status // "") == "True" then "invalid: \(cond("InvalidRequest").message // "")"
      elif (cond("Ready").status // "") == "True" and (.status.certificate // "") != "" then "ready"
      elif (cond("Ready").reason // "") == "Failed" then "failed: \(cond("Ready").message // "")"
      else "pending" end')
    case $state in
      ready) break ;;
      pending) ;;
      *)
        # Clean up first, so the log line reports a finished state.
        kube DELETE "$crs/$name" >/dev/null 2>&1 || :
        rm -rf "$new"
        log "CertificateRequest $name $state"
        return 1
        ;;
    esac
    if [ "$waited" -ge "$wait_secs" ]; then
      kube DELETE "$crs/$name" >/dev/null 2>&1 || :
      rm -rf "$new"
      log "CertificateRequest $name not issued after ${wait_secs}s (is it approved? see README)"
      return 1
    fi
    sleep 2
    waited=$((waited + 2))
  done

  printf '%s' "$cr" | jq -r '.status.certificate' | base64 -d >"$new/tls.crt" || :
  printf '%s' "$cr" | jq -r '.status.ca // empty' | base64 -d >"$new/ca.crt" || :
  kube DELETE "$crs/$name" >/dev/null 2>&1 || log "could not delete CertificateRequest $name (harmless)"
  if [ ! -s "$new/ca.crt" ]; then
    log "the issuer returned no CA certificate (status.ca); use a CA issuer"
    rm -rf "$new"
    return 1
  fi
  if ! openssl verify -CAfile "$new/ca.crt" "$new/tls.crt" >/dev/null 2>&1; then
    log "the issued certificate does not chain to the returned CA"
    rm -rf "$new"
    return 1
  fi
  rm -f "$new/req.csr" "$new/request.json" "$new/openssl.err"

  # Swap $dir/current to the new directory in one rename, then drop old ones.
  rm -f "$dir/.current.tmp"
  ln -s "$(basename "$new")" "$dir/.current.tmp" && mv -T "$dir/.current.tmp" "$dir/current" || return 1
  for old in "$dir"/.issue.*; do
    [ "$old" = "$new" ] || rm -rf "$old"
  done
  log "installed $(openssl x509 -noout -enddate -in "$dir/current/tls.crt")"
}

# pause SECS: a sleep that a TERM ends at once.
pause() {
  sleep "$1" &
  wait $! || :
}

trap 'exit 0' TERM INT
mkdir -p "$dir"
while :; do
  if fresh; then
    pause "$check_every"
  elif issue; then
    pause "$check_every"
  else
    log "retrying in 30s"
    pause 30
  fi
done
