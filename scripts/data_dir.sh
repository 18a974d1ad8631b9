# Sourced by run.sh/test.sh: choose the dataset folder. IMPL_DATA_DIR wins; else ../shared/data
# (the config default); else /work/shared/data where this workplace keeps its canonical copies.
if [ -z "${IMPL_DATA_DIR:-}" ]; then
  if [ -d ../shared/data ]; then
    IMPL_DATA_DIR=$(cd ../shared/data && pwd)
  elif [ -d /work/shared/data ]; then
    IMPL_DATA_DIR=/work/shared/data
  fi
fi
export IMPL_DATA_DIR
