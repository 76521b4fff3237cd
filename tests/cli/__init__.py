"""app/cli and app/client: the command line, the Python client, the launcher, gpu-check."""
