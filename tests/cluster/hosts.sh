#!/usr/bin/env bash
# Namespace hosts: N "machines" on this one, for multi-host tests.
#
# Each host hN is a Linux network namespace with its own UTS namespace (its
# hostname is hN) and one interface, eth0, with address 10.77.0.(N+1)/24 on a
# private switch: a bridge in a namespace of its own, one veth pair per host.
# Nothing is added to the machine's own network namespace, so the hosts
# reach only each other (and their own loopback), and two clusters made at
# once (two tests) never see each other. A command run in a host sees the
# cluster's /etc/hosts (hN -> its address, localhost), so the host names
# resolve there as on a real cluster. /dev/shm, /tmp and the process table
# stay shared with the machine (as the issue wants: "same host" must be
# decided by the host's identity, not by which files happen to be visible).
#
#   hosts.sh check              exits 0 if hosts can be made here; else prints
#                               "skipped: <reason>" and exits 3
#   hosts.sh up N               makes h0..h(N-1) (1 <= N <= 8); prints
#                               SHARDTRAIN_CLUSTER=<state dir>: export it for the
#                               commands below (each of them needs it)
#   hosts.sh run HOST CMD...    runs CMD in HOST (network + UTS namespace, the
#                               cluster's /etc/hosts); stdin/stdout/exit code pass through
#   hosts.sh addr HOST          prints HOST's address (10.77.0.x)
#   hosts.sh hosts              prints the host names, one a line
#   hosts.sh link HOST          prints "eth0 <bridge port> <bridge namespace>": the
#                               interface inside HOST and its port on the switch
#                               (for tc: `hosts.sh run h0 tc qdisc add dev eth0 ...`
#                               shapes h0's egress; `ip netns exec <ns> tc ... dev <port>`
#                               its ingress)
#   hosts.sh shape RATE|off     limits every host's eth0 egress to RATE (tc's
#                               units: 1gbit, 25gbit; a token bucket, tbf, with a
#                               1 ms burst) or removes the limit; both directions
#                               of every link are then limited (full duplex)
#   hosts.sh down               ends every process inside the hosts (TERM, then
#                               KILL after 3 s), deletes the namespaces, the switch
#                               and the state directory; safe to call twice
#   hosts.sh with N -- CMD...   up N, runs CMD (on this machine, SHARDTRAIN_CLUSTER
#                               exported), then down, also on failure, SIGINT or
#                               SIGTERM; exits with CMD's code
#   hosts.sh gc                 removes clusters left by a harness that was
#                               SIGKILLed (namespaces stc<owner pid>-* whose owner is gone)
#
# Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN), iproute2 and util-linux
# (unshare, nsenter). Namespaces are named stc<owner>-<random>-hN and -sw, where
# the owner is the pid of the process that called `up` (or of `with`).
set -u
# ip, munged, slurmd... live in sbin, which Bazel's test PATH leaves out.
export PATH="$PATH:/usr/sbin:/sbin"

CLUSTER_SUBNET="10.77.0"
MAX_HOSTS=8

die() { echo "hosts.sh: $*" >&2; exit 2; }

need_state() {
  [[ -n "${SHARDTRAIN_CLUSTER:-}" && -f "${SHARDTRAIN_CLUSTER}/cluster" ]] ||
    die "SHARDTRAIN_CLUSTER does not name a cluster made by 'hosts.sh up' (got '${SHARDTRAIN_CLUSTER:-}')"
  # shellcheck disable=SC1091
  source "${SHARDTRAIN_CLUSTER}/cluster"  # PREFIX, N
}

host_index() {  # HOST -> its index, or dies naming the valid hosts
  local h="$1"
  if [[ "$h" =~ ^h([0-9]+)$ ]] && ((BASH_REMATCH[1] < N)); then echo "${BASH_REMATCH[1]}"; return; fi
  die "no host '$h' in this cluster; valid: $(seq -s ' ' -f 'h%g' 0 $((N - 1)))"
}

# Exits 0 when namespaces can be made; else prints "skipped: why" and exits 3.
cmd_check() {
  local why=""
  for tool in ip unshare nsenter mount umount; do
    command -v "$tool" >/dev/null 2>&1 || { why="'$tool' is not installed (iproute2, util-linux, mount)"; break; }
  done
  if [[ -z "$why" ]]; then
    local probe="stc$$-probe" err
    if ! err="$(ip netns add "$probe" 2>&1)"; then
      why="cannot create a network namespace (ip netns add: ${err}); run as root or with CAP_SYS_ADMIN and CAP_NET_ADMIN"
    else
      if ! err="$(ip -n "$probe" link add a0 type veth peer name a1 2>&1)"; then
        why="cannot create veth pairs (${err}); the kernel needs veth and bridge support"
      elif ! err="$(unshare --uts true 2>&1)"; then
        why="cannot create a UTS namespace (unshare --uts: ${err})"
      fi
      ip netns del "$probe" 2>/dev/null
    fi
  fi
  if [[ -n "$why" ]]; then echo "skipped: $why"; exit 3; fi
  exit 0
}

