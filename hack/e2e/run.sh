#!/usr/bin/env bash
# `make e2e`: brings the cluster up (cluster.sh), runs tests/e2e with pytest against it and tears the
# cluster down again, always (also when a test or the bring-up fails). Prints the wall time.
# Needs the images of `make images` (archives in ~/.cache/lockstep/images/archives).
#   run.sh [PYTEST_ARG...]   extra pytest arguments, passed as given: run.sh -k "install or paris"
#   PYTEST_ARGS              the same from the environment (`make e2e PYTEST_ARGS='-k "install or paris"'`),
#                            split as a shell would split it (quotes group words; no globbing or expansion)
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
start=$SECONDS

pytest_args=()
if [[ -n "${PYTEST_ARGS:-}" ]]; then
  split='import os, shlex, sys; sys.stdout.write("\0".join(shlex.split(os.environ["PYTEST_ARGS"])))'
  "$python" -c "$split" >/dev/null || { echo "run.sh: PYTEST_ARGS=$PYTEST_ARGS is not shell words (an unclosed quote?)" >&2; exit 2; }
  mapfile -d '' pytest_args < <("$python" -c "$split")
fi
pytest_args+=("$@")

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
  "${pytest_args[@]}" "$root/tests/e2e"
