#!/usr/bin/env bash
# `make e2e`: brings the cluster up (cluster.sh), runs tests/e2e with pytest against it and tears the
# cluster down again, always (also when a test or the bring-up fails). Prints the wall time.
# Needs the images of `make images` (archives in ~/.cache/lockstep/images/archives).
#   PYTEST_ARGS   extra pytest arguments (e.g. "-k paris")
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
start=$SECONDS

finish() {
  local rc=$?
  bash "$here/cluster.sh" down || rc=1
  echo "e2e: wall time $((SECONDS - start)) s (exit $rc)"
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT TERM

bash "$here/cluster.sh" up || exit 1
eval "$(bash "$here/cluster.sh" env)"
echo "e2e: cluster up after $((SECONDS - start)) s"
LOCKSTEP_E2E_KUBECONFIG="$KUBECONFIG" "$python" -m pytest -x -s -q -p no:cacheprovider --timeout 3600 \
  ${PYTEST_ARGS:-} "$root/tests/e2e"
