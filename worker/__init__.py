"""The trainyard worker: claims jobs from the queue and runs them on one device."""
