"""The Kubernetes chart under deploy/: rendered with every values file docs/containers.md documents, each object
checked against the Kubernetes API's schemas, and the properties of issue 43 asserted on what was rendered.

No cluster and no helm binary here (nor in CI): the chart is rendered by Helm's own Go engine through
helm-python-sdk (Helm's Go SDK as a shared library in its wheel, called with ctypes), and checked by
kubernetes-validate against the OpenAPI schemas of the oldest Kubernetes the chart supports and the newest
kubernetes-validate knows, strictly (a field Kubernetes does not know is an error, as `kubectl apply
--validate=strict` makes it). Both come from the test extra; a missing one fails this module, never skips it.
The Go library runs in a child process of its own: a Go runtime loaded into the test process would stay there,
its threads and signal handlers under every later test that forks a job process.
"""
import atexit
import copy
import functools
import importlib.util
import json
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from tests.helpers.service import ROOT
from trainyard.app import __version__
from trainyard.app.core.settings import Settings

CHART = ROOT / "deploy" / "trainyard"
VALUES_DIR = ROOT / "deploy" / "values"
DOCS = ROOT / "docs" / "containers.md"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile.gpu"
RELEASE, NAMESPACE = "trainyard", "ml"
OLDEST = "1.29.0"  # Chart.yaml's kubeVersion floor
VERSIONS = (OLDEST, kubernetes_validate.latest_version())
GRACE_S = Settings.model_fields["grace_s"].default
GPU = "nvidia.com/gpu"
# The chart's own values.yaml alone, then each file of deploy/values/ laid over it; whether its workers use GPUs.
CASES = {"values.yaml": True, "postgres-s3.yaml": True, "cpu.yaml": False}
# Names of settings that are credentials: never a literal value in a pod's environment.
CREDENTIAL = re.compile(r"token|password|secret|database_url|access_key", re.I)


# ---- rendering ---------------------------------------------------------------------------------------------------

assert importlib.util.find_spec("helm_python"), "helm-python-sdk renders the chart: pip install -e '.[test]'"

# The child: one request a line on stdin ({"op": "render" or "merge", "values", "release"}), one answer a line.
RENDERER = """
import json, sys
import helm_python
chart = helm_python.Chart.load(sys.argv[1])
for line in sys.stdin:
    ask = json.loads(line)
    try:
        if ask["op"] == "render":
            answer = {"ok": chart.render(ask["values"], name=ask["release"], namespace=ask["namespace"])}
        else:
            answer = {"ok": chart.merge_values(ask["values"])}
    except helm_python.HelmError as exc:
        answer = {"refused": str(exc)}
    print(json.dumps(answer), flush=True)
"""


class Refused(Exception):
    """Helm refused the values: a template's `fail`, or values.schema.json."""


@functools.cache
def _renderer() -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", RENDERER, str(CHART)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    atexit.register(child.communicate)  # its stdin closed, it ends
    return child


def helm(op: str, values: dict, release: str = RELEASE) -> dict:
    child = _renderer()
    assert child.stdin and child.stdout
    child.stdin.write(json.dumps({"op": op, "values": values, "release": release, "namespace": NAMESPACE}) + "\n")
    child.stdin.flush()
    line = child.stdout.readline()
    assert line, f"the renderer ended (status {child.poll()}): see its error above"
    answer = json.loads(line)
    if "refused" in answer:
        raise Refused(answer["refused"])
    return answer["ok"]


def merged(base: dict, over: dict) -> dict:
    """Helm's coalescing of a second values file over a first: mappings merge key by key, the rest is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def case_values(case: str, overrides: dict | None = None) -> dict:
    """The values a `helm install -f deploy/values/<case>` passes (none for values.yaml), plus overrides."""
    given = {} if case == "values.yaml" else yaml.safe_load((VALUES_DIR / case).read_text())
    return merged(given, overrides or {})


@functools.cache
def _render(case: str, overrides_json: str, release: str) -> tuple[dict, ...]:
    out = helm("render", case_values(case, json.loads(overrides_json)), release)
    return tuple(doc for name, text in sorted(out.items()) if name.endswith((".yaml", ".yml"))
                 for doc in yaml.safe_load_all(text) if doc)


def render(case: str, overrides: dict | None = None, release: str = RELEASE) -> list[dict]:
    return copy.deepcopy(list(_render(case, json.dumps(overrides or {}, sort_keys=True), release)))


def effective(case: str) -> dict:
    """The values the release runs with: the chart's defaults under the case's file."""
    return helm("merge", case_values(case))


def one(objects: list[dict], kind: str, component: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind
                and o["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    return found


def pod_specs(objects: list[dict]) -> dict[str, dict]:
    """Each workload's pod template, by its component label."""
    return {o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]
            for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")}


