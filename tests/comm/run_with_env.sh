#!/bin/bash
# Runs a test binary with one extra environment variable: run_with_env.sh NAME=VALUE BINARY [ARGS...]
set -euo pipefail
export "$1"
shift
exec "$@"
