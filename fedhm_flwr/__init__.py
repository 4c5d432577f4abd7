"""FedHM on Flower: heterogeneous federated learning by low-rank factorization."""
