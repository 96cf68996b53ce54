#!/usr/bin/env bash
# Installs a clean copy of the working tree on the GPU machine as a user would (pip, building the
# CUDA and PS extensions at install time), times it, and checks the installed copy loads both builds
# and runs a CUDA forward + fused backward without compiling anything. Logs and the built CUDA
# extension (to carry to later calls as .cuda_ext_xz/_lookup_cuda.so.xz) go to $OUT.
#   source .gpu/setup.sh && bash tools/gpu_install_check.sh
set -o pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
log="$OUT/install.log"
{
  python3 -c "import sys,torch,torchrec,fbgemm_gpu,setuptools; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'torchrec', torchrec.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__, 'setuptools', setuptools.__version__)"
  nvcc --version | tail -1
  rm -rf /tmp/clean /tmp/rr-site && mkdir -p /tmp/clean
  tar -c --exclude=./.gpu --exclude=./.cuda_ext_xz --exclude='*.so' --exclude=__pycache__ . | tar -x -C /tmp/clean
  cd /tmp/clean
  echo "\$ pip install --no-deps --no-build-isolation --no-index --target /tmp/rr-site ."
  t0=$(date +%s)
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/rr-site . 2>&1 | grep -E "^recom_rec:|rror" | head -20
  echo "install: $(( $(date +%s) - t0 )) s"
  ls -la /tmp/rr-site/recom_rec/kernels/_lookup_cuda*.so /tmp/rr-site/recom_rec/ps/_host*.so
  cd /tmp
  export PYTHONPATH=/tmp/rr-site:$PYTHONPATH
  t0=$(date +%s)
  python3 -m recom_rec.kernels.cuda_ext
  python3 -c "from recom_rec.ps import host_lib; host_lib.lib(); print('ps library:', host_lib.where())"
  python3 -c "
import torch, recom_rec
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
m = recom_rec.EmbeddingBagCollection([EmbeddingBagConfig(name='t', embedding_dim=64, num_embeddings=1000, feature_names=['f'])], device='cuda', backend='cuda')
m.enable_fused_optimizer('sgd', lr=0.1)
k = KeyedJaggedTensor.from_lengths_sync(keys=['f'], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1])).to('cuda')
m(k).values().sum().backward(); torch.cuda.synchronize(); print('installed copy: cuda forward + fused backward ok')"
  echo "first use after install: $(( $(date +%s) - t0 )) s"
} 2>&1 | grep -v "WARNING\|_fbgemm_torch_compat\|cannot determine\|^ *$" | tee "$log"
xz -T0 -c /tmp/rr-site/recom_rec/kernels/_lookup_cuda*.so > "$OUT/_lookup_cuda.so.xz" 2>/dev/null
