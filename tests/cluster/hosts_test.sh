#!/usr/bin/env bash
# The namespace-host harness (hosts.sh) and the "same host" decision of the
# shared memory mesh across namespace hosts.
#
#   hosts_test.sh SHM_PROBE     (runfiles path; Bazel passes it)
#
# 1. Three hosts: own host names (h0..h2, not this machine's), own addresses
#    on eth0, names resolve inside, TCP from h1 and h2 to a listener on h0
#    works, nothing of the cluster is in this machine's network namespace, and
#    `hosts.sh shape RATE` limits a transfer between hosts (off lifts it).
# 2. Same host decision (shm_probe under torchrun --no-python):
#    - 2 ranks on h0: the world uses shared memory;
#    - 2 hosts x 2 ranks: the world and the replicate groups do not, each
#      host's shard group does; the bytes each group sent are those of the
#      algorithms (shared memory inside a host, TCP between hosts);
#    - 2 ranks on two namespace hosts that carry the SAME host name (as two
#      machines named alike; started by hand, rank 0 serving the store): no
#      shared memory.
# 3. Clean-up: `hosts.sh with` removes everything after its command fails,
#    after SIGINT to its process group (Ctrl-C) and after SIGTERM, killing
#    what still runs inside the hosts; no namespace, process, mount or
#    /dev/shm segment is left.
set -u
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/lib.sh" hosts_test
[[ $# -eq 1 ]] || die "usage: hosts_test.sh SHM_PROBE"
PROBE="$(abspath "$1")"
cluster_skip_unless_possible
[[ -x "$TORCHRUN" ]] || die "torchrun not found at $TORCHRUN (tools/bootstrap.sh installs the pinned torch)"
shm_snapshot "$OUT/shm.before"

# --- 1. Three hosts.
cluster_start 3
for i in 0 1 2; do
  name="$(H run "h$i" hostname)"
  [[ "$name" == "h$i" ]] || fail "host h$i calls itself '$name'"
  addr="$(H addr "h$i")"
  [[ "$addr" == "10.77.0.$((i + 1))" ]] || fail "addr h$i is '$addr'"
  H run "h$i" ip -o -4 addr show dev eth0 | grep -q " $addr/24 " || fail "h$i's eth0 does not carry $addr"
  [[ "$(H run h2 getent hosts "h$i" | awk '{print $1}')" == "$addr" ]] || fail "h$i does not resolve to $addr in h2"
done
[[ "$(hostname)" != h[0-9] ]] || fail "this machine's own host name changed to $(hostname)"
if ip -o addr | grep -q "10\.77\.0\."; then fail "a cluster address is in this machine's namespace"; fi
H run h0 python3 -c '
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("h0", 7000)); s.listen(4)
for _ in range(2):
    c, a = s.accept(); c.sendall(("hello " + a[0]).encode()); c.close()
' &
LISTENER=$!
sleep 0.5
for i in 1 2; do
  got="$(H run "h$i" python3 -c '
import socket, time
for _ in range(50):
    try:
        print(socket.create_connection(("h0", 7000), timeout=2).recv(64).decode()); break
    except ConnectionRefusedError: time.sleep(0.1)
')"
  [[ "$got" == "hello 10.77.0.$((i + 1))" ]] || fail "h$i -> h0:7000 got '$got'"
done
wait "$LISTENER" || fail "the listener on h0 failed"
# `hosts.sh shape`: 4 MiB from h1 to h0 at 80 Mbit/s take >= 0.35 s (tbf on h1's
# egress); after `shape off` the same transfer is not limited.
timed_transfer() {  # prints the seconds 4 MiB take from h1 to h0 (acknowledged by h0)
  H run h0 python3 -c '
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("h0", 7001)); s.listen(1); c, _ = s.accept(); n = 0
while n < 4 << 20: n += len(c.recv(1 << 20))
c.sendall(b"k"); c.close()
' &
  local listener=$!
  H run h1 python3 -c '
import socket, time
for _ in range(50):
    try: c = socket.create_connection(("h0", 7001), timeout=30); break
    except ConnectionRefusedError: time.sleep(0.1)
t0 = time.time(); c.sendall(bytes(4 << 20)); c.recv(1); print(f"{time.time() - t0:.3f}")
'
  wait "$listener"
}
H shape 80mbit || fail "hosts.sh shape 80mbit failed"
H run h1 tc qdisc show dev eth0 | grep -q "tbf .*rate 80Mbit" || fail "h1's eth0 has no 80 Mbit/s tbf: $(H run h1 tc qdisc show dev eth0)"
shaped="$(timed_transfer)"
H shape off
unshaped="$(timed_transfer)"
echo "4 MiB h1 -> h0: ${shaped} s at 80 Mbit/s, ${unshaped} s unshaped"
awk -v t="$shaped" 'BEGIN { exit !(t >= 0.35) }' || fail "4 MiB at 80 Mbit/s took ${shaped} s, expected >= 0.35 s ((4 MiB - the 256 KiB burst) / 80 Mbit/s = 0.39 s)"
awk -v t="$unshaped" -v s="$shaped" 'BEGIN { exit !(t < s / 2) }' || fail "after shape off 4 MiB took ${unshaped} s (shaped: ${shaped} s)"
H shape 3x 2>"$OUT/shape.err" && fail "hosts.sh shape 3x succeeded"
grep -q "RATE must be <number>mbit or <number>gbit" "$OUT/shape.err" || fail "shape 3x: $(cat "$OUT/shape.err")"
echo "hosts: ok ($(elapsed) s)"

