"""Layers the models are built from beyond PyTorch's own: FedHM's factorized conv and linear layers
(docs/METHODS.md#fedhm-factorization; the factor math is :mod:`fedhm_flwr.math.lowrank`'s) and
PriSM's sampled sub-layers (docs/METHODS.md#prism; the kernel math is :mod:`fedhm_flwr.math.prism`'s) and
HeteroFL's :class:`Scaler` (docs/METHODS.md#heterofl; the width rules are :mod:`fedhm_flwr.math.width`'s).
No Flower import.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn

from fedhm_flwr.math.lowrank import (
    SVD,
    conv_a_weight,
    conv_b_weight,
    factors_frobenius_sq,
    layer_svd,
    matrix_to_conv,
    split_factors,
)
from fedhm_flwr.math.prism import reply_factors
from fedhm_flwr.math.width import check_rate

__all__ = [
    "FactorizedConv2d",
    "FactorizedLinear",
    "PrismConv2d",
    "PrismLinear",
    "Scaler",
    "factorize_modules",
    "factorized_modules",
    "make_scaler",
    "prismify_modules",
]


# --------------------------------------------------------------------------------------------
# Factorized layers
# --------------------------------------------------------------------------------------------


def _pair(value: int | tuple[int, ...], what: str) -> int:
    """A square int parameter (``3`` or ``(3, 3)``) as one int."""
    if isinstance(value, int):
        return value
    if len(value) == 2 and value[0] == value[1]:
        return int(value[0])
    raise ValueError(f"only square {what} is supported, got {value}")


_Factorized = TypeVar("_Factorized", "FactorizedConv2d", "FactorizedLinear")


def _initialised(
    layer: _Factorized, full: nn.Conv2d | nn.Linear, rank: int, svd: SVD | None, spectral_init: bool
) -> _Factorized:
    """``layer`` (the factorized form of ``full``) on ``full``'s device and dtype, its factors the
    rank-``rank`` cut of ``full``'s weight (or of ``svd``) when ``spectral_init``, its bias ``full``'s."""
    layer.to(device=full.weight.device, dtype=full.weight.dtype)
    if spectral_init:
        layer.load_factors(*split_factors(svd if svd is not None else layer_svd(full.weight), rank))
    if full.bias is not None:
        assert layer.a.bias is not None  # (the layer was built with a bias when ``full`` has one)
        with torch.no_grad():
            layer.a.bias.copy_(full.bias)
    return layer


class FactorizedConv2d(nn.Module):
    """Rank-``r`` factorized square-kernel conv: ``b`` (1×k, r filters) then ``a`` (k×1, n filters).

    Replaces ``nn.Conv2d(m, n, k, stride=s, padding=p, bias=...)`` (groups 1, dilation 1). The
    bias, if any, lives on ``a``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        rank: int,
        stride: int = 1,
        padding: int = 0,
        bias: bool = False,
    ) -> None:
        super().__init__()
        k = kernel_size
        if not (1 <= rank <= k * min(in_channels, out_channels)):
            raise ValueError(f"rank must be in [1, {k * min(in_channels, out_channels)}], got {rank}")
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, k
        self.rank = rank
        # Registration order b, a makes state_dict keys L.b.weight, L.a.weight, L.a.bias.
        self.b = nn.Conv2d(in_channels, rank, (1, k), stride=(1, stride), padding=(0, padding), bias=False)
        self.a = nn.Conv2d(rank, out_channels, (k, 1), stride=(stride, 1), padding=(padding, 0), bias=bias)

    @classmethod
    def from_conv(
        cls, conv: nn.Conv2d, rank: int, svd: SVD | None = None, spectral_init: bool = True
    ) -> FactorizedConv2d:
        """Factorize ``conv`` at ``rank``, spectrally initialised from its weight (or ``svd``)."""
        if conv.groups != 1 or _pair(conv.dilation, "dilation") != 1:
            raise ValueError("only convs with groups=1 and dilation=1 can be factorized")
        if not isinstance(conv.padding, tuple) or conv.padding_mode != "zeros":
            raise ValueError(f"only explicit zero padding is supported, got {conv.padding!r} ({conv.padding_mode})")
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            _pair(conv.kernel_size, "kernel"),
            rank,
            stride=_pair(conv.stride, "stride"),
            padding=_pair(conv.padding, "padding"),
            bias=conv.bias is not None,
        )
        return _initialised(layer, conv, rank, svd, spectral_init)

    @property
    def full_shape(self) -> tuple[int, int, int, int]:
        """Shape of the recovered weight ``(n, m, k, k)``."""
        return (self.out_channels, self.in_channels, self.kernel_size, self.kernel_size)

    def load_factors(self, A: Tensor, B: Tensor) -> None:
        """Set the weights from ``A (n·k, r)`` and ``B (r, m·k)``."""
        with torch.no_grad():
            self.b.weight.copy_(conv_b_weight(B, self.in_channels, self.kernel_size))
            self.a.weight.copy_(conv_a_weight(A, self.out_channels, self.kernel_size))

    def factors(self) -> tuple[Tensor, Tensor]:
        """``(A, B)`` as matrices (differentiable views of the weights)."""
        n, k, r = self.out_channels, self.kernel_size, self.rank
        A = self.a.weight.squeeze(-1).permute(0, 2, 1).reshape(n * k, r)
        B = self.b.weight.reshape(r, self.in_channels * k)
        return A, B

    def product(self) -> Tensor:
        """The recovered full weight ``A B`` folded to ``(n, m, k, k)`` (differentiable)."""
        A, B = self.factors()
        return matrix_to_conv(A @ B, self.out_channels, self.in_channels, self.kernel_size)

    def frobenius_sq(self) -> Tensor:
        """``‖A B‖_F²`` (for Frobenius decay), computed on r×r matrices."""
        return factors_frobenius_sq(*self.factors())

    def forward(self, x: Tensor) -> Tensor:
        return self.a(self.b(x))


