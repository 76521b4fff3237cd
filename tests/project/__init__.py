"""The project as a whole: the house rules and layering, docs and README, packaging, install on other Pythons
and the oldest torch, the container, the first hour."""
