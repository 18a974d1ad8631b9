# Sourced by run.sh/test.sh. IMPL_DATA_DIR, when set, overrides the config's data_dir (impl/config.py).
# If it is unset and the config default ../shared/data is missing, fall back to /work/shared/data,
# where this workplace keeps its canonical copies.
if [ -z "${IMPL_DATA_DIR:-}" ] && [ ! -d ../shared/data ] && [ -d /work/shared/data ]; then
  IMPL_DATA_DIR=/work/shared/data
  echo "data: ../shared/data not found; using IMPL_DATA_DIR=$IMPL_DATA_DIR" >&2
fi
export IMPL_DATA_DIR
