#!/usr/bin/env bash
# A Bazel HTTP remote cache on loopback: Debian's nginx with WebDAV PUT.
#   tools/ci/remote_cache.sh start [PORT]  starts it (PORT 0 or absent: a free
#                                          port; 9092 is what --config=remote names)
#                                          and prints its URL, http://127.0.0.1:PORT
#   tools/ci/remote_cache.sh stop PORT     stops the one started on PORT
# Bazel stores action results under /ac/ and outputs under /cas/ by GET and PUT.
# Storage: ${SHARDTRAIN_REMOTE_CACHE_DIR:-~/.cache/shardtrain/remote-cache}, outside
# any clone, so it stays warm between CI runs on one machine. When it holds more
# than ${SHARDTRAIN_REMOTE_CACHE_MAX_GB:-30} GB at start it is emptied whole (a
# partial prune could leave action results whose outputs are gone).
# nginx's own files (config, pid, logs, upload temp) are in <storage>.run/PORT.
set -euo pipefail

STORE="${SHARDTRAIN_REMOTE_CACHE_DIR:-$HOME/.cache/shardtrain/remote-cache}"
NGINX="${NGINX:-/usr/sbin/nginx}"
die() { echo "[remote_cache] ERROR: $*" >&2; exit 1; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start() {
  local port="${1:-0}" run max_kb
  [[ -x "$NGINX" ]] || die "no nginx at $NGINX: install Debian's nginx-light (tools/bootstrap.sh does) or set NGINX"
  if [[ "$port" == 0 ]]; then
    port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  fi
  [[ "$port" =~ ^[0-9]+$ ]] || die "port '$port' is not a number; give a port 1024-65535, or 0 for a free one"
  port_open "$port" && die "127.0.0.1:$port is already in use; give another port, or 0 for a free one"
  mkdir -p "$STORE"
  max_kb=$(( ${SHARDTRAIN_REMOTE_CACHE_MAX_GB:-30} * 1024 * 1024 ))
  if (( $(du -sk "$STORE" | cut -f1) > max_kb )); then
    echo "[remote_cache] $STORE holds more than ${SHARDTRAIN_REMOTE_CACHE_MAX_GB:-30} GB: emptying it" >&2
    rm -rf "${STORE:?}/ac" "${STORE:?}/cas"
  fi
  run="$STORE.run/$port"
  rm -rf "$run"; mkdir -p "$run/tmp"
  local user_line=""
  [[ $(id -u) -eq 0 ]] && user_line="user root;"  # workers must write the storage
  cat >"$run/nginx.conf" <<CONF
$user_line
worker_processes 2;
pid $run/nginx.pid;
error_log $run/error.log warn;
events { worker_connections 256; }
http {
  access_log off;
  client_body_temp_path $run/tmp;
  proxy_temp_path $run/tmp; fastcgi_temp_path $run/tmp; uwsgi_temp_path $run/tmp; scgi_temp_path $run/tmp;
  server {
    listen 127.0.0.1:$port;
    client_max_body_size 0;
    location / {
      root $STORE;
      dav_methods PUT;
      create_full_put_path on;
      dav_access user:rw;
    }
  }
}
CONF
  "$NGINX" -e "$run/error.log" -p "$run" -c "$run/nginx.conf" || die "nginx did not start; see $run/error.log"
  for _ in $(seq 50); do port_open "$port" && break; sleep 0.1; done
  if ! port_open "$port"; then
    stop "$port"  # leave no nginx behind
    die "nginx started but 127.0.0.1:$port does not answer; see $run/error.log"
  fi
  echo "http://127.0.0.1:$port"
}

stop() {
  local port="${1:?usage: $0 stop PORT}" pidfile
  pidfile="$STORE.run/$port/nginx.pid"
  [[ -f "$pidfile" ]] || { echo "[remote_cache] no cache started on port $port (no $pidfile)" >&2; return 0; }
  kill "$(cat "$pidfile")" 2>/dev/null || true
  for _ in $(seq 50); do port_open "$port" || break; sleep 0.1; done
  rm -f "$pidfile"
}

case "${1:-}" in
  start) start "${2:-0}" ;;
  stop) stop "${2:-}" ;;
  *) die "usage: $0 start [PORT] | stop PORT (got '${1:-}')" ;;
esac
