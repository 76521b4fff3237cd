"""worker/: the job process (training, inference, data, devices, ranks) and the supervisor."""