def containers(template: dict) -> list[dict]:
    return template["spec"].get("initContainers", []) + template["spec"]["containers"]


def env_of(container: dict) -> dict[str, dict]:
    """name -> the env entry; the last of a repeated name wins, as in the kubelet."""
    return {e["name"]: e for e in container.get("env", [])}


def api_container(objects: list[dict]) -> dict:
    (c,) = one(objects, "Deployment", "api")["spec"]["template"]["spec"]["containers"]
    return c


def worker_pod(objects: list[dict]) -> dict:
    return one(objects, "StatefulSet", "worker")["spec"]["template"]


def worker_container(objects: list[dict]) -> dict:
    (c,) = worker_pod(objects)["spec"]["containers"]
    return c


def port_number(container: dict, port: int | str) -> int:
    """A probe's or a Service's port, a number or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def dockerfile_user() -> tuple[int, int]:
    (uid, gid), = re.findall(r"^USER (\d+):(\d+)$", DOCKERFILE.read_text(), re.M)
    return int(uid), int(gid)


every_case = pytest.mark.parametrize("case", list(CASES))


# ---- the values files and the schemas ----------------------------------------------------------------------------

def test_the_documented_values_files_are_the_ones_rendered():
    documented = set(re.findall(r"deploy/values/([\w.-]+\.ya?ml)", DOCS.read_text()))
    on_disk = {p.name for p in VALUES_DIR.iterdir()}
    assert documented == on_disk == set(CASES) - {"values.yaml"}
    assert "deploy/trainyard" in DOCS.read_text()


def test_the_chart_is_trainyards_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert chart["kubeVersion"] == f">={OLDEST}-0"


# Every optional branch of the templates at once, on top of each case.
EVERY_OPTION = {
    "imagePullSecrets": [{"name": "registry"}],
    "data": {"persistence": {"storageClass": "local-path"}},
    "storage": {"s3": {"credentialsFromSecret": False}},
    "env": {"TRAINYARD_LEASE_S": "20"},
    "api": {"allowedHosts": ["trainyard.example"], "allowedOrigins": ["https://ops.example"],
            "secretEnv": {"TRAINYARD_MLFLOW_TOKEN": "mlflow-token"}, "env": {"TRAINYARD_MAX_UPLOADS": "50"},
            "nodeSelector": {"kubernetes.io/os": "linux"}, "affinity": {"nodeAffinity": {}},
            "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]},
    "worker": {"runtimeClassName": "nvidia", "jobMemoryBytes": 51539607552, "secretEnv": {"HF_TOKEN": "hf-token"},
               "env": {"NCCL_SOCKET_IFNAME": "eth0"}, "nodeSelector": {"nvidia.com/gpu.present": "true"},
               "affinity": {"nodeAffinity": {}}},
}


@every_case
@pytest.mark.parametrize("options", [{}, EVERY_OPTION], ids=["as-is", "every-option"])
def test_every_object_is_valid_for_the_kubernetes_versions_supported(case, options):
    objects = render(case, options)
    assert {"Deployment", "Service", "StatefulSet", "PodDisruptionBudget"} <= {o["kind"] for o in objects}
    errors = []
    for version in VERSIONS:
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {exc.message} at "
                              f"{'.'.join(map(str, exc.path))}")
    assert not errors, "\n".join(errors)


def test_the_validation_refuses_what_kubernetes_would():
    """The check above is strict: an unknown field (a typo, a field of a newer Kubernetes) fails it."""
    deployment = one(render("values.yaml"), "Deployment", "api")
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbes"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="startupProbes"):
        kubernetes_validate.validate(deployment, OLDEST, strict=True)


# ---- the API -----------------------------------------------------------------------------------------------------

@every_case
def test_the_api_is_probed_on_healthz_at_its_port(case):
    objects = render(case)
    api = api_container(objects)
    port = int(env_of(api)["TRAINYARD_PORT"]["value"])
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = api[kind]["httpGet"]
        assert probe["path"] == "/healthz" and port_number(api, probe["port"]) == port, kind
    service = one(objects, "Service", "api")
    (service_port,) = service["spec"]["ports"]
    assert port_number(api, service_port["targetPort"]) == port
    assert service["spec"]["selector"].items() <= one(objects, "Deployment", "api")["spec"]["template"][
        "metadata"]["labels"].items()
    # The workers wait for the API at its Service, whose name the API answers to (its DNS-rebinding guard).
    url = env_of(worker_container(objects))["TRAINYARD_URL"]["value"]
    assert url == f"http://{service['metadata']['name']}:{service_port['port']}"
    allowed = env_of(api)["TRAINYARD_ALLOWED_HOSTS"]["value"].split(",")
    assert service["metadata"]["name"] in allowed and "localhost" in allowed
    assert api["args"][0] == "serve" and env_of(api)["TRAINYARD_HOST"]["value"] == "0.0.0.0"


def test_the_api_answers_the_hosts_users_browse_to():
    api = api_container(render("values.yaml", {"api": {"allowedHosts": ["trainyard.example"]}}))
    assert "trainyard.example" in env_of(api)["TRAINYARD_ALLOWED_HOSTS"]["value"].split(",")


# ---- the workers -------------------------------------------------------------------------------------------------

@every_case
def test_the_workers_are_probed_with_their_own_health_check(case):
    """docker-compose.yml's worker health check: the workers alive, not hung, not unavailable (status files). The
    liveness probe leaves out the last: a restart would forget a device that failed under a job."""
    compose = yaml.safe_load(COMPOSE.read_text())["services"]["worker"]["healthcheck"]["test"]
    assert compose[0] == "CMD"
    worker = worker_container(render(case))
    for kind in ("startupProbe", "readinessProbe"):
        assert worker[kind]["exec"]["command"] == compose[1:], kind
    assert worker["livenessProbe"]["exec"]["command"] == [*compose[1:], "--liveness"]


@every_case
def test_one_worker_per_gpu_and_the_gpus_from_the_device_plugin(case):
    objects = render(case)
    worker = worker_container(objects)
    requests, limits = worker["resources"]["requests"], worker["resources"].get("limits", {})
    others = [c for component, t in pod_specs(objects).items() if component != "worker" for c in containers(t)]
    if CASES[case]:
        assert int(requests[GPU]) == int(limits[GPU]) == 1
        # gpu-workers: one `trainyard worker --device cuda:0` per GPU that NVML lists in the pod, each with
        # CUDA_VISIBLE_DEVICES=<its UUID> (docker/entrypoint.sh). The device plugin's NVIDIA_VISIBLE_DEVICES
        # must reach it untouched.
        assert worker["args"] == ["gpu-workers"]
        assert not {"NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"} & set(env_of(worker))
    else:
        assert GPU not in requests and GPU not in limits
        assert worker["args"] == ["worker", "--device", "cpu"]
        others.append(worker)
    for c in others:  # no GPU of the node's runtime for a pod the device plugin gave none
        assert GPU not in c["resources"]["requests"] and GPU not in c["resources"].get("limits", {})
        assert env_of(c)["NVIDIA_VISIBLE_DEVICES"]["value"] == "void", c["name"]


def test_several_gpus_to_a_pod():
    worker = worker_container(render("values.yaml", {"worker": {"gpusPerPod": 4}}))
    assert int(worker["resources"]["requests"][GPU]) == int(worker["resources"]["limits"][GPU]) == 4


@every_case
def test_a_pod_is_a_host(case):
    """A multi-GPU job borrows only its host's workers, whose GPUs must be in its pod: the pod's name is the host's,
    and its address is where the ranks of a job spread over pods reach it."""
    env = env_of(worker_container(render(case)))
    assert env["TRAINYARD_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["TRAINYARD_NODE_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@every_case
def test_a_stopped_pod_gives_its_workers_their_grace(case):
    """On SIGTERM a worker lets its job checkpoint for TRAINYARD_GRACE_S and requeues it: Kubernetes must not
    SIGKILL it before, nor after a grace the worker does not have."""
    pod = worker_pod(render(case))
    env = env_of(pod["spec"]["containers"][0])
    grace = Settings(grace_s=env["TRAINYARD_GRACE_S"]["value"]).grace_s if "TRAINYARD_GRACE_S" in env else GRACE_S
    assert grace >= GRACE_S
    assert pod["spec"]["terminationGracePeriodSeconds"] >= grace + 10


def test_the_pods_grace_follows_the_workers():
    pod = worker_pod(render("values.yaml", {"worker": {"graceSeconds": 300}}))
    assert float(env_of(pod["spec"]["containers"][0])["TRAINYARD_GRACE_S"]["value"]) == 300
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 310


@every_case
def test_dev_shm_is_memory_for_nccl(case):
    pod = worker_pod(render(case))
    (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"


@every_case
def test_a_disruption_budget_covers_the_workers(case):
    objects = render(case)
    (budget,) = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= worker_pod(objects)["metadata"]["labels"].items()
    assert budget["spec"]["maxUnavailable"] >= 1  # a drain proceeds, one pod (its jobs requeued) at a time
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a broken worker never blocks one


# ---- every pod ---------------------------------------------------------------------------------------------------

@every_case
def test_no_root(case):
    uid, gid = dockerfile_user()
    for component, template in pod_specs(render(case)).items():
        pod = template["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid and pod["fsGroup"] == gid, component
        for c in containers(template):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), c["name"]
            assert sc.get("runAsNonRoot", True) is True and sc.get("runAsUser", uid) == uid, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), c["name"]


@every_case
def test_resource_requests_on_every_container(case):
    for template in pod_specs(render(case)).values():
        for c in containers(template):
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
            assert "memory" in c["resources"]["limits"], c["name"]


@every_case
def test_the_image_is_trainyards_release(case):
    image = effective(case)["image"]
    tag = image["tag"] or __version__
    for template in pod_specs(render(case)).values():
        for c in containers(template):
            assert c["image"] == f"{image['repository']}:{tag}", c["name"]
    assert tag == __version__  # no documented values file pins another release


def test_an_image_tag_of_ones_own():
    objects = render("values.yaml", {"image": {"repository": "registry.example/trainyard", "tag": "0.1.0-cu128"}})
    for template in pod_specs(objects).values():
        assert {c["image"] for c in containers(template)} == {"registry.example/trainyard:0.1.0-cu128"}


@every_case
def test_credentials_come_from_the_secret(case):
    objects = render(case)
    secret = effective(case)["secret"]["name"]
    assert not [o for o in objects if o["kind"] == "Secret"]  # never a token in a values file or the release
    for template in pod_specs(objects).values():
        for c in containers(template):
            for name, entry in env_of(c).items():
                if CREDENTIAL.search(name):
                    assert "value" not in entry and entry["valueFrom"]["secretKeyRef"]["name"] == secret, name
    api, worker = env_of(api_container(objects)), env_of(worker_container(objects))
    assert api["TRAINYARD_API_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "api-token"
    # A worker's job processes inherit its environment, and they run the users' code: no admin token there.
    assert "TRAINYARD_API_TOKEN" not in worker


def test_a_credential_in_a_values_file_is_refused():
    for key in ("TRAINYARD_API_TOKEN", "TRAINYARD_DATABASE_URL", "AWS_SECRET_ACCESS_KEY"):
        with pytest.raises(Refused, match=f"{key} is a credential: put it in the Secret"):
            render("values.yaml", {"worker": {"env": {key: "hunter2"}}})


def test_more_settings_from_the_secret():
    objects = render("values.yaml", {"api": {"secretEnv": {"TRAINYARD_MLFLOW_TOKEN": "mlflow-token"}}})
    entry = env_of(api_container(objects))["TRAINYARD_MLFLOW_TOKEN"]
    assert entry["valueFrom"]["secretKeyRef"] == {"name": "trainyard", "key": "mlflow-token"}
    assert "TRAINYARD_MLFLOW_TOKEN" not in env_of(worker_container(objects))


@every_case
def test_the_literal_settings_are_trainyards(case):
    """Every TRAINYARD_* value the chart writes is a setting trainyard has, and one it accepts."""
    for template in pod_specs(render(case)).values():
        for c in containers(template):
            literal = {n.removeprefix("TRAINYARD_").lower(): e["value"] for n, e in env_of(c).items()
                       if n.startswith("TRAINYARD_") and "value" in e}
            assert set(literal) <= set(Settings.model_fields), c["name"]
            Settings(**literal)


@every_case
def test_pods_get_no_service_links_and_no_api_credentials(case):
    """Service links would set <SERVICE>_PORT=tcp://...: a Service named `trainyard` would set TRAINYARD_PORT."""
    for component, template in pod_specs(render(case)).items():
        assert template["spec"]["enableServiceLinks"] is False, component
        assert template["spec"]["automountServiceAccountToken"] is False, component


