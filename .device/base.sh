#!/usr/bin/env bash
# Here (no GPU), in the repository root: the package's files as they are at COMMIT, where they differ from the working
# tree, into .base/ (git-ignored locally; carry it), so that `task.sh next-base` times that commit beside this tree in
# the same call. A whole copy of the package would not fit the 64 MiB a call carries beside .whl, .fla and .tri.
#   .base/COMMIT     the commit
#   .base/files/     its versions of the files that differ (or that the tree has deleted since)
#   .base/REMOVED    the files added since COMMIT, which the base leaves out
# Usage: bash .device/base.sh COMMIT
set -euo pipefail
cd "$(dirname "$0")/.."
COMMIT=$(git rev-parse --short "${1:?usage: bash .device/base.sh COMMIT}")
grep -qxF /.base/ .git/info/exclude 2>/dev/null || echo /.base/ >> .git/info/exclude
rm -rf .base && mkdir -p .base/files
echo "$COMMIT" > .base/COMMIT
: > .base/REMOVED
git diff --name-status --no-renames "$COMMIT" -- ops engine cli profiles moe_tune setup.cfg |
    while read -r status path; do
        if [[ $status == A ]]; then
            echo "$path" >> .base/REMOVED
        else
            mkdir -p ".base/files/$(dirname "$path")"
            git show "$COMMIT:$path" > ".base/files/$path"
        fi
    done
echo "$COMMIT: $(find .base/files -type f | wc -l) files as they were, $(wc -l < .base/REMOVED) left out, $(du -sh .base | cut -f1)"
