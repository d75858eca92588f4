"""MNIST and FashionMNIST through ``torchvision.datasets`` (``download=False``).

The data root holds torchvision's layout, ``ROOT/MNIST/raw/`` (``ROOT/FashionMNIST/raw/``)
with the four idx files ``{train,t10k}-{images-idx3,labels-idx1}-ubyte``, plain or
``.gz``. torchvision reads only plain files, so ``.gz`` ones are decompressed once, with
torchvision's ``extract_archive``, into a cache this module owns
(``$IPUXL_CACHE/datasets/...``, default ``~/.cache/ipuxl``): the data root may be
read-only and is never written.

With all four files, the splits are ``torchvision.datasets.MNIST(root, train=...,
download=False)``. Without the training images (offline, where only the test set is
at hand) torchvision's ``MNIST`` refuses the folder (it wants all four files), so the
test split is read with torchvision's own idx readers (``read_image_file``,
``read_label_file``) and split: the first 8,000 images train, the last 2,000
evaluate, and the loader says so.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from typing import Literal, NamedTuple, Optional, Tuple

import torch
from torch.utils.data import DataLoader, TensorDataset
from torchvision import datasets as tv_datasets
from torchvision.datasets.mnist import read_image_file, read_label_file
from torchvision.datasets.utils import extract_archive

from ipuxl.errors import DataError as MissingDataError, DataFileError, InvalidValueError

DatasetName = Literal["MNIST", "FashionMNIST"]

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
#: per-dataset normalisation (mean, std) of the training images
NORMALISATION: dict[str, tuple[float, float]] = {"MNIST": (MNIST_MEAN, MNIST_STD), "FashionMNIST": (0.2860, 0.3530)}
OFFLINE_TRAIN_SIZE = 8000
OFFLINE_TEST_SIZE = 2000
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


def cache_dir() -> str:
    """Where decompressed dataset files go: ``$IPUXL_CACHE/datasets``, default
    ``~/.cache/ipuxl/datasets`` (``$XDG_CACHE_HOME`` respected)."""
    base = os.environ.get("IPUXL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ipuxl")
    return os.path.join(base, "datasets")


def _find(raw_dir: str, name: str) -> Optional[str]:
    """Return the path of ``name`` or ``name.gz`` in ``raw_dir`` (plain preferred)."""
    for candidate in (name, name + ".gz"):
        path = os.path.join(raw_dir, candidate)
        if os.path.isfile(path):
            return path
    return None


def readable_root(root: str, name: DatasetName = "MNIST") -> tuple[str, dict[str, bool]]:
    """A root whose ``<name>/raw/`` holds ``root``'s files uncompressed, for torchvision.

    When every file found in ``root/<name>/raw`` is plain, that is ``root`` itself.
    Otherwise it is a folder of the cache (one per source folder) where ``.gz`` files are
    decompressed with torchvision's ``extract_archive`` and plain ones copied; a cached
    file is refreshed when its source is newer.

    Returns:
        ``(root to read, which of FILES' keys are present)``.
    """
    raw_dir = os.path.join(root, name, "raw")
    found = {key: _find(raw_dir, file) for key, file in FILES.items()}
    present = {key: path is not None for key, path in found.items()}
    if all(path is None or not path.endswith(".gz") for path in found.values()):
        return root, present
    digest = hashlib.sha1(os.path.abspath(raw_dir).encode()).hexdigest()[:16]
    cached_root = os.path.join(cache_dir(), digest)
    cached_raw = os.path.join(cached_root, name, "raw")
    os.makedirs(cached_raw, exist_ok=True)
    for key, source in found.items():
        if source is not None:
            _refresh(source, os.path.join(cached_raw, FILES[key]))
    return cached_root, present


def _refresh(source: str, target: str) -> None:
    """Make ``target`` the uncompressed content of ``source`` unless it already is newer.

    The file is written beside ``target`` and renamed into place, so a concurrent reader
    never sees half a file."""
    if os.path.isfile(target) and os.path.getmtime(target) >= os.path.getmtime(source):
        return
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as scratch:
        if source.endswith(".gz"):
            try:
                written = str(extract_archive(source, scratch))
            except (OSError, EOFError) as exc:
                raise DataFileError(f"cannot decompress {source}: {exc}",
                                    fix="replace the file with an intact copy") from exc
        else:
            written = os.path.join(scratch, os.path.basename(target))
            shutil.copyfile(source, written)
        os.replace(written, target)


def _read_idx(raw_dir: str, key: str) -> torch.Tensor:
    """One idx file of ``raw_dir`` read by torchvision's reader, checked."""
    path = os.path.join(raw_dir, FILES[key])
    reader = read_image_file if key.endswith("images") else read_label_file
    try:
        data = reader(path)
    except (AssertionError, KeyError, RuntimeError, TypeError, ValueError) as exc:
        raise DataFileError(f"corrupt idx file {path}: {type(exc).__name__} {exc}".rstrip(),
                            fix="replace the file with an intact copy") from exc
    if key.endswith("images") and tuple(data.shape[1:]) != (28, 28):
        raise DataFileError(f"corrupt idx file {path}: images are {tuple(data.shape[1:])}, expected (28, 28)",
                            fix="replace the file with an intact copy")
    return data


def _read_split(root: str, name: DatasetName, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and labels of one split with ``torchvision.datasets.<name>`` (all four files present)."""
    cls = getattr(tv_datasets, name)
    try:
        ds = cls(root, train=train, download=False)
    except (AssertionError, KeyError, RuntimeError, TypeError, ValueError) as exc:
        raise DataFileError(f"torchvision.datasets.{name} could not read {os.path.join(root, name, 'raw')}: "
                            f"{type(exc).__name__} {exc}".rstrip(), fix="replace the files with intact copies") from exc
    return ds.data, ds.targets


def _to_dataset(images: torch.Tensor, labels: torch.Tensor, flatten: bool,
                name: DatasetName = "MNIST") -> TensorDataset:
    """Normalise uint8 images and pair them with int64 labels."""
    if len(images) != len(labels):
        raise DataFileError(f"{name} has {len(images)} images but {len(labels)} labels",
                            fix="use the images and labels files of the same split")
    mean, std = NORMALISATION[name]
    x = (images.to(torch.float32) / 255.0 - mean) / std
    x = x.reshape(len(x), -1) if flatten else x.unsqueeze(1)
    return TensorDataset(x, labels.to(torch.int64))


def load_mnist(data_dir: Optional[str] = None, flatten: bool = False, verbose: bool = True,
               name: DatasetName = "MNIST") -> MNISTSplit:
    """Load MNIST (or FashionMNIST: ``name="FashionMNIST"``) from ``<data_dir>/<name>/raw``.

    Args:
        data_dir: Data root (see :func:`resolve_data_dir`).
        flatten: Return images as ``(N, 784)`` instead of ``(N, 1, 28, 28)``.
        verbose: Print a notice when falling back to the offline split.
        name: ``"MNIST"`` or ``"FashionMNIST"`` (same layout and file names).

    Returns:
        An :class:`MNISTSplit` with normalised float32 images and int64 labels.

    Raises:
        DataError: the test images or labels cannot be found (a FileNotFoundError).
        DataFileError: a file is corrupt (a ValueError).
        InvalidValueError: an unknown ``name``.

    Example:
        >>> split = load_mnist("/data", flatten=True, verbose=False)
        >>> x, y = split.train.tensors
    """
    if name not in NORMALISATION:
        raise InvalidValueError(f"load_mnist: unknown dataset {name!r}", fix="pass name='MNIST' or name='FashionMNIST'")
    root = resolve_data_dir(data_dir)
    raw_dir = os.path.join(root, name, "raw")
    found = {key: _find(raw_dir, file) for key, file in FILES.items()}
    if found["test_images"] is None or found["test_labels"] is None:
        expected = ", ".join(f"{file}[.gz]" for file in FILES.values())
        raise MissingDataError(
            f"{name} test files not found in {os.path.abspath(raw_dir)}",
            fix=f"put {expected} (at least the two t10k files) in ROOT/{name}/raw/ and point at ROOT with "
                "--data-dir or the IPUXL_DATA environment variable")
    readable, present = readable_root(root, name)
    if all(present.values()):
        train = _to_dataset(*_read_split(readable, name, train=True), flatten, name)
        test = _to_dataset(*_read_split(readable, name, train=False), flatten, name)
        desc = f"{name} from {raw_dir}: {len(train)} train / {len(test)} test images"
        return MNISTSplit(train, test, False, desc)
    test_dir = os.path.join(readable, name, "raw")
    images, labels = _read_idx(test_dir, "test_images"), _read_idx(test_dir, "test_labels")
    if len(images) != len(labels):
        raise DataFileError(f"{name} has {len(images)} test images but {len(labels)} test labels in {raw_dir}",
                            fix="use the images and labels files of the same split")
    n_train, n_test = OFFLINE_TRAIN_SIZE, OFFLINE_TEST_SIZE
    if len(images) < n_train + n_test:
        raise DataFileError(f"the offline split needs {n_train + n_test} test images, {raw_dir} has {len(images)}",
                            fix=f"use the full t10k files, or add the training images to {raw_dir}")
    train = _to_dataset(images[:n_train], labels[:n_train], flatten, name)
    test = _to_dataset(images[-n_test:], labels[-n_test:], flatten, name)
    desc = (f"{name} training images not found in {raw_dir}; training on the first "
            f"{n_train} test images and evaluating on the last {n_test}")
    if verbose:
        print(f"ipuxl: {desc}")
    return MNISTSplit(train, test, True, desc)


def mnist_loaders(batch_size: int, test_batch_size: int, data_dir: Optional[str] = None,
                  shuffle: bool = True, drop_last: bool = True, seed: Optional[int] = None,
                  flatten: bool = False, verbose: bool = True,
                  name: DatasetName = "MNIST") -> Tuple[DataLoader, DataLoader, MNISTSplit]:
    """Build train and test DataLoaders for MNIST (or FashionMNIST).

    Args:
        batch_size: Training batch size.
        test_batch_size: Evaluation batch size.
        data_dir: Data root (see :func:`resolve_data_dir`).
        shuffle: Shuffle the training set each epoch.
        drop_last: Drop incomplete final batches (both loaders).
        seed: Seed for the training shuffle, for reproducible order.
        flatten: Return images as ``(N, 784)``.
        verbose: Print the notice when the offline split is used.
        name: ``"MNIST"`` or ``"FashionMNIST"``.

    Returns:
        ``(train_loader, test_loader, split)``.
    """
    split = load_mnist(data_dir, flatten=flatten, verbose=verbose, name=name)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    train_loader = DataLoader(split.train, batch_size=batch_size, shuffle=shuffle,
                              drop_last=drop_last, generator=generator)
    test_loader = DataLoader(split.test, batch_size=test_batch_size, shuffle=False,
                             drop_last=drop_last)
    return train_loader, test_loader, split
