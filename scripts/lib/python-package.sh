# Sourced by scripts/demo, scripts/gpu-test and scripts/bench-goals.
# install_python_package PY ROOT LOG: this tree's Python package into PY's environment, built in
# place of any installed copy (an incremental build under ROOT/build-python/). scikit-build-core and
# nanobind come from PyPI, or from ROOT/.carry/whl on machines without a package index. The build's
# output is appended to LOG; status 0 when the package is installed.
install_python_package() {
  local py=$1 root=$2 log=$3
  if ! "$py" -c "import scikit_build_core, nanobind" 2>/dev/null; then
    if [ -d "$root/.carry/whl" ]; then
      "$py" -m pip install --quiet --no-index --find-links "$root/.carry/whl" scikit-build-core nanobind >>"$log" 2>&1
    else
      "$py" -m pip install --quiet "scikit-build-core>=0.10" "nanobind>=2.0" >>"$log" 2>&1
    fi
  fi
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$py" -m pip install --quiet --no-build-isolation --no-deps "$root" >>"$log" 2>&1
}
