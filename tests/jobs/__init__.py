"""app/jobs: the queue, the service end to end, reliability, exports, job limits."""
