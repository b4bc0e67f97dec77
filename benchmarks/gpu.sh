#!/usr/bin/env bash
# The benchmarks on whatever accelerator JAX finds: installs nothing from the network.
# Run from the repository root in an environment with eqfit and a GPU build of jaxlib:
#   bash benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")"
python -c "import jax; print('devices:', jax.devices())"
python fit_speed.py --repeats 5
python validation.py --repeats 5
python throughput.py --repeats 3
python ensemble.py --repeats 3
python parallel.py --repeats 5
python survive.py --repeats 3 --gib 4