cmd_up() {
  local n="${1:-}"
  [[ "$n" =~ ^[0-9]+$ ]] && ((n >= 1 && n <= MAX_HOSTS)) || die "up: the number of hosts must be 1..$MAX_HOSTS, got '$n'"
  [[ -z "${SHARDTRAIN_CLUSTER:-}" || ! -e "${SHARDTRAIN_CLUSTER}/cluster" ]] ||
    die "up: SHARDTRAIN_CLUSTER=$SHARDTRAIN_CLUSTER is a cluster already; 'hosts.sh down' it first"
  local state
  state="$(mktemp -d "${TMPDIR:-/tmp}/shardtrain-cluster.XXXXXX")" || die "up: mktemp failed"
  # The owner is the process whose life the cluster belongs to (gc removes
  # clusters whose owner is gone): the caller of `up`, or `with` itself.
  local owner="${SHARDTRAIN_CLUSTER_OWNER:-$PPID}"
  local prefix="stc${owner}-${RANDOM}"
  printf 'PREFIX=%s\nN=%s\n' "$prefix" "$n" >"$state/cluster"
  export SHARDTRAIN_CLUSTER="$state"
  PREFIX="$prefix"; N="$n"
  if ! up_steps; then
    cmd_down >/dev/null 2>&1
    die "up: making the hosts failed (everything made so far was removed)"
  fi
  echo "SHARDTRAIN_CLUSTER=$state"
}

up_steps() {
  local sw="$PREFIX-sw" i
  set -e
  {
    echo "127.0.0.1 localhost"
    for ((i = 0; i < N; ++i)); do echo "$CLUSTER_SUBNET.$((i + 1)) h$i"; done
  } >"$SHARDTRAIN_CLUSTER/hosts"
  ip netns add "$sw"
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  ip -n "$sw" link set lo up
  for ((i = 0; i < N; ++i)); do
    local ns="$PREFIX-h$i"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$ns" link add eth0 type veth peer name "h$i" netns "$sw"
    ip -n "$ns" addr add "$CLUSTER_SUBNET.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$sw" link set "h$i" master br0
    ip -n "$sw" link set "h$i" up
    # The host's own UTS namespace, kept by a bind mount of its nsfs file.
    touch "$SHARDTRAIN_CLUSTER/uts-h$i"
    unshare --uts="$SHARDTRAIN_CLUSTER/uts-h$i" hostname "h$i"
  done
  set +e
}

