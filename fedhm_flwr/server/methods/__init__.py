"""One Flower-free method per algorithm (``method.Method``): FedHM, HeteroFL, FedRolex, PriSM, FedAvg,
FedLoRA, HeteroTune. See docs/METHODS.md."""
