"""The engine pod launcher script, mounted from the LLMService's ConfigMap at /etc/lockstep/launch.sh.

Kept as a Python string so it ships inside the package without package-data configuration.
"""

LAUNCHER = r"""#!/bin/sh
# Engine pod launcher, mounted from the LLMService's ConfigMap by the Lockstep operator.
#   launch.sh ARGS...   pod 0 of a group runs `lockstep serve ARGS`; the other pods wait until the
#                       leader's stable DNS name resolves, then run `lockstep worker ARGS`.
#   launch.sh --probe   startup/readiness/liveness check: GET /health on the leader, a no-op elsewhere.
# Rank = pod index x ranks per pod; the engine adds the local rank of each process it starts.
set -eu

: "${LOCKSTEP_POD_INDEX:?LOCKSTEP_POD_INDEX is not set (the pod-index label of the StatefulSet pod)}"
LOCKSTEP_RANK=$((LOCKSTEP_POD_INDEX * ${LOCKSTEP_RANKS_PER_POD:-1}))
export LOCKSTEP_RANK

if [ "${1:-}" = "--probe" ]; then
  [ "$LOCKSTEP_POD_INDEX" = 0 ] || exit 0
  exec python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:${LOCKSTEP_HTTP_PORT:-8000}/health', timeout=4)"
fi

if [ "$LOCKSTEP_POD_INDEX" = 0 ]; then
  exec lockstep serve "$@"
fi

waited=0
until getent hosts "$LOCKSTEP_LEADER_ADDR" >/dev/null 2>&1; do
  if [ "$waited" -ge "${LOCKSTEP_LEADER_WAIT_SECONDS:-600}" ]; then
    echo "launch.sh: leader $LOCKSTEP_LEADER_ADDR did not resolve within ${waited}s" >&2
    exit 1
  fi
  sleep 2
  waited=$((waited + 2))
done
exec lockstep worker "$@"
"""
