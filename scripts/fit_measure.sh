#!/usr/bin/env bash
# Records the "will it fit" measurement's runs on a GPU host: each model and
# batch of examples/fit_models.rs on CUDA (libtorch's default settings, then
# expandable segments) and on the CPU, each run's snapshot under OUT/snap and
# its FIT lines in OUT/fit.log (fixtures/fit/ holds the CPU snapshots and
# the CUDA figures of one such run).
#
#     bash scripts/fit_measure.sh OUT [BINARY] -- "mlp 1024" "conv 256" ...
#
# BINARY is the built example (default target/release/examples/fit_models);
# libtorch is found through the Python that has torch.
set -u
out="$1"
binary="target/release/examples/fit_models"
shift
if [ "${1:-}" != -- ]; then
  binary="$1"
  shift
fi
[ "${1:-}" = -- ] && shift
torch_lib=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')
export LD_LIBRARY_PATH="$torch_lib/lib:$torch_lib/../nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p "$out/snap"
log="$out/fit.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$log"
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))' >>"$log" 2>&1
for run in "$@"; do
  set -- $run
  model=$1 batch=$2
  for mode in cuda cuda_exp cpu; do
    device=cuda
    conf=""
    [ $mode = cpu ] && device=cpu
    [ $mode = cuda_exp ] && conf="expandable_segments:True"
    PYTORCH_CUDA_ALLOC_CONF="$conf" "$binary" --model "$model" --batch "$batch" --device $device --steps 4 \
      --out "$out/snap/${model}_${batch}_${mode}.pickle" >>"$log" 2>&1 || echo "FAILED $model $batch $mode" >>"$log"
    echo "RUN $model $batch $mode" >>"$log"
  done
done
