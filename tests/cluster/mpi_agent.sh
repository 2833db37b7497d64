#!/bin/sh
# Open MPI's launch agent for namespace hosts (mpirun --mca plm_rsh_agent
# <this>): called like ssh, `mpi_agent.sh [ssh options] HOST COMMAND...`, it
# runs COMMAND (a shell command line, as ssh would) in namespace host HOST
# through hosts.sh instead of logging in. Needs SHARDTRAIN_CLUSTER (mpirun
# passes its environment on).
while [ $# -gt 0 ]; do
  case "$1" in
    -x | -T | -q | -n) shift ;;
    -o | -l | -p) shift 2 ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || { echo "mpi_agent.sh: usage: mpi_agent.sh HOST COMMAND..." >&2; exit 2; }
host="$1"; shift
exec "$(dirname "$(readlink -f "$0")")/hosts.sh" run "$host" /bin/sh -c "$*"
