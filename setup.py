"""ipuxl: the IPU programming model (PopXL, popxl.addons, PopTorch) on PyTorch."""
from __future__ import annotations

from setuptools import find_packages, setup

# The torch/torchvision pair the test suite runs on (README: "Tested versions").
# Declared statically so pip's resolver sees it before anything is built: pip
# builds this package in an isolated environment where no torch is installed,
# so a requirement computed from "the installed torch" would never apply.
# Pinned exactly: a range would resolve to the newest release (untested here)
# and torchvision releases pin their torch, so a loose pair downloads torch twice.
TESTED_TORCH = "2.14.1"
TESTED_TORCHVISION = "0.29.1"

setup(
    name="ipuxl",
    version="0.1.0",
    description="The IPU programming model (PopXL, popxl.addons, PopTorch) on PyTorch, on any machine",
    packages=find_packages(include=["ipuxl", "ipuxl.*"]),
    python_requires=">=3.10",
    install_requires=[f"torch=={TESTED_TORCH}", f"torchvision=={TESTED_TORCHVISION}", "numpy", "tqdm"],
    # mypy: .ci/run type-checks ipuxl/; transformers, timm: Hugging Face models the capture tests train
    # (tests/apps makes its own venv with the older release Graphcore's applications pin; so do the
    # PopTorch clients' tests, tests/poptorch_compat/clients: pytorch-lightning 2.0 needs setuptools<81
    # and optimum-graphcore pins transformers 4.29.2, neither of which can sit beside these packages);
    # pytest-xdist: the suite runs one worker per core (`-n auto`)
    extras_require={"test": ["pytest", "pytest-xdist==3.8.0", "mypy==2.4.1", "transformers==5.24.0",
                             "timm==1.0.31"]},
)
