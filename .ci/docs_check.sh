#!/usr/bin/env bash
# Docs: build the documentation site (mkdocs.yml) with every warning as an error.
# Needs the `docs` extra (part of `dev`): pip install -e ".[docs]".
# Usage: bash .ci/docs_check.sh [SITE_DIR]   (default: a temporary folder, removed afterwards)
set -euo pipefail
cd "$(dirname "$0")/.."
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's banner about MkDocs 2.0; not a problem of this site
if [ "$#" -ge 1 ]; then
  site_dir="$1"
else
  site_dir="$(mktemp -d)"
  trap 'rm -rf "$site_dir"' EXIT
fi
start=$(date +%s)
# no -q: with it, mkdocs 1.6 does not count the warnings and --strict passes anyway
python -m mkdocs build --strict --clean --site-dir "$site_dir"
echo "docs site built without warnings in $(( $(date +%s) - start )) s: $site_dir"
