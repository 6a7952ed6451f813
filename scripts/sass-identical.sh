#!/usr/bin/env bash
# Proves that a change moved no machine code: every kernel's SASS, on every arch of the library, against BASE's
# (a git revision, a copy of kernels/, a library or its build folder; a revision or a copy is built on first use).
# Exit 0: all identical; 1: some kernel differs (the table says which and how many instructions). No GPU needed.
#
# usage: scripts/sass-identical.sh [BASE] [kdev sass options]   # BASE: main by default
#        scripts/sass-identical.sh 69d2116                      # this checkout's build against 69d2116's
#        scripts/sass-identical.sh build/base --library build/cand/libkdtree.so
set -euo pipefail
base="${1:-main}"
shift || true
exec python3 -m kdev sass --against "$base" --expect-same "$@"