cmd_run() {
  need_state
  local host="${1:-}"; shift || true
  local i; i="$(host_index "$host")" || exit 2
  [[ $# -ge 1 ]] || die "run: usage: hosts.sh run HOST CMD..."
  # The host's network and UTS namespaces, and a mount namespace of the
  # command's own in which the cluster's hosts file is bound over /etc/hosts
  # (invisible outside). Not `ip netns exec`: it mounts a fresh /sys, which
  # hides /sys/fs/cgroup (slurmd needs it).
  exec nsenter --net="/run/netns/$PREFIX-h$i" --uts="$SHARDTRAIN_CLUSTER/uts-h$i" -- \
    unshare --mount --propagation slave \
    /bin/sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "$SHARDTRAIN_CLUSTER/hosts" "$@"
}

# Token bucket on each host's egress. tbf, not netem: netem (which could add
# delay too) is not in every kernel (not in this machine's).
cmd_shape() {
  need_state
  local rate="${1:-}" i
  if [[ "$rate" == off ]]; then
    for ((i = 0; i < N; ++i)); do cmd_run_quiet "$i" tc qdisc del dev eth0 root 2>/dev/null; done
    return 0
  fi
  [[ "$rate" =~ ^([0-9]+)(mbit|gbit)$ ]] || die "shape: RATE must be <number>mbit or <number>gbit (e.g. 10gbit) or off, got '$rate'"
  local unit=1000000; [[ "${BASH_REMATCH[2]}" == gbit ]] && unit=1000000000
  local bits=$((BASH_REMATCH[1] * unit))
  local burst=$((bits / 8 / 1000)); ((burst < 262144)) && burst=262144  # 1 ms of traffic, at least 256 KiB
  for ((i = 0; i < N; ++i)); do
    cmd_run_quiet "$i" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 20ms ||
      die "shape: tc qdisc replace on h$i's eth0 failed"
  done
}
cmd_run_quiet() { nsenter --net="/run/netns/$PREFIX-h$1" -- "${@:2}"; }

cmd_addr() { need_state; local i; i="$(host_index "${1:-}")" || exit 2; echo "$CLUSTER_SUBNET.$((i + 1))"; }
cmd_hosts() { need_state; local i; for ((i = 0; i < N; ++i)); do echo "h$i"; done; }
cmd_link() { need_state; local i; i="$(host_index "${1:-}")" || exit 2; echo "eth0 h$i $PREFIX-sw"; }

# Kills every process inside namespace $1 (TERM, then KILL after 3 s).
kill_in_ns() {
  local ns="$1" pids t
  ip netns list 2>/dev/null | grep -q "^$ns\b" || return 0
  pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
  [[ -z "${pids// /}" ]] && return 0
  kill -TERM $pids 2>/dev/null
  for ((t = 0; t < 30; ++t)); do
    pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
    [[ -z "${pids// /}" ]] && return 0
    sleep 0.1
  done
  echo "hosts.sh: killing what ignored SIGTERM in $ns: $pids" >&2
  kill -KILL $pids 2>/dev/null
  for ((t = 0; t < 30; ++t)); do
    [[ -z "$(ip netns pids "$ns" 2>/dev/null)" ]] && return 0
    sleep 0.1
  done
}

remove_cluster() {  # PREFIX, state dir (may be empty)
  local prefix="$1" state="$2" ns f
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$prefix-h[0-9]*$"); do kill_in_ns "$ns"; done
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$prefix-\(h[0-9]*\|sw\)$"); do
    ip netns del "$ns" 2>/dev/null || echo "hosts.sh: could not delete namespace $ns" >&2
  done
  if [[ -n "$state" && -d "$state" ]]; then
    for f in "$state"/uts-h*; do
      [[ -e "$f" ]] || continue
      umount "$f" 2>/dev/null
    done
    rm -rf "$state"
  fi
}

cmd_down() {
  [[ -n "${SHARDTRAIN_CLUSTER:-}" && -f "${SHARDTRAIN_CLUSTER}/cluster" ]] || return 0
  need_state
  remove_cluster "$PREFIX" "$SHARDTRAIN_CLUSTER"
}

cmd_gc() {
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^stc[0-9]*-'); do
    pid="${ns#stc}"; pid="${pid%%-*}"
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "hosts.sh gc: removing $ns (its harness, pid $pid, is gone)" >&2
      remove_cluster "${ns%-*}" ""
    fi
  done
  # UTS bind mounts of such clusters.
  local dir p m
  for dir in $(awk '$2 ~ /shardtrain-cluster\.[^/]*\/uts-h[0-9]+$/ {print $2}' /proc/self/mounts | xargs -r -n1 dirname | sort -u); do
    p="$(sed -n 's/^PREFIX=stc\([0-9]*\)-.*/\1/p' "$dir/cluster" 2>/dev/null)"
    [[ -n "$p" ]] && kill -0 "$p" 2>/dev/null && continue
    for m in $(awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/self/mounts); do umount "$m" 2>/dev/null; done
    rm -rf "$dir"
  done
}

cmd_with() {
  local n="${1:-}"; shift || true
  [[ "${1:-}" == "--" ]] && shift
  [[ $# -ge 1 ]] || die "with: usage: hosts.sh with N -- CMD..."
  local out
  out="$(SHARDTRAIN_CLUSTER_OWNER=$$ cmd_up "$n")" || exit 2
  export SHARDTRAIN_CLUSTER="${out#SHARDTRAIN_CLUSTER=}"
  local child=0 rc
  cleanup() { trap - EXIT INT TERM; [[ $child -ne 0 ]] && kill -TERM "$child" 2>/dev/null; cmd_down; }
  trap 'cleanup' EXIT
  trap 'cleanup; exit 130' INT
  trap 'cleanup; exit 143' TERM
  "$@" &
  child=$!
  wait "$child"
  rc=$?
  child=0
  cleanup
  exit "$rc"
}

main() {
  local cmd="${1:-}"; shift || true
  case "$cmd" in
    check) cmd_check ;;
    up) cmd_up "$@" ;;
    run) cmd_run "$@" ;;
    addr) cmd_addr "$@" ;;
    hosts) cmd_hosts ;;
    link) cmd_link "$@" ;;
    shape) cmd_shape "$@" ;;
    down) cmd_down ;;
    with) cmd_with "$@" ;;
    gc) cmd_gc ;;
    *) die "unknown command '$cmd'; valid: check, up N, run HOST CMD..., addr HOST, hosts, link HOST, shape RATE|off, down, with N -- CMD..., gc" ;;
  esac
}

main "$@"