class FactorizedLinear(nn.Module):
    """Rank-``r`` factorized linear layer: ``b = Linear(in, r)`` then ``a = Linear(r, out)``."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True) -> None:
        super().__init__()
        if not (1 <= rank <= min(in_features, out_features)):
            raise ValueError(f"rank must be in [1, {min(in_features, out_features)}], got {rank}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.b = nn.Linear(in_features, rank, bias=False)
        self.a = nn.Linear(rank, out_features, bias=bias)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, rank: int, svd: SVD | None = None, spectral_init: bool = True
    ) -> FactorizedLinear:
        """Factorize ``linear`` at ``rank``, spectrally initialised from its weight (or ``svd``)."""
        layer = cls(linear.in_features, linear.out_features, rank, bias=linear.bias is not None)
        return _initialised(layer, linear, rank, svd, spectral_init)

    @property
    def full_shape(self) -> tuple[int, int]:
        """Shape of the recovered weight ``(out, in)``."""
        return (self.out_features, self.in_features)

    def load_factors(self, A: Tensor, B: Tensor) -> None:
        """Set the weights from ``A (out, r)`` and ``B (r, in)``."""
        with torch.no_grad():
            self.b.weight.copy_(B)
            self.a.weight.copy_(A)

    def factors(self) -> tuple[Tensor, Tensor]:
        """``(A, B)`` (the weights themselves)."""
        return self.a.weight, self.b.weight

    def product(self) -> Tensor:
        """The recovered full weight ``A B`` of shape ``(out, in)`` (differentiable)."""
        return self.a.weight @ self.b.weight

    def frobenius_sq(self) -> Tensor:
        """``‖A B‖_F²`` (for Frobenius decay), computed on r×r matrices."""
        return factors_frobenius_sq(*self.factors())

    def forward(self, x: Tensor) -> Tensor:
        return self.a(self.b(x))


def factorized_modules(model: nn.Module) -> Iterator[tuple[str, FactorizedConv2d | FactorizedLinear]]:
    """The ``(name, module)`` pairs of every factorized layer in ``model`` (e.g. for Frobenius decay)."""
    for name, module in model.named_modules():
        if isinstance(module, (FactorizedConv2d, FactorizedLinear)):
            yield name, module


def factorize_modules(
    model: nn.Module,
    ranks: Mapping[str, int],
    svds: Mapping[str, SVD] | None = None,
    spectral_init: bool = True,
) -> nn.Module:
    """Replace the named layers of ``model`` in place by factorized layers of the given ranks.

    Factors are spectrally initialised from each layer's current weight (or from ``svds``).
    ``spectral_init=False`` skips the SVDs and leaves PyTorch's default initialisation on the
    factors: use it when a (hybrid) state dict is loaded right afterwards. Returns ``model``.
    """
    for name, rank in ranks.items():
        module = model.get_submodule(name)
        svd = svds.get(name) if svds is not None else None
        if isinstance(module, nn.Conv2d):
            new: nn.Module = FactorizedConv2d.from_conv(module, int(rank), svd, spectral_init)
        elif isinstance(module, nn.Linear):
            new = FactorizedLinear.from_linear(module, int(rank), svd, spectral_init)
        else:
            raise ValueError(f"layer {name!r} is a {type(module).__name__}; only Conv2d and Linear can be factorized")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model


# --------------------------------------------------------------------------------------------
# The Scaler
# --------------------------------------------------------------------------------------------


class Scaler(nn.Module):
    """HeteroFL's Scaler: ``x / rate`` in training, identity in evaluation (no parameters)."""

    #: acts in training only; statistics gathered for evaluation must see it off (bn_stats)
    training_only = True

    def __init__(self, rate: float = 1.0) -> None:
        super().__init__()
        self.rate = check_rate(rate)

    def forward(self, x: Tensor) -> Tensor:
        return x / self.rate if self.training and self.rate != 1.0 else x

    def extra_repr(self) -> str:
        return f"rate={self.rate:g}"


