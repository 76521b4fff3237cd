"""What every other part of the service builds on: settings, errors, job and sweep states, client text, free
ports, device names, plugins, the data directory's layout, the artifact store and the operators' admin token.

May import: nothing else of trainyard (the standard library, pydantic, boto3 only)."""
