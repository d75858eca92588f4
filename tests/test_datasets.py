"""ipuxl.datasets: MNIST/FashionMNIST through torchvision, on synthetic idx files and the shared MNIST."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from ipuxl.datasets import cache_dir, load_mnist, mnist_loaders, readable_root, resolve_data_dir
from ipuxl.errors import DataError, DataFileError, InvalidValueError

REAL_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"
NORM = {"MNIST": (0.1307, 0.3081), "FashionMNIST": (0.2860, 0.3530)}


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Decompressed files go to this test's own cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("IPUXL_CACHE", str(cache))
    return cache


def write_idx(path: Path, array: np.ndarray, magic: int, gz: bool) -> Path:
    """Write ``array`` (uint8) as an idx file, optionally gzip-compressed; returns its path."""
    payload = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    payload += array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as fh:
            fh.write(payload)
    else:
        path.write_bytes(payload)
    return path


def make_raw(root: Path, n_test: int = 10000, n_train: int = 0, gz: bool = True,
             name: str = "MNIST") -> tuple[np.ndarray, np.ndarray]:
    """A synthetic ``root/<name>/raw``: the t10k files, train labels, and ``n_train`` train
    images when asked. Returns all images and labels (test first, then train)."""
    raw = root / name / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(n_test + n_train, 28, 28), dtype=np.uint8)
    images[:, 0, 0] = np.arange(len(images)) % 256  # position marker
    labels = (np.arange(len(images)) % 10).astype(np.uint8)
    write_idx(raw / "t10k-images-idx3-ubyte", images[:n_test], 2051, gz)
    write_idx(raw / "t10k-labels-idx1-ubyte", labels[:n_test], 2049, gz)
    write_idx(raw / "train-labels-idx1-ubyte", labels[n_test:] if n_train else labels[:60], 2049, gz)
    if n_train:
        write_idx(raw / "train-images-idx3-ubyte", images[n_test:], 2051, gz)
    return images, labels


def normalise(images: np.ndarray, name: str = "MNIST") -> torch.Tensor:
    mean, std = NORM[name]
    return (torch.from_numpy(images.astype(np.float32)) / 255.0 - mean) / std


def listing(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in root.rglob("*")}


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name", ["MNIST", "FashionMNIST"])
def test_full_split_is_torchvisions(tmp_path: Path, capsys: pytest.CaptureFixture, gz: bool, name: str) -> None:
    images, labels = make_raw(tmp_path / "data", n_test=50, n_train=30, gz=gz, name=name)
    before = listing(tmp_path / "data")
    split = load_mnist(str(tmp_path / "data"), name=name)  # type: ignore[arg-type]
    assert not split.offline_split and capsys.readouterr().out == ""
    assert f"{name} from" in split.description and "30 train / 50 test" in split.description
    (tx, ty), (x, y) = split.train.tensors, split.test.tensors
    assert x.shape == (50, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert_close(x[:, 0], normalise(images[:50], name))
    assert_close(tx[:, 0], normalise(images[50:], name))
    assert torch.equal(y, torch.from_numpy(labels[:50].astype(np.int64)))
    assert torch.equal(ty, torch.from_numpy(labels[50:].astype(np.int64)))
    assert listing(tmp_path / "data") == before  # the data root is only read


def test_plain_files_are_read_in_place_and_gz_ones_through_the_cache(tmp_path: Path, own_cache: Path) -> None:
    make_raw(tmp_path / "plain", n_test=10, gz=False)
    assert readable_root(str(tmp_path / "plain"))[0] == str(tmp_path / "plain")
    assert not own_cache.exists()
    make_raw(tmp_path / "gz", n_test=10, gz=True)
    root, present = readable_root(str(tmp_path / "gz"))
    assert Path(root).parent == own_cache / "datasets" == Path(cache_dir())
    assert present == {"train_images": False, "train_labels": True, "test_images": True, "test_labels": True}
    assert sorted(os.listdir(Path(root) / "MNIST" / "raw")) == [
        "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", "train-labels-idx1-ubyte"]


def test_a_newer_source_refreshes_the_cache(tmp_path: Path) -> None:
    make_raw(tmp_path, n_test=10000)
    first = load_mnist(str(tmp_path), verbose=False).test.tensors[1]
    raw = tmp_path / "MNIST" / "raw"
    new_labels = (np.arange(10000)[::-1] % 10).astype(np.uint8)
    path = write_idx(raw / "t10k-labels-idx1-ubyte", new_labels, 2049, gz=True)
    later = os.path.getmtime(path) + 10
    os.utime(path, (later, later))
    second = load_mnist(str(tmp_path), verbose=False).test.tensors[1]
    assert torch.equal(second, torch.from_numpy(new_labels[-2000:].astype(np.int64)))
    assert not torch.equal(first, second)


def test_plain_preferred_over_gz(tmp_path: Path) -> None:
    images, labels = make_raw(tmp_path, n_test=10000, gz=True)
    raw = tmp_path / "MNIST" / "raw"
    write_idx(raw / "t10k-labels-idx1-ubyte", (labels + 1) % 10, 2049, gz=False)
    split = load_mnist(str(tmp_path), verbose=False)
    assert torch.equal(split.test.tensors[1], torch.from_numpy(((labels[-2000:] + 1) % 10).astype(np.int64)))


@pytest.mark.parametrize("name", ["MNIST", "FashionMNIST"])
def test_offline_split(tmp_path: Path, capsys: pytest.CaptureFixture, name: str) -> None:
    images, labels = make_raw(tmp_path, n_test=10000, gz=True, name=name)
    split = load_mnist(str(tmp_path), flatten=True, name=name)  # type: ignore[arg-type]
    assert split.offline_split
    assert len(split.train) == 8000 and len(split.test) == 2000
    out = capsys.readouterr().out
    assert "training images not found" in out and "first 8000 test images" in out and "last 2000" in out
    assert str(tmp_path) in out and name in out
    assert_close(split.train.tensors[0], normalise(images[:8000], name).reshape(8000, -1))
    assert_close(split.test.tensors[0], normalise(images[8000:], name).reshape(2000, -1))
    assert torch.equal(split.train.tensors[1], torch.from_numpy(labels[:8000].astype(np.int64)))
    assert torch.equal(split.test.tensors[1], torch.from_numpy(labels[8000:].astype(np.int64)))


def test_offline_split_quiet(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_raw(tmp_path, n_test=10000, gz=False)
    (tmp_path / "MNIST" / "raw" / "train-labels-idx1-ubyte").unlink()
    assert load_mnist(str(tmp_path), verbose=False).offline_split
    assert capsys.readouterr().out == ""


def test_missing_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        load_mnist(str(tmp_path / "nowhere"))
    assert isinstance(info.value, FileNotFoundError)
    msg = str(info.value)
    assert str(tmp_path / "nowhere" / "MNIST" / "raw") in msg
    assert "t10k-images-idx3-ubyte[.gz]" in msg and "t10k-labels-idx1-ubyte[.gz]" in msg
    assert "--data-dir" in msg and "IPUXL_DATA" in msg
    with pytest.raises(DataError, match="FashionMNIST/raw"):
        load_mnist(str(tmp_path / "nowhere"), name="FashionMNIST")
    with pytest.raises(InvalidValueError, match="unknown dataset 'CIFAR10'"):
        load_mnist(str(tmp_path), name="CIFAR10")  # type: ignore[arg-type]


@pytest.mark.parametrize("gz", [True, False])
def test_corrupt_magic(tmp_path: Path, gz: bool) -> None:
    make_raw(tmp_path, n_test=10, gz=gz)
    raw = tmp_path / "MNIST" / "raw"
    write_idx(raw / "t10k-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8), 0x0F0F0F0F, gz)
    with pytest.raises(DataFileError, match="corrupt idx file .*t10k-images-idx3-ubyte") as info:
        load_mnist(str(tmp_path))
    assert isinstance(info.value, ValueError)


def test_truncated_gz_and_mismatched_labels(tmp_path: Path) -> None:
    make_raw(tmp_path, n_test=10000, gz=True)
    raw = tmp_path / "MNIST" / "raw"
    data = (raw / "t10k-images-idx3-ubyte.gz").read_bytes()
    (raw / "t10k-images-idx3-ubyte.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFileError, match="cannot decompress .*t10k-images-idx3-ubyte.gz"):
        load_mnist(str(tmp_path), verbose=False)
    make_raw(tmp_path / "other", n_test=10000, gz=False)
    write_idx(tmp_path / "other" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte", np.zeros(9000, np.uint8), 2049, False)
    with pytest.raises(DataFileError, match="10000 test images but 9000 test labels"):
        load_mnist(str(tmp_path / "other"), verbose=False)


def test_resolve_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("IPUXL_DATA", raising=False)
    assert resolve_data_dir(None) == "./data"
    monkeypatch.setenv("IPUXL_DATA", "/some/where")
    assert resolve_data_dir(None) == "/some/where"
    assert resolve_data_dir("explicit") == "explicit"
    make_raw(tmp_path, n_test=10000)
    monkeypatch.setenv("IPUXL_DATA", str(tmp_path))
    assert len(load_mnist(verbose=False).test) == 2000


def test_mnist_loaders(tmp_path: Path) -> None:
    make_raw(tmp_path, n_test=10000)
    train, test, split = mnist_loaders(64, 300, data_dir=str(tmp_path), seed=1, verbose=False)
    assert split.offline_split
    assert len(train) == 8000 // 64 and len(test) == 2000 // 300
    xb, yb = next(iter(train))
    assert xb.shape == (64, 1, 28, 28) and yb.shape == (64,)
    again = next(iter(mnist_loaders(64, 300, data_dir=str(tmp_path), seed=1, verbose=False)[0]))[1]
    assert torch.equal(yb, again)
    assert_close(next(iter(test))[0], split.test.tensors[0][:300])
    _, test_all, _ = mnist_loaders(64, 300, data_dir=str(tmp_path), drop_last=False, flatten=True, verbose=False)
    assert len(test_all) == 7 and next(iter(test_all))[0].shape == (300, 784)


@pytest.mark.skipif(not (REAL_DATA / "MNIST" / "raw").is_dir(), reason="shared MNIST absent")
def test_shared_mnist_offline_split() -> None:
    """The shared data: t10k files and train labels, all .gz, read-only: the offline split."""
    split = load_mnist(str(REAL_DATA), verbose=False)
    assert split.offline_split
    assert len(split.train) == 8000 and len(split.test) == 2000
    for ds in (split.train, split.test):
        x, y = ds.tensors
        assert x.shape[1:] == (1, 28, 28)
        assert int(y.min()) == 0 and int(y.max()) == 9
    x = split.train.tensors[0]
    assert abs(x.mean().item()) < 0.2 and abs(x.std().item() - 1) < 0.2  # normalised with MNIST's own statistics
    assert not torch.equal(split.train.tensors[0][:5], split.test.tensors[0][:5])  # disjoint halves of t10k