# --- 2. Same host decision.
PORT=29400
torchrun_probe() {  # tag, nnodes, then per agent: host; prints nothing, output in $OUT/<tag>.*
  local tag="$1" nnodes="$2"; shift 2
  local ep; ep="$(H addr "$1"):$PORT"
  local pids=() k=0
  for host in "$@"; do
    H run "$host" timeout -k 5 120 "$TORCHRUN" --nnodes="$nnodes" --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint="$ep" \
      --rdzv-id="$tag" --no-python "$PROBE" >"$OUT/$tag.$k.out" 2>"$OUT/$tag.$k.err" &
    pids+=($!); k=$((k + 1))
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  cat "$OUT/$tag".*.out >"$OUT/$tag.out"
  if ((rc)); then fail "$tag: a torchrun agent failed"; tail -n 20 "$OUT/$tag".*.err >&2; fi
}
expect_line() {  # tag, pattern, what
  grep -qE -- "$2" "$OUT/$1.out" || { fail "$1: $3 (no line matching '$2')"; cat "$OUT/$1.out" >&2; }
}
expect_count() {  # tag, pattern, count, what
  local n; n="$(grep -cE -- "$2" "$OUT/$1.out")"
  [[ "$n" == "$3" ]] || { fail "$1: $4 ($n lines match '$2', expected $3)"; cat "$OUT/$1.out" >&2; }
}

torchrun_probe one_host 1 h0
expect_count one_host "^rank [01]/2 host=h0 group=world size=2 shm=1 " 2 "2 ranks on h0 share memory"

torchrun_probe two_hosts 2 h0 h1
# Bytes sent per rank (float32, 1024 per block): world all-reduce at W=4 is
# 2*(4-1)/4 * 4096 = 6144; shard reduce-scatter of 2 blocks at W=2 is
# (2-1)/2 * 8192 = 4096 (through shared memory); replicate all-reduce at W=2
# is 2*(2-1)/2 * 4096 = 4096 (over TCP between the hosts).
expect_count two_hosts "^rank [0-3]/4 host=h[01] group=world size=4 shm=0 bytes=6144 " 4 \
  "the world spans two hosts: no shared memory, 6144 bytes"
expect_count two_hosts "^rank [01]/4 host=h0 group=world/shard0 size=2 shm=1 bytes=4096 " 2 "h0's shard group shares memory"
expect_count two_hosts "^rank [23]/4 host=h1 group=world/shard1 size=2 shm=1 bytes=4096 " 2 "h1's shard group shares memory"
expect_count two_hosts "^rank [0-3]/4 host=h[01] group=world/replicate[01] size=2 shm=0 bytes=4096 " 4 \
  "replicate groups cross hosts: TCP"

