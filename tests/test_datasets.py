"""Tests for ipuxl.datasets using synthetic IDX files and, if present, real MNIST."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from ipuxl import datasets
from ipuxl.datasets import load_mnist, mnist_loaders, read_idx, resolve_data_dir

REAL_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


def write_idx(path: Path, array: np.ndarray, magic: int, gz: bool) -> None:
    """Write ``array`` (uint8) as an IDX file, optionally gzip-compressed."""
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as fh:
            fh.write(payload)
    else:
        path.write_bytes(payload)


def make_mnist(root: Path, n_test: int = 10000, n_train: int = 0, gz: bool = True,
               train_labels: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Create a synthetic raw MNIST folder; returns the test images and labels."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8)
    images[:, 0, 0] = np.arange(n_test) % 256  # position marker
    labels = (np.arange(n_test) % 10).astype(np.uint8)
    write_idx(raw / "t10k-images-idx3-ubyte", images, 2051, gz)
    write_idx(raw / "t10k-labels-idx1-ubyte", labels, 2049, gz)
    if n_train:
        write_idx(raw / "train-images-idx3-ubyte", images[:n_train], 2051, gz)
    if n_train or train_labels:
        count = n_train or 60
        write_idx(raw / "train-labels-idx1-ubyte", labels[:count], 2049, gz)
    return images, labels


def normalise(images: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(images.astype(np.float32)) / 255.0 - 0.1307) / 0.3081


@pytest.mark.parametrize("gz", [True, False])
def test_read_idx_roundtrip(tmp_path: Path, gz: bool) -> None:
    arr = np.arange(3 * 28 * 28, dtype=np.uint32).astype(np.uint8).reshape(3, 28, 28)
    write_idx(tmp_path / "img", arr, 2051, gz)
    path = tmp_path / ("img.gz" if gz else "img")
    np.testing.assert_array_equal(read_idx(str(path), 2051), arr)
    labels = np.array([3, 1, 4], dtype=np.uint8)
    write_idx(tmp_path / "lab", labels, 2049, gz)
    lab_path = tmp_path / ("lab.gz" if gz else "lab")
    np.testing.assert_array_equal(read_idx(str(lab_path), 2049), labels)


def test_plain_preferred_over_gz(tmp_path: Path) -> None:
    write_idx(tmp_path / "lab", np.array([1, 2], dtype=np.uint8), 2049, gz=False)
    write_idx(tmp_path / "lab", np.array([7, 7, 7], dtype=np.uint8), 2049, gz=True)
    assert datasets._find(str(tmp_path), "lab") == str(tmp_path / "lab")


def test_full_split_and_normalisation(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    images, labels = make_mnist(tmp_path, n_test=50, n_train=30, gz=False)
    split = load_mnist(str(tmp_path))
    assert not split.offline_split
    assert capsys.readouterr().out == ""
    x, y = split.test.tensors
    assert x.shape == (50, 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.int64
    torch.testing.assert_close(x[:, 0], normalise(images))
    torch.testing.assert_close(y, torch.from_numpy(labels.astype(np.int64)))
    assert len(split.train) == 30
    # Specific values: 0 -> -0.1307/0.3081, 255 -> (1-0.1307)/0.3081.
    img = np.zeros((1, 28, 28), dtype=np.uint8)
    img[0, 0, 1] = 255
    out = datasets._to_dataset(img, np.array([0], dtype=np.uint8), flatten=True).tensors[0]
    assert out.shape == (1, 784)
    assert out[0, 0].item() == pytest.approx(-0.1307 / 0.3081, abs=1e-6)
    assert out[0, 1].item() == pytest.approx((1 - 0.1307) / 0.3081, abs=1e-6)


def test_offline_split(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    images, labels = make_mnist(tmp_path, n_test=10000, gz=True)
    split = load_mnist(str(tmp_path), flatten=True)
    assert split.offline_split
    assert len(split.train) == 8000 and len(split.test) == 2000
    out = capsys.readouterr().out
    assert "training images not found" in out
    assert "first 8000 test images" in out and "last 2000" in out
    assert str(tmp_path) in out
    torch.testing.assert_close(split.train.tensors[0], normalise(images[:8000]).reshape(8000, -1))
    torch.testing.assert_close(split.test.tensors[0], normalise(images[8000:]).reshape(2000, -1))
    assert torch.equal(split.train.tensors[1], torch.from_numpy(labels[:8000].astype(np.int64)))
    assert torch.equal(split.test.tensors[1], torch.from_numpy(labels[8000:].astype(np.int64)))


def test_offline_split_quiet(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_mnist(tmp_path, n_test=10000, gz=False, train_labels=False)
    assert load_mnist(str(tmp_path), verbose=False).offline_split
    assert capsys.readouterr().out == ""


def test_missing_data_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_mnist(str(tmp_path / "nowhere"))
    msg = str(info.value)
    assert "nowhere" in msg
    assert "t10k-images-idx3-ubyte[.gz]" in msg and "t10k-labels-idx1-ubyte[.gz]" in msg
    assert "--data-dir" in msg and "IPUXL_DATA" in msg


@pytest.mark.parametrize("gz", [True, False])
def test_corrupt_magic(tmp_path: Path, gz: bool) -> None:
    make_mnist(tmp_path, n_test=10, gz=gz)
    raw = tmp_path / "MNIST" / "raw"
    write_idx(raw / "bad", np.zeros((2, 28, 28), dtype=np.uint8), 1234, gz)
    name = "t10k-images-idx3-ubyte" + (".gz" if gz else "")
    (raw / name).unlink()
    (raw / ("bad.gz" if gz else "bad")).rename(raw / name)
    with pytest.raises(ValueError, match="magic number 1234"):
        load_mnist(str(tmp_path))


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "lab"
    path.write_bytes(struct.pack(">II", 2049, 10) + b"\x01\x02")
    with pytest.raises(ValueError, match="corrupt"):
        read_idx(str(path), 2049)
    path.write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="corrupt"):
        read_idx(str(path), 2049)


def test_resolve_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                          capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("IPUXL_DATA", raising=False)
    assert resolve_data_dir(None) == "./data"
    monkeypatch.setenv("IPUXL_DATA", "/some/where")
    assert resolve_data_dir(None) == "/some/where"
    assert resolve_data_dir("explicit") == "explicit"
    make_mnist(tmp_path, n_test=10000)
    monkeypatch.setenv("IPUXL_DATA", str(tmp_path))
    assert len(load_mnist(verbose=False).test) == 2000


def test_mnist_loaders(tmp_path: Path) -> None:
    make_mnist(tmp_path, n_test=10000)
    first = mnist_loaders(64, 300, data_dir=str(tmp_path), seed=1)
    train, test, split = first
    assert split.offline_split
    assert len(train) == 8000 // 64 and len(test) == 2000 // 300
    xb, yb = next(iter(train))
    assert xb.shape == (64, 1, 28, 28) and yb.shape == (64,)
    again = next(iter(mnist_loaders(64, 300, data_dir=str(tmp_path), seed=1)[0]))[1]
    assert torch.equal(yb, again)
    tx, _ = next(iter(test))
    torch.testing.assert_close(tx, split.test.tensors[0][:300])
    _, test_all, _ = mnist_loaders(64, 300, data_dir=str(tmp_path), drop_last=False, flatten=True)
    assert len(test_all) == 7 and next(iter(test_all))[0].shape == (300, 784)


@pytest.mark.skipif(not (REAL_DATA / "MNIST" / "raw").is_dir(), reason="real MNIST absent")
def test_real_offline_mnist() -> None:
    split = load_mnist(str(REAL_DATA), verbose=False)
    assert split.offline_split
    assert len(split.train) == 8000 and len(split.test) == 2000
    for ds in (split.train, split.test):
        x, y = ds.tensors
        assert x.shape[1:] == (1, 28, 28)
        assert int(y.min()) >= 0 and int(y.max()) <= 9
    x = split.train.tensors[0]
    assert abs(x.mean().item()) < 0.2 and abs(x.std().item() - 1) < 0.2
