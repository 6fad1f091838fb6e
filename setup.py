"""Install the ``megatron`` package and build its C++ data helpers (pybind11).

Use the Makefile (``make test`` / ``make pretrain``): it installs torch and deepspeed first, in the
order they need, then this package with ``pip install --no-build-isolation -e .[test]``.
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup


def read_requirements(path="requirements.txt"):
    with open(path) as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


ext_modules = [
    Pybind11Extension(
        "megatron.data._helpers",
        ["megatron/data/helpers.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    ),
]

setup(
    name="megatron-ds3d",
    version="0.1.0",
    description="Megatron-style GPT/BLOOM pretraining with tensor parallelism on a DeepSpeed 3D engine",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=read_requirements(),
    extras_require={"test": ["pytest>=8", "pytest-timeout", "hypothesis",
                             "pytest-xdist==3.8.0",  # make test: two workers, one module each at a time
                             "openai>=1.0",  # the real client, against /v1/completions
                             # its float8 / MX quantizers: references for ours (tests/parallel/test_fp8_quantize.py)
                             "torchao==0.18.0",
                             "ruff==0.17.6"]},  # lint and import order (pyproject.toml), run by make test
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
