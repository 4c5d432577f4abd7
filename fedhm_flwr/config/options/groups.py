"""The declarations of the ``model`` and ``dataset`` groups: the keys every option of a group shares
(``conf/config.yaml``'s ``model`` keys, a dataset's limits and switches) and the keys of a kind of
option (a transformer's sizes and backbone, a ViT's patches, a folder source's location and images).

A group's files differ in some values (``conf/model/cnn.yaml``: ``width: 16``, ``resnet18.yaml``:
64): the keys a group file sets for itself are named in the declaration's ``per_group``; every
other value of a group file equals the declared default (``tests/test_declarations.py``). A folder
source's keys are the data spec's (:data:`fedhm_flwr.data.spec.SOURCE_DEFAULTS`, checked by its
:func:`~fedhm_flwr.data.spec.source_field_problem`): their defaults and rules are taken from there.
A ``model.factorize`` rule's entries are the models' (``fedhm_flwr.models.rules``, checked on the
config check's torch path when a rule is set, :func:`fedhm_flwr.config.methods.validate_user_model`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import model_validator
from pydantic.dataclasses import dataclass
from typing_extensions import Self

from fedhm_flwr.config.options.declare import DECLARED, Flag, Int, OneOf, Refused, Text, option, parse
from fedhm_flwr.data.catalog import DATASETS, EXTERNAL_DATASETS, FOLDER_SOURCES
from fedhm_flwr.data.spec import SOURCE_DEFAULTS, SOURCE_RULES, source_field_problem

__all__ = ["ARCH_NAMES", "DATASET_NAMES", "DatasetGroup", "ModelGroup", "parse_dataset", "parse_model"]

#: the keys of ``fedhm_flwr.models.ARCHS``, named here so that checking a config imports no torch
ARCH_NAMES = ("cnn", "resnet18", "resnet34", "minilm", "vit", "custom")
DATASET_NAMES = (*DATASETS, *EXTERNAL_DATASETS, *FOLDER_SOURCES)
_SIZE = "null (the architecture's default) or an integer >= 1"
_BACKBONES = ("auto", "pretrained", "random")


@dataclass(frozen=True, config=DECLARED)
class ModelGroup:
    """``model``: the architecture and the keys every model group shares (a user's model among them)."""

    #: the keys each ``conf/model/*.yaml`` sets for itself
    per_group: ClassVar[tuple[str, ...]] = ("arch", "width")

    arch: Annotated[Text, OneOf(ARCH_NAMES)] = option("custom", "the architecture (custom: model.target's)")
    width: Int | None = option(None, "the model's width (null: the architecture's default)", allowed=_SIZE, ge=1)
    target: Text | None = option(None, "package.module:factory of a user's nn.Module (null: the built-in arch)")
    kwargs: dict[str, Any] | None = option(
        {}, "keyword arguments of the factory", allowed="a mapping of the factory's keyword arguments"
    )
    static_bn: Flag = option(True, "a model.target's BatchNorm -> static BN (sBN); false: running statistics")
    factorize: dict[str, Any] | None = option(
        {"include": None, "exclude": None, "types": None, "keep_first": None, "head": None, "pointwise": None},
        "which layers FedHM factorizes (a rule of fedhm_flwr.models.rules; null entries: the model's default)",
        allowed="a mapping (include, exclude, types, ...)",
    )

    @model_validator(mode="after")
    def _sizes(self) -> Self:
        if self.target is None and self.arch == "custom":
            raise Refused(
                "target",
                "'package.module:factory' with model=custom, "
                "e.g. model.target=torchvision.models:resnet18 model.kwargs.num_classes=10",
            )
        return self


@dataclass(frozen=True, config=DECLARED)
class TransformerModel(ModelGroup):
    """``model=minilm``, ``model=vit``: a transformer's sizes and its backbone."""

    per_group: ClassVar[tuple[str, ...]] = ("arch", "width", "depth", "heads", "backbone")

    depth: Int | None = option(None, "leading encoder layers kept (null: all)", allowed=_SIZE, ge=1)
    heads: Int | None = option(None, "attention heads (null: the architecture's default)", allowed=_SIZE, ge=1)
    backbone: Annotated[Text, OneOf(_BACKBONES)] = option(
        "pretrained", "pretrained: the packaged or `make pretrain`'s weights | random: seeded init | auto"
    )
    backbone_seed: Int = option(0, "the seed of a random backbone", ge=0)


@dataclass(frozen=True, config=DECLARED)
class ViTModel(TransformerModel):
    """``model=vit``: a small ViT for 28x28 images."""

    per_group: ClassVar[tuple[str, ...]] = ("arch", "width", "depth", "heads", "backbone", "patch", "mlp_ratio")

    patch: Int = option(7, "patch size in pixels", ge=1)
    mlp_ratio: Int = option(2, "MLP width / model width", ge=1)


MODEL_GROUPS: dict[str, type[ModelGroup]] = {"minilm": TransformerModel, "vit": ViTModel}


def parse_model(values: Mapping[str, Any]) -> ModelGroup:
    """The ``model`` group: its architecture's declaration; a user's model (``arch`` custom) may keep
    the keys of the group it replaced (the narrowest declaration holding them)."""
    kind = MODEL_GROUPS.get(str(values.get("arch")), ModelGroup)
    if values.get("arch") == "custom":
        kinds = (ModelGroup, TransformerModel, ViTModel)
        kind = next((k for k in kinds if set(values) <= set(k.__dataclass_fields__)), ViTModel)
    return parse(kind, values, "model")


@dataclass(frozen=True, config=DECLARED)
class DatasetGroup:
    """``dataset``: which data, how much of it, and the client's augmentation."""

    per_group: ClassVar[tuple[str, ...]] = ("name", "augment")

    name: Annotated[Text, OneOf(DATASET_NAMES)] = option("fashion_mnist", "the dataset or data source")
    data_dir: Text | None = option(None, "the dataset's folder (null: the default location)")
    download: Flag = option(False, "allow torchvision to download where the machine may")
    max_train_examples: Int = option(0, ">0: seeded subset of the training set, for quick runs", ge=0)
    max_test_examples: Int = option(0, ">0: seeded subset of the test set", ge=0)
    augment: Flag = option(False, "random crop and horizontal flip in client training")


def _source(key: str, meaning: str) -> Any:
    """A folder source's key: its default and allowed values are the data spec's."""
    return option(SOURCE_DEFAULTS["hf_disk"][key], meaning, allowed=SOURCE_RULES[key][1])


@dataclass(frozen=True, config=DECLARED)
class FolderSource(DatasetGroup):
    """``dataset=imagefolder``: images in the folder ``dataset.path``."""

    per_group: ClassVar[tuple[str, ...]] = ("name", "augment", "image_size", "channels")

    path: Any = _source("path", "the folder (required)")
    image_size: Any = _source("image_size", "pixels of the square images the model sees")
    channels: Any = _source("channels", "3: RGB, 1: grayscale")
    test_fraction: Any = _source("test_fraction", "without a test split: this share of each class is the test set")
    train_split: Any = _source("train_split", "the training split")
    test_split: Any = _source("test_split", "null: test, val or validation when present, else test_fraction")

    @model_validator(mode="after")
    def _spec(self) -> Self:
        for key in SOURCE_DEFAULTS[self.name]:
            problem = source_field_problem(key, getattr(self, key))
            if problem is not None:
                raise Refused(key, problem)
        if self.data_dir is not None:
            raise Refused("data_dir", "null: dataset.path says where the data is")
        return self


@dataclass(frozen=True, config=DECLARED)
class HFDiskSource(FolderSource):
    """``dataset=hf_disk``: a Hugging Face ``datasets`` folder written by save_to_disk."""

    image_column: Any = _source("image_column", "an Image feature, or H x W [x C] / C x H x W arrays")
    label_column: Any = _source("label_column", "a ClassLabel, integers 0..C-1, or strings")


DATASET_GROUPS: dict[str, type[DatasetGroup]] = {"imagefolder": FolderSource, "hf_disk": HFDiskSource}


def parse_dataset(values: Mapping[str, Any]) -> DatasetGroup:
    """The ``dataset`` group: its data source's declaration."""
    return parse(DATASET_GROUPS.get(str(values.get("name")), DatasetGroup), values, "dataset")
