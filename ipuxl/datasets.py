"""MNIST loader for torchvision's raw layout (``ROOT/MNIST/raw/``), no torchvision.

Files may be plain or ``.gz`` (plain preferred). Without training images the
test set is split: first 8,000 images for training, last 2,000 for evaluation.
"""

from __future__ import annotations

import gzip
import os
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from ipuxl.errors import DataError as MissingDataError

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
OFFLINE_TRAIN_SIZE = 8000
OFFLINE_TEST_SIZE = 2000
IMAGE_MAGIC = 2051
LABEL_MAGIC = 2049
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


class MNISTSplit(NamedTuple):
    """Train/test datasets plus a note on how they were built.

    Attributes:
        train: Training dataset of ``(image, label)`` pairs.
        test: Evaluation dataset of ``(image, label)`` pairs.
        offline_split: True when both come from the official test set.
        description: Human-readable summary of the data source and sizes.
    """

    train: TensorDataset
    test: TensorDataset
    offline_split: bool
    description: str


def resolve_data_dir(data_dir: Optional[str]) -> str:
    """Return the data root: explicit argument, else ``$IPUXL_DATA``, else ``./data``.

    Args:
        data_dir: Explicit directory, or None to fall back to the environment.

    Returns:
        The directory that should contain ``MNIST/raw/``.
    """
    if data_dir:
        return str(data_dir)
    return os.environ.get("IPUXL_DATA") or "./data"


def _find(raw_dir: str, name: str) -> Optional[str]:
    """Return the path of ``name`` or ``name.gz`` in ``raw_dir`` (plain preferred)."""
    for candidate in (name, name + ".gz"):
        path = os.path.join(raw_dir, candidate)
        if os.path.isfile(path):
            return path
    return None


def read_idx(path: str, expected_magic: int) -> np.ndarray:
    """Parse an IDX file (optionally gzip-compressed) into a uint8 array.

    Args:
        path: File to read.
        expected_magic: 2051 for image files, 2049 for label files.

    Returns:
        Array of shape ``(N, 28, 28)`` for images or ``(N,)`` for labels.

    Raises:
        ValueError: If the file is truncated, has the wrong magic number or
            its size disagrees with its header.
    """
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except (OSError, EOFError) as exc:
        raise ValueError(f"corrupt MNIST file {path}: {exc}") from exc
    if len(data) < 8:
        raise ValueError(f"corrupt MNIST file {path}: only {len(data)} bytes")
    magic = int.from_bytes(data[:4], "big")
    if magic != expected_magic:
        raise ValueError(f"corrupt MNIST file {path}: magic number {magic}, "
                         f"expected {expected_magic}")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"corrupt MNIST file {path}: truncated header")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims))
    if len(data) - header != expected:
        raise ValueError(f"corrupt MNIST file {path}: header dims {dims} need "
                         f"{expected} bytes, found {len(data) - header}")
    if expected_magic == IMAGE_MAGIC and dims[1:] != (28, 28):
        raise ValueError(f"corrupt MNIST file {path}: images are {dims[1:]}, expected 28x28")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _to_dataset(images: np.ndarray, labels: np.ndarray, flatten: bool) -> TensorDataset:
    """Normalise uint8 images and pair them with int64 labels."""
    if len(images) != len(labels):
        raise ValueError(f"MNIST has {len(images)} images but {len(labels)} labels")
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    x = (x - MNIST_MEAN) / MNIST_STD
    x = x.reshape(len(x), -1) if flatten else x.unsqueeze(1)
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


def load_mnist(data_dir: Optional[str] = None, flatten: bool = False,
               verbose: bool = True) -> MNISTSplit:
    """Load MNIST from ``<data_dir>/MNIST/raw``.

    Args:
        data_dir: Data root (see :func:`resolve_data_dir`).
        flatten: Return images as ``(N, 784)`` instead of ``(N, 1, 28, 28)``.
        verbose: Print a notice when falling back to the offline split.

    Returns:
        An :class:`MNISTSplit` with normalised float32 images and int64 labels.

    Raises:
        FileNotFoundError: If the test images or labels cannot be found.
        ValueError: If a file is corrupt.
    """
    root = resolve_data_dir(data_dir)
    raw_dir = os.path.join(root, "MNIST", "raw")
    paths = {key: _find(raw_dir, name) for key, name in FILES.items()}
    if paths["test_images"] is None or paths["test_labels"] is None:
        expected = ", ".join(f"{name}[.gz]" for name in FILES.values())
        raise MissingDataError(
            f"MNIST test files not found in {os.path.abspath(raw_dir)}. Expected "
            f"ROOT/MNIST/raw/ to contain {expected} (at least the two t10k files). "
            "Point at ROOT with --data-dir or the IPUXL_DATA environment variable."
        )
    test_x = read_idx(paths["test_images"], IMAGE_MAGIC)
    test_y = read_idx(paths["test_labels"], LABEL_MAGIC)
    if paths["train_images"] is not None and paths["train_labels"] is not None:
        train = _to_dataset(read_idx(paths["train_images"], IMAGE_MAGIC),
                            read_idx(paths["train_labels"], LABEL_MAGIC), flatten)
        test = _to_dataset(test_x, test_y, flatten)
        desc = f"MNIST from {raw_dir}: {len(train)} train / {len(test)} test images"
        return MNISTSplit(train, test, False, desc)
    n_train, n_test = OFFLINE_TRAIN_SIZE, OFFLINE_TEST_SIZE
    if len(test_x) < n_train + n_test:
        raise ValueError(f"offline split needs {n_train + n_test} test images, "
                         f"{raw_dir} has {len(test_x)}")
    train = _to_dataset(test_x[:n_train], test_y[:n_train], flatten)
    test = _to_dataset(test_x[-n_test:], test_y[-n_test:], flatten)
    desc = (f"MNIST training images not found in {raw_dir}; training on the first "
            f"{n_train} test images and evaluating on the last {n_test}")
    if verbose:
        print(f"ipuxl: {desc}")
    return MNISTSplit(train, test, True, desc)


def mnist_loaders(batch_size: int, test_batch_size: int, data_dir: Optional[str] = None,
                  shuffle: bool = True, drop_last: bool = True, seed: Optional[int] = None,
                  flatten: bool = False, verbose: bool = True) -> Tuple[DataLoader, DataLoader, MNISTSplit]:
    """Build train and test DataLoaders for MNIST.

    Args:
        batch_size: Training batch size.
        test_batch_size: Evaluation batch size.
        data_dir: Data root (see :func:`resolve_data_dir`).
        shuffle: Shuffle the training set each epoch.
        drop_last: Drop incomplete final batches (both loaders).
        seed: Seed for the training shuffle, for reproducible order.
        flatten: Return images as ``(N, 784)``.
        verbose: Print the notice when the offline split is used.

    Returns:
        ``(train_loader, test_loader, split)``.
    """
    split = load_mnist(data_dir, flatten=flatten, verbose=verbose)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    train_loader = DataLoader(split.train, batch_size=batch_size, shuffle=shuffle,
                              drop_last=drop_last, generator=generator)
    test_loader = DataLoader(split.test, batch_size=test_batch_size, shuffle=False,
                             drop_last=drop_last)
    return train_loader, test_loader, split
