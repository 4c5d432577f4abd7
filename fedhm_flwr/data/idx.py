"""Fashion-MNIST from its IDX files (the Debian package ``dataset-fashion-mnist``), read with numpy."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from fedhm_flwr.data.files import (
    DATA_DIR_ENV,
    FASHION_FILES,
    FASHION_MNIST_SYSTEM_DIR,
    fashion_candidate_dirs,
    fashion_files,
)


def read_idx(path: Path) -> np.ndarray:
    """Parse one IDX file (``.gz`` or plain) into a numpy array.

    Written by hand on purpose: IDX is a 4-byte magic (0, 0, dtype code, ndim),
    ndim big-endian uint32 sizes, then the raw data. torchvision's FashionMNIST
    class cannot read the Debian files where they lie: it insists on its own
    ``<root>/FashionMNIST/raw/`` layout with *uncompressed*, md5-checked files (and
    its ``read_sn3_pascalvincent_tensor`` only opens uncompressed files), so using it
    would mean copying and gunzipping 30 MB first. numpy + gzip is ten lines.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    code, ndim = data[2], data[3]
    if code not in dtypes or ndim < 1:
        raise ValueError(f"{path}: unsupported IDX type code {code:#x} / ndim {ndim}")
    header = 4 + 4 * ndim
    shape = tuple(int(s) for s in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(dtypes[code])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(f"{path}: IDX payload has {len(data) - header} bytes, header says {expected}")
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def load_fashion_mnist_labels(split: str, data_dir: str | None) -> np.ndarray:
    """The labels (int64) of a split, as :func:`load_fashion_mnist` gives them, without its images (the
    launcher's partition check needs no image)."""
    found = fashion_files(split, data_dir)
    if found is None:
        return load_fashion_mnist(split, data_dir)[1]  # (raises its FileNotFoundError)
    return read_idx(found[1]).astype(np.int64)


def load_fashion_mnist(split: str, data_dir: str | None) -> tuple[np.ndarray, np.ndarray]:
    img_stem, lbl_stem = FASHION_FILES[split]
    found = fashion_files(split, data_dir)
    if found is not None:
        img, lbl = found
        images = read_idx(img)
        labels = read_idx(lbl).astype(np.int64)
        if images.ndim != 3 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"{img}, {lbl}: inconsistent Fashion-MNIST files")
        return images[..., None], labels  # NHWC, C = 1
    looked = fashion_candidate_dirs(data_dir)
    where = "\n  ".join(str(p) for p in looked)
    raise FileNotFoundError(
        f"Fashion-MNIST ({split}) not found: need {img_stem}[.gz] and {lbl_stem}[.gz]. "
        f"Looked in:\n  {where}\n"
        f"Install them with `apt-get install dataset-fashion-mnist` (puts them in "
        f"{FASHION_MNIST_SYSTEM_DIR}), or set data_dir / ${DATA_DIR_ENV} to a folder "
        f"that holds them."
    )
