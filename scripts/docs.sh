#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml, docs/) into build/site with `mkdocs build --strict`: a
# broken link, a page missing from the nav or a wrap() parameter missing from docs/usage.md fails it.
# Then checks the built site (scripts/check_site.py: every nav page built, every image and file a page
# refers to present). With TRAINSTREAM_DOCS_SHOTS=1 and Debian's chromium installed it also renders
# each page headless into build/site-shots/PAGE.png (TRAINSTREAM_DOCS_SHOT_SIZE, default 1280,2000).
# Installs nothing: scripts/setup.sh does.
set -euo pipefail
cd "$(dirname "$0")/.."
export NO_MKDOCS_2_WARNING=1  # Material's banner about its successor, printed on every build
python3 -m mkdocs build --strict --quiet -d build/site
python3 scripts/check_site.py build/site

if [[ ${TRAINSTREAM_DOCS_SHOTS:-0} == 1 ]]; then
  if ! command -v chromium >/dev/null; then
    echo "docs: TRAINSTREAM_DOCS_SHOTS=1 but chromium is not installed (apt-get install chromium)" >&2
    exit 1
  fi
  rm -rf build/site-shots && mkdir -p build/site-shots
  for page in build/site/index.html build/site/*/index.html; do
    name=$(basename "$(dirname "$page")"); [[ $page == build/site/index.html ]] && name=index
    [[ $name == search ]] && continue
    timeout 60 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars \
      --window-size="${TRAINSTREAM_DOCS_SHOT_SIZE:-1280,2000}" \
      --screenshot="build/site-shots/$name.png" "file://$PWD/$page" >/dev/null 2>&1
    [[ -s build/site-shots/$name.png ]] || { echo "docs: no screenshot of $page" >&2; exit 1; }
  done
  echo "docs: screenshots in build/site-shots/"
fi
