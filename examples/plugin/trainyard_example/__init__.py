"""An example trainyard plugin package: a model (tinynet), a dataset (blobs) and a training
program (cifar_loop), registered as entry points in pyproject.toml."""
