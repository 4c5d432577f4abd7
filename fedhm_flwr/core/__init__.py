"""The base every layer may use: the project's errors and the one wire contract (record keys, task
and reply encoding, model tensors as Flower Arrays). Nothing here imports the rest of the project."""
