source .bundles/unpack.sh && SP=$PYTHONPATH && export PYTHONPATH=$PWD:$SP MOEBENCH_COMMIT=5c71675
S=$PWD/scripts/device_run.sh
$S 2026-12-01-5c71675-order-effect -- bash -c 'set -x; python scripts/order_effect.py --rows 4 --repeat 3; python scripts/order_effect.py --rows 4 --before 1,2 --repeat 1; python scripts/order_effect.py --rows 4 --dummy-gb 40 --repeat 2; python scripts/order_effect.py --rows 6 --repeat 2'