def make_scaler(rate: float, on: bool) -> nn.Module:
    """A :class:`Scaler` when ``on``, else an identity (neither has a state dict entry)."""
    return Scaler(rate) if on else nn.Identity()


# --------------------------------------------------------------------------------------------
# PriSM's sampled sub-layers (docs/METHODS.md#prism; the kernel math is fedhm_flwr.math.prism's)
# --------------------------------------------------------------------------------------------


def _rows_buffer(rows: Sequence[int] | Tensor | None, out: int) -> Tensor | None:
    if rows is None:
        return None
    values = sorted(int(j) for j in (rows.tolist() if isinstance(rows, Tensor) else rows))
    if not values or len(set(values)) != len(values) or values[0] < 0 or values[-1] >= out:
        raise ValueError(f"rows must be distinct indices in [0, {out}), got {values}")
    return torch.tensor(values, dtype=torch.long)


class _PrismLayer(nn.Module):
    """Shared part of the sampled sub-layers: ``u(v(x))``, scattered into the full output when
    only the ``rows`` are computed, plus the full-length ``bias``."""

    out_features: int
    rows: Tensor | None
    bias: nn.Parameter | None
    u: nn.Conv2d | nn.Linear
    v: nn.Conv2d | nn.Linear

    def _finish(self, y: Tensor, dim: int) -> Tensor:
        if self.rows is not None:
            shape = list(y.shape)
            shape[dim] = self.out_features
            y = y.new_zeros(shape).index_copy(dim, self.rows, y)
        if self.bias is not None:
            view = [1] * y.ndim
            view[dim] = -1
            y = y + self.bias.view(view)
        return y

    def factors(self) -> tuple[Tensor, Tensor]:
        """``(U'_I[J], V'_I)`` as matrices (differentiable views of the weights)."""
        return reply_factors(self.u.weight, self.v.weight)

    def frobenius_sq(self) -> Tensor:
        """``‖Σ_{i∈I} u'_i v'_iᵀ‖_F²`` over the trained factors (paper eq. 6), on r×r products."""
        U, V = self.factors()
        return ((U.t() @ U) * (V @ V.t())).sum()


