"""The ceiling for bench/api.py: a minimal FastAPI app, run the way `trainyard serve` runs its app
(app/cli/launch.py cmd_serve: `uvicorn.run(app, host=..., port=..., log_level=...)`, nothing else).

`python -m bench.bare_app PORT`. GET /bare is an `async def` route (no thread hop, the framework's
best case); GET /bare-sync is the same as a plain `def` route, run in Starlette's thread pool like
every trainyard route, to show what that hop costs on its own.
"""
import sys

import uvicorn
from fastapi import FastAPI

app = FastAPI()


@app.get("/bare")
async def bare() -> dict:
    return {"ok": True}


@app.get("/bare-sync")
def bare_sync() -> dict:
    return {"ok": True}


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