# Two namespace hosts that both call themselves "twin" (as two machines with
# one name): one host name, two kernels' worth of networks. Started without
# torchrun (whose agents decide who serves the store by host name), rank 0
# serving the store; Gloo listens on eth0 ("twin" resolves nowhere).
same_name_probe() {
  local pids=() k
  for k in 0 1; do
    H run "h$k" unshare --uts /bin/sh -c 'hostname twin && exec "$@"' sh \
      env RANK=$k WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR="$(H addr h0)" MASTER_PORT=29401 \
      GLOO_SOCKET_IFNAME=eth0 timeout -k 5 120 "$PROBE" >"$OUT/same_name.$k.out" 2>"$OUT/same_name.$k.err" &
    pids+=($!)
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  cat "$OUT"/same_name.*.out >"$OUT/same_name.out"
  ((rc == 0)) || { fail "same_name: a rank failed"; tail -n 20 "$OUT"/same_name.*.err >&2; }
}
same_name_probe
expect_count same_name "^rank [01]/2 host=twin group=world size=2 shm=0 " 2 \
  "two hosts with one host name (different networks) do not share memory"
echo "same host decision: ok ($(elapsed) s)"
H down
unset SHARDTRAIN_CLUSTER

# --- 3. Clean-up after failure, Ctrl-C and SIGTERM.
# Starts `hosts.sh with 2` in its own process group (as a shell does for a
# foreground job) running sleepers in both hosts; returns once they run.
WITH_PID=0
start_with() {
  set -m
  "$HOSTS_SH" with 2 -- /bin/sh -c "'$HOSTS_SH' run h0 sleep 300 & '$HOSTS_SH' run h1 sleep 300 & wait" \
    >"$OUT/with.out" 2>&1 &
  WITH_PID=$!
  set +m
  local t
  for ((t = 0; t < 100; ++t)); do
    local n=0 ns
    for ns in $(ip netns list | awk '{print $1}' | grep "^stc$WITH_PID-.*-h[01]$"); do
      [[ -n "$(ip netns pids "$ns")" ]] && n=$((n + 1))
    done
    ((n == 2)) && return 0
    sleep 0.1
  done
  fail "hosts.sh with 2 did not start its sleepers"
}
# The processes inside the cluster of `with` $1, now.
inside_pids() {
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep "^stc$1-"); do ip netns pids "$ns"; done
}
expect_gone() {  # what, with pid, pids that ran inside
  local what="$1" pid="$2"; shift 2
  local left
  left="$(ip netns list | awk '{print $1}' | grep "^stc$pid-")"
  [[ -z "$left" ]] || fail "$what: namespaces left: $left"
  local p
  # A zombie has ended (it waits only for its parent, or init, to reap it).
  for p in "$@"; do
    local st; st="$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)"
    [[ -n "$st" && "$st" != Z ]] && fail "$what: process $p that ran inside is still alive (state $st)"
  done
  grep -q "shardtrain-cluster" /proc/self/mounts && fail "$what: a UTS bind mount is left: $(grep shardtrain-cluster /proc/self/mounts)"
  return 0
}

"$HOSTS_SH" with 2 -- /bin/sh -c 'exit 7' >"$OUT/with_fail.out" 2>&1
rc=$?
[[ $rc -eq 7 ]] || fail "hosts.sh with passes on its command's exit code 7: got $rc"

for sig in INT TERM; do
  start_with
  pids=($(inside_pids "$WITH_PID"))
  ((${#pids[@]} >= 2)) || fail "$sig: no processes inside the hosts"
  if [[ $sig == INT ]]; then kill -INT -- "-$WITH_PID"; else kill -TERM "$WITH_PID"; fi
  wait "$WITH_PID"
  rc=$?
  expected=$([[ $sig == INT ]] && echo 130 || echo 143)
  [[ $rc -eq $expected ]] || { fail "$sig: hosts.sh with exited $rc, expected $expected"; cat "$OUT/with.out" >&2; }
  expect_gone "SIG$sig" "$WITH_PID" "${pids[@]}"
done
echo "clean-up: ok ($(elapsed) s)"

leaks="$(shm_leaks "$OUT/shm.before")"
[[ -z "$leaks" ]] || fail "/dev/shm segments left behind: $leaks"
finish
