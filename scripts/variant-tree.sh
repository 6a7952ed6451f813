#!/usr/bin/env bash
# A variant kernels/ tree from a patch, for scripts/gpu-round.sh --variant-patch: the working tree's kernels/ copied
# to OUTDIR/NAME/kernels (NAME: the patch's file name without .patch) with PATCH applied by git apply (paths
# kernels/..., as the files in variants/ have them). Prints the tree's path; a patch that is missing or does not apply
# is refused with one line and exit 2.
#   usage: scripts/variant-tree.sh PATCH OUTDIR
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: scripts/variant-tree.sh PATCH OUTDIR" >&2; exit 2; }
[ -f "$1" ] || { echo "--variant-patch $1: no such file" >&2; exit 2; }
patch="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
name="$(basename "$1" .patch)"
mkdir -p "$2" && out="$(cd "$2" && pwd)" || { echo "--variant-patch $1: cannot make $2" >&2; exit 2; }
cd "$(dirname "$0")/.."
dir="$out/$name"
rm -rf "$dir" && mkdir -p "$dir" && cp -r kernels "$dir/" || { echo "--variant-patch $1: cannot copy kernels/ to $dir" >&2; exit 2; }
# git apply inside a repository would patch that repository's paths: the ceiling keeps it to $dir
if ! err="$(cd "$dir" && GIT_CEILING_DIRECTORIES="$out" git apply "$patch" 2>&1)"; then
  echo "--variant-patch $1: does not apply to the working tree's kernels/ (${err%%$'\n'*})" >&2
  exit 2
fi
echo "$dir/kernels"
