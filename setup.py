"""ipuxl: the IPU programming model (PopXL, popxl.addons, PopTorch) on PyTorch."""
from __future__ import annotations

from importlib import metadata

from setuptools import find_packages, setup


def _torch_requirements() -> list[str]:
    """Keep an installed torch; pin torchvision to the release built for it.

    torchvision pins torch exactly, so an unpinned torchvision would replace an
    installed torch (a multi-GB download). torchvision 0.N+15 matches torch 2.N.
    """
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ["torch>=2.13,<2.16", "torchvision>=0.28,<0.31"]
    major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    return [f"torch=={version.split('+')[0]}" if major == 2 else "torch>=2.13",
            f"torchvision=={0}.{minor + 15}.*" if major == 2 else "torchvision"]


setup(
    name="ipuxl",
    version="0.1.0",
    description="The IPU programming model (PopXL, popxl.addons, PopTorch) on PyTorch, on any machine",
    packages=find_packages(include=["ipuxl", "ipuxl.*"]),
    python_requires=">=3.10",
    install_requires=[*_torch_requirements(), "numpy", "tqdm"],
    extras_require={"test": ["pytest", "mypy==2.4.1"]},  # mypy: .ci/run type-checks ipuxl/
)
