#!/usr/bin/env bash
# Installs the built tree into a temporary prefix, then configures and builds a consumer project
# against it with find_package(tdist).
set -euo pipefail
build=$1 source=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
cmake -S "$source/tests/install/consumer" -B "$tmp/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/consumer"
"$tmp/consumer/consumer"
echo "find_package(tdist) from an install tree: ok"