# ---- the database and the files ----------------------------------------------------------------------------------

def data_volume(template: dict) -> dict:
    (mount,) = [m for m in template["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/data"]
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
    return volume


@pytest.mark.parametrize("case", [c for c in CASES if not merged(yaml.safe_load((CHART / "values.yaml").read_text()),
                                                                  case_values(c))["database"]["external"]])
def test_sqlite_on_one_claim_and_one_node(case):
    objects = render(case)
    (claim,) = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    api, worker = pod_specs(objects)["api"], pod_specs(objects)["worker"]
    assert data_volume(api)["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert data_volume(worker)["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "TRAINYARD_DATABASE_URL" not in env_of(api["spec"]["containers"][0])
    # WAL needs one kernel: the workers go to the API's node.
    (term,) = worker["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= api["metadata"]["labels"].items()
    assert one(objects, "Deployment", "api")["spec"]["strategy"]["type"] == "Recreate"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_postgres_and_a_bucket():
    objects = render("postgres-s3.yaml")
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    templates = pod_specs(objects)
    for component in ("api", "worker", "db-upgrade"):
        env = env_of(templates[component]["spec"]["containers"][0])
        assert env["TRAINYARD_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["key"] == "database-url", component
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3"} <= set(env), component
        Settings(storage_url=env["TRAINYARD_STORAGE_URL"]["value"])  # a URL trainyard takes
        assert data_volume(templates[component])["emptyDir"] is not None  # only a cache of the bucket
    assert "affinity" not in templates["worker"]["spec"]  # workers on any GPU node
    job = one(objects, "Job", "db-upgrade")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["db", "upgrade"]


@pytest.mark.parametrize("overrides, refusal", [
    ({"data": {"persistence": {"enabled": False}}}, "would each have a database of their own"),
    ({"database": {"external": True}, "data": {"persistence": {"enabled": False}}}, "would live in each pod's"),
    ({"database": {"upgradeJob": True}}, "SQLite upgrades itself"),
    ({"env": {"TRAINYARD_GRACE_S": "60"}}, "set worker.graceSeconds rather than TRAINYARD_GRACE_S"),
])
def test_settings_that_cannot_work_are_refused(overrides, refusal):
    with pytest.raises(Refused, match=re.escape(refusal)):
        render("values.yaml", overrides)


@pytest.mark.parametrize("overrides, refusal", [
    ({"worker": {"gpusperpod": 2}}, "additional properties 'gpusperpod' not allowed"),
    ({"env": {"TRAINYARD_MAX_UPLOAD_BYTES": 2147483648}}, "want string"),  # Go would write 2.147483648e+09
    ({"worker": {"stopMarginSeconds": 0}}, "stopMarginSeconds"),
    ({"storage": {"url": "gs://bucket"}}, "storage/url"),
])
def test_the_values_schema_refuses_what_the_chart_would_get_wrong(overrides, refusal):
    with pytest.raises(Refused, match=re.escape(refusal)):
        render("values.yaml", overrides)


def test_large_numbers_reach_the_pods_whole():
    env = env_of(worker_container(render("values.yaml", {"worker": {"jobMemoryBytes": 51539607552}})))
    assert Settings(job_memory_bytes=env["TRAINYARD_JOB_MEMORY_BYTES"]["value"]).job_memory_bytes == 51539607552


def test_release_names():
    """A release named otherwise keeps its objects apart; one named like the chart is not doubled."""
    names = {o["metadata"]["name"] for o in render("values.yaml", release="team-a")}
    assert names == {"team-a-trainyard-api", "team-a-trainyard-worker", "team-a-trainyard-data"}
    assert {o["metadata"]["name"] for o in render("values.yaml")} == {
        "trainyard-api", "trainyard-worker", "trainyard-data"}
