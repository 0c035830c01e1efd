#!/usr/bin/env bash
# `make e2e`: brings the cluster up (cluster.sh), runs tests/e2e with pytest against it and tears the
# cluster down again, always (also when a test or the bring-up fails). Prints the wall time.
# pytest runs in the cluster's network namespace (`cluster.sh exec`): the cluster's addresses exist
# only there, and the tests' own listeners (kubectl port-forward, Prometheus) bind its loopback. The
# host's IPv4 addresses are printed after bring-up and after the tests; a cluster address among them
# fails the run.
# Needs the images of `make images` (archives in ~/.cache/lockstep/images/archives).
#   run.sh [PYTEST_ARG...]   extra pytest arguments, passed as given: run.sh -k "install or paris"
#   PYTEST_ARGS              the same from the environment (`make e2e PYTEST_ARGS='-k "install or paris"'`),
#                            split as a shell would split it (quotes group words; no globbing or expansion)
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"  # the checkout's environment (make test/e2e makes it)
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

host_addresses() {  # WHEN: the host namespace's IPv4 addresses; none may be the cluster's
  local addresses
  addresses="$(ip -4 -o addr show | awk '{ print $2 " " $4 }')"
  echo "e2e: host IPv4 addresses $1: $(echo $addresses)"
  if grep -qE ' 10\.(244|96)\.' <<<"$addresses"; then
    echo "e2e: a cluster address is in the host's network namespace" >&2
    return 1
  fi
}

bash "$here/cluster.sh" up || exit 1
eval "$(bash "$here/cluster.sh" env)"
echo "e2e: cluster up after $((SECONDS - start)) s"
host_addresses "with the cluster up" || exit 1
LOCKSTEP_E2E_KUBECONFIG="$KUBECONFIG" bash "$here/cluster.sh" exec \
  "$python" -m pytest -x -s -q -p no:cacheprovider --timeout 3600 "${pytest_args[@]}" "$root/tests/e2e"
rc=$?
host_addresses "after the tests" || rc=1
exit "$rc"
