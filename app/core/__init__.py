"""What every other part of the service builds on: settings, errors, job and sweep states, client text, free
ports, device names, plugins, the data directory's layout, the artifact store, the operators' admin token and the
names both sides of the HTTP API use (wire).

May import: nothing else of trainyard (the standard library, pydantic, boto3 only)."""
