#!/bin/sh
# Screenshots of the documentation site with headless Chromium (`apt-get install chromium`):
# the front page, an API page and the results page, as a newcomer first sees them.
#
#     mkdocs build --strict --site-dir /tmp/site && sh tools/site_screenshots.sh /tmp/site docs/img
set -e
SITE=$(cd "${1:?usage: site_screenshots.sh SITE_DIR OUT_DIR [BROWSER]}" && pwd)
OUT=${2:?usage: site_screenshots.sh SITE_DIR OUT_DIR [BROWSER]}
BROWSER=${3:-chromium}
for page in index.html:front api/queues/index.html:api-queues results/index.html:results; do
  timeout 120 "$BROWSER" --headless=new --no-sandbox --disable-gpu --hide-scrollbars \
    --window-size=1280,2400 --screenshot="$OUT/screenshot-${page##*:}.png" \
    "file://$SITE/${page%%:*}" 2>/dev/null
done
