"""app/lifecycle: the collector, deletion, retention, host caches, the store."""
