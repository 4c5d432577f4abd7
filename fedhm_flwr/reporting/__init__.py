"""A run's outputs: metric rows and checkpoints (``results``), TensorBoard/MLflow (``tracking``),
summaries and plots over runs (``summary``), verdicts on paired intervals (``verdicts``)."""
