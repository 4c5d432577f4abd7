"""The attacks the server may ask a node to simulate (``failures.attack.kind``): their names only,
read by the config check (no torch) and the client; what each does is in
:mod:`fedhm_flwr.math.attacks` and :mod:`fedhm_flwr.client.hostile`."""

KINDS = ("none", "scale", "sign_flip", "label_flip", "gaussian", "malformed")
#: attacks that change the update after training (label_flip changes the data instead)
UPDATE_ATTACKS = ("scale", "sign_flip", "gaussian")
#: ``malformed``: the classes of malformed reply a hostile device sends (``failures.attack.malformed``,
#: or ``random``: one drawn per reply), each refused by the server's reply checks
MALFORMED_KINDS = (
    "int-arrays",
    "float64-array",
    "lying-shape",
    "wrong-shape",
    "oversized-bytes",
    "truncated-bytes",
    "bad-header",
    "fortran-order",
    "other-stype",
    "nan-values",
    "inf-values",
    "huge-values",
    "extra-key",
    "missing-key",
    "inf-examples",
    "nan-examples",
    "fractional-examples",
    "float-examples",
    "huge-examples",
    "zero-examples",
    "negative-examples",
    "missing-examples",
    "list-examples",
    "nan-counts",
    "short-counts",
    "float-counts",
    "negative-counts",
    "counts-off",
    "nan-loss",
    "inf-seconds",
    "accuracy-above-1",
    "other-level",
    "extra-metric",
    "extra-record",
    "missing-metrics",
    "missing-arrays",
    "metrics-as-config",
)
