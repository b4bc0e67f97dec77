#!/usr/bin/env bash
# The typed API consumer's checks, run by .ci/run in the project's venv: eqfit's public
# types complete by pyright's measure, and a consumer file clean under pyright in strict
# mode and under mypy --strict (the one ignore in it is optax's, which ships no types).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
pyright consumer.py
mypy --strict --no-incremental consumer.py
# --verifytypes reads the installed package; outside the repo, so that it is the one found.
cd "$(mktemp -d)"
out="$(pyright --verifytypes eqfit --ignoreexternal)" || true
echo "$out" | grep -E "Symbols exported|Type completeness score"
echo "$out" | grep -q "Type completeness score: 100%" || { echo "$out"; exit 1; }
