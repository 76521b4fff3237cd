"""Running the service: `serve` (the API), `worker` (one device), `up` (both, stopped together), and
`db` (the database schema: `db upgrade`, `db current`)."""
import os
import sys

from trainyard.app.core import device_names
from trainyard.app.core.settings import get_settings


def _listen_options(p) -> None:
    p.add_argument("--host", help="the address the API listens on (default: TRAINYARD_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, help="the API's port (default: TRAINYARD_PORT or 8000)")


def add_commands(sub) -> None:
    s = sub.add_parser("serve", help="run the API server")
    _listen_options(s)
    s.add_argument("--log-level", default="info", help="uvicorn's: critical, error, warning, info, debug, trace")
    s.add_argument("--workers", type=int, default=1,
                   help="server processes sharing the port (one of them runs the lease reaper)")
    s.set_defaults(fn=cmd_serve)
    w = sub.add_parser("worker", help="run a worker bound to one device")
    w.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    w.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    w.add_argument("--max-jobs", type=int, help="exit after running this many jobs")
    w.add_argument("--for-job", type=int, metavar="ID", help="an allocation's worker (trainyard slurm-agent starts "
                   "it): take this job alone, and exit once it ends")
    w.set_defaults(fn=cmd_worker)
    u = sub.add_parser("up", help="run the server and one worker per GPU (or a CPU worker)")
    _listen_options(u)
    u.add_argument("--cpu-workers", type=int, default=1, help="CPU workers to start when there is no GPU")
    u.set_defaults(fn=cmd_up)
    d = sub.add_parser("db", help="the database schema: upgrade it to this release's, or show its revision")
    d.add_argument("action", choices=["upgrade", "current"], help="upgrade: migrate the database to this release's "
                   "schema; current: show its revision and this release's")
    d.set_defaults(fn=cmd_db)


def cmd_serve(args) -> int:
    import uvicorn

    from trainyard.app.api import create_app
    settings = get_settings()
    _schema_ready(settings, "serve")
    host, port = args.host or settings.host, args.port or settings.port
    settings = _guarded(settings, host)
    if args.workers > 1:  # each process builds its app from the same environment
        uvicorn.run("trainyard.app.api:create_app", factory=True, workers=args.workers,
                    fd=_listening_socket(host, port), log_level=args.log_level)
    else:
        uvicorn.run(create_app(settings), host=host, port=port, log_level=args.log_level)
    return 0


def _guarded(settings, host: str):
    """The settings to serve with: a server listening beyond loopback never runs open. With no
    TRAINYARD_API_TOKEN it makes the admin token in its data directory (app/core/operator_token.py) and uses it."""
    from trainyard.app.core import operator_token
    if settings.api_token or operator_token.loopback(host):
        return settings
    token, made = operator_token.ensure(settings.data_dir)
    where = operator_token.path(settings.data_dir).resolve()
    print(f"trainyard serve: listening on {host} with no TRAINYARD_API_TOKEN, so every request needs the admin "
          f"token {'made now and ' if made else ''}kept in {where} (readable by its owner only): send it as "
          "'Authorization: Bearer <token>', or set TRAINYARD_API_TOKEN to a token of your own", file=sys.stderr)
    return settings.model_copy(update={"api_token": token})


def _listening_socket(host: str, port: int) -> int:
    """The port's socket for several server processes, with TCP_NODELAY, which the connections it accepts
    inherit. uvicorn's own socket for `workers` lacks it: a keep-alive response written in two parts
    then waits ~40 ms for the client's delayed ACK (Nagle's algorithm)."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock.detach()


def cmd_worker(args) -> int:
    # Imported here: client commands must not pay for the worker's imports.
    try:
        import torch  # noqa: F401 - only to say what is missing, before the worker's own imports fail on it
    except ImportError:
        raise SystemExit("trainyard worker: torch is not installed here; a worker host needs the worker extra: "
                         "pip install 'trainyard[worker]' (or keep this host's own torch >= 2.9 and add "
                         "torchvision and safetensors)") from None
    from trainyard.worker.supervisor.main import main as worker_main
    settings, device = get_settings(), args.device
    if args.for_job is not None:  # inside a Slurm allocation: the node's name and address, the task's device
        from trainyard.app.clusters import slurm
        settings, device = slurm.in_allocation(settings, device)
    return worker_main(settings, device, burst=args.burst, max_jobs=args.max_jobs, for_job=args.for_job)


def cmd_db(args) -> int:
    from trainyard.app.db import make_engine, migrate
    settings = get_settings()
    settings.ensure_dirs()
    engine = make_engine(settings.db_url)
    try:
        if args.action == "upgrade":
            try:
                before, after = migrate.upgrade(engine)
            except migrate.SchemaBehind as exc:  # a database no release made: said in one line, as at start
                raise SystemExit(f"trainyard db upgrade: {exc}") from None
            print(f"database schema: {before or 'empty'} -> {after}" if before != after
                  else f"database schema: {after}, up to date")
        else:
            now, wanted = migrate.current(engine), migrate.head()
            print(f"database schema: {now or 'empty'}; this trainyard: {wanted}" +
                  ("" if now == wanted else f"; run `{migrate.UPGRADE_COMMAND}`"))
    finally:
        engine.dispose()
    return 0


def _schema_ready(settings, role: str) -> None:
    """Upgrade an embedded database, or stop here with what to run when a shared one is behind."""
    from trainyard.app.db import make_engine, migrate
    settings.ensure_dirs()
    engine = make_engine(settings.db_url)
    try:
        migrate.prepare(engine)
    except migrate.SchemaBehind as exc:
        raise SystemExit(f"trainyard {role}: {exc}") from None
    finally:
        engine.dispose()


def cmd_up(args) -> int:
    """The server plus one worker per visible CUDA device (or CPU workers), stopped together on Ctrl-C."""
    from trainyard.app.fleet.gpu_order import visible_cuda_count
    from trainyard.app.launcher import Service
    settings = get_settings()
    _schema_ready(settings, "up")  # once, before the server and the workers start together
    n_gpus = visible_cuda_count()
    devices = [device_names.cuda(i) for i in range(n_gpus)] if n_gpus else ["cpu"] * args.cpu_workers
    # Resolved here: the processes see the same data dir whatever directory they are started from.
    env = {**os.environ, "TRAINYARD_DATA_DIR": str(settings.data_dir.resolve())}
    svc = Service(env, args.port or settings.port, host=args.host or settings.host)
    svc.start_server(wait=False, log_level="info")
    for d in devices:
        svc.start_worker(d, wait=False)
    url = f"http://{svc.host}:{svc.port}"
    print(f"trainyard: dashboard at {url}/, API at {url} (its docs at /docs, health at /healthz), workers on "
          f"{', '.join(devices)}; Ctrl-C stops all", file=sys.stderr)
    code = svc.supervise()
    svc.stop(settings.grace_s + 5)
    return code
