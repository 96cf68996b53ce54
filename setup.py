from setuptools import find_packages, setup

setup(
    name="recom_rec",
    version="0.1.0",
    description="Fused, table-batched embedding layers for torchrec models (Triton/CUDA), "
    "with a parameter-server tier and a DistributedModelParallel plugin.",
    packages=find_packages(include=["recom_rec", "recom_rec.*"]),
    # Compiled on first use from the installed sources: the CUDA backend (on a GPU machine, nvcc)
    # and the parameter-server tier's host library (any machine, the C compiler).
    package_data={"recom_rec": ["csrc/*.cu", "csrc/*.c", "csrc/*.h", "csrc/*.ptx"]},
    python_requires=">=3.10",
    # torch, torchrec and fbgemm-gpu are deliberately not listed: their CUDA or CPU builds must
    # be chosen by the user (see the Makefile), and listing them would make pip pull CUDA wheels.
    install_requires=["numpy", "tqdm"],
    extras_require={"redis": ["redis>=4", "hiredis"], "plot": ["matplotlib"]},
)
