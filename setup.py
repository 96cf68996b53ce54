from setuptools import find_packages, setup

setup(
    name="recom_rec",
    version="0.1.0",
    description="Fused, table-batched embedding layers for torchrec models (Triton/CUDA), "
    "with a parameter-server tier and a DistributedModelParallel plugin.",
    packages=find_packages(include=["recom_rec", "recom_rec.*"]),
    # The C/CUDA sources live in csrc/ at the top level (csrc/lookup: the CUDA lookup kernels;
    # csrc/ps: the parameter-server tier's host library and row kernels), compiled on first use.
    python_requires=">=3.10",
    # torch, torchrec and fbgemm-gpu are deliberately not listed: their CUDA or CPU builds must
    # be chosen by the user (see the Makefile), and listing them would make pip pull CUDA wheels.
    install_requires=["numpy", "tqdm"],
    extras_require={"redis": ["redis>=4", "hiredis"], "plot": ["matplotlib"]},
)
