"""app/spec: the job spec and model sizes."""
