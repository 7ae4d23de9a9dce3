#!/usr/bin/env bash
# The accelerator checks in one call, on a machine whose JAX has a GPU or
# TPU: the tests of the pinned path on its own devices, then the benchmark
# beside Orbax (arguments go to benchmarks/accel.py). Needs jax, flax,
# optax, orbax-checkpoint, etils, crc32c and pytest importable; the package
# is used from this checkout. Logs and JSON go to $OUT (default: /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider \
    -m "not multiprocess" tests/arrays/test_pinned.py 2>&1 | tee "$out/tests.log" | tail -25
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/accel.py --json "$out/accel.json" "$@" \
    2>&1 | tee "$out/bench.log" | tail -30
