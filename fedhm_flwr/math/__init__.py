"""Pure functions on tensors and numbers: factorization and recovery, width slicing, kernel
sampling, LoRA hand-out, CMGA, aggregation, defences, DP accounting, sBN sums, level assignment and
the local training loops. No Flower import, no model registry."""