class PrismConv2d(_PrismLayer):
    """A conv ``(n, m, k, k)`` restricted to ``rank`` principal kernels: ``v`` (k×k conv, ``rank``
    filters, the original stride/padding) then ``u`` (1×1 conv, ``n`` filters, or ``|rows|``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        rank: int,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        bias: bool = False,
        rows: Sequence[int] | Tensor | None = None,
    ) -> None:
        super().__init__()
        R = min(out_channels, in_channels * kernel_size * kernel_size)
        if not 1 <= rank <= R:
            raise ValueError(f"rank must be in [1, {R}], got {rank}")
        self.in_channels, self.out_features, self.kernel_size, self.rank = in_channels, out_channels, kernel_size, rank
        self.register_buffer("rows", _rows_buffer(rows, out_channels), persistent=False)
        computed = out_channels if self.rows is None else self.rows.numel()
        self.v = nn.Conv2d(in_channels, rank, kernel_size, stride, padding, bias=False)
        self.u = nn.Conv2d(rank, computed, 1, bias=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_channels))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def like(cls, conv: nn.Conv2d, rank: int, rows: Sequence[int] | Tensor | None = None) -> PrismConv2d:
        """An (uninitialised) sub-layer of ``conv``'s geometry."""
        if conv.groups != 1 or conv.dilation not in ((1, 1), 1) or conv.padding_mode != "zeros":
            raise ValueError("only convs with groups=1, dilation=1 and zero padding can be decomposed")
        k = conv.kernel_size[0]
        if conv.kernel_size != (k, k) or not isinstance(conv.padding, tuple):
            raise ValueError(f"only square kernels with explicit padding, got {conv.kernel_size}, {conv.padding!r}")
        stride, padding = cast("tuple[int, int]", conv.stride), cast("tuple[int, int]", conv.padding)  # (2-D conv)
        return cls(conv.in_channels, conv.out_channels, k, rank, stride, padding, conv.bias is not None, rows).to(
            device=conv.weight.device, dtype=conv.weight.dtype
        )

    def forward(self, x: Tensor) -> Tensor:
        return self._finish(self.u(self.v(x)), 1)


class PrismLinear(_PrismLayer):
    """A linear layer ``(out, in)`` restricted to ``rank`` principal kernels: ``v = Linear(in, rank)``
    then ``u = Linear(rank, out)`` (or ``|rows|`` outputs)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        bias: bool = True,
        rows: Sequence[int] | Tensor | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= rank <= min(in_features, out_features):
            raise ValueError(f"rank must be in [1, {min(in_features, out_features)}], got {rank}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.register_buffer("rows", _rows_buffer(rows, out_features), persistent=False)
        computed = out_features if self.rows is None else self.rows.numel()
        self.v = nn.Linear(in_features, rank, bias=False)
        self.u = nn.Linear(rank, computed, bias=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def like(cls, linear: nn.Linear, rank: int, rows: Sequence[int] | Tensor | None = None) -> PrismLinear:
        """An (uninitialised) sub-layer of ``linear``'s geometry."""
        return cls(linear.in_features, linear.out_features, rank, linear.bias is not None, rows).to(
            device=linear.weight.device, dtype=linear.weight.dtype
        )

    def forward(self, x: Tensor) -> Tensor:
        return self._finish(self.u(self.v(x)), -1)


def prismify_modules(model: nn.Module, layers: Mapping[str, Mapping[str, Any]]) -> nn.Module:
    """Replace the named ``Conv2d`` / ``Linear`` layers of ``model`` in place by sampled sub-layers
    (``{name: {"rank": r, "rows": [...] (optional)}}``, the model spec's ``prism`` entry). The new
    layers are uninitialised: a state dict is loaded right after. Returns ``model``."""
    for name, entry in layers.items():
        module = model.get_submodule(name)
        rank, rows = int(entry["rank"]), entry.get("rows")
        if isinstance(module, nn.Conv2d):
            new: nn.Module = PrismConv2d.like(module, rank, rows)
        elif isinstance(module, nn.Linear):
            new = PrismLinear.like(module, rank, rows)
        else:
            raise ValueError(f"layer {name!r} is a {type(module).__name__}; only Conv2d and Linear can be decomposed")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return model
