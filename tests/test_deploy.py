"""deploy/: the KubeRay manifests, the image, the launcher config and the example GPU job.

Fast and offline (no cluster, no Docker, no network). The KubeRay manifests are validated against
the CRDs' ``openAPIV3Schema`` in ``../shared/reference/kuberay/`` (beside the checkout), translated
to JSON Schema the way the API server reads a structural schema:

- ``x-kubernetes-int-or-string`` → integer or string; ``nullable`` → also null;
- unknown fields are errors (``kubectl apply`` validates strictly), except under
  ``x-kubernetes-preserve-unknown-fields`` or an explicit ``additionalProperties``;
- ``format: int32/int64`` ranges are checked; the CRDs' CEL rules (``x-kubernetes-validations``)
  are not evaluated, and ``metadata`` is checked only for a DNS-1123 name.

The validator is shown to bite on broken copies of the manifests.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SHARED = ROOT.parent / "shared"
CRD_DIR = SHARED / "reference" / "kuberay"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
MANIFESTS = {
    "rayjob": DEPLOY / "kuberay" / "rayjob.yaml",
    "raycluster": DEPLOY / "kuberay" / "raycluster.yaml",
}
RUN_MOUNT = "/mnt/spikeguard"
IMAGE = "spikeguard:latest"

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load(path: Path) -> Any:
    return yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)


# -- CRD schema → JSON Schema ---------------------------------------------------------------------

_FORMATS = jsonschema.FormatChecker(formats=())


@_FORMATS.checks("int32")
def _int32(v: object) -> bool:
    return not isinstance(v, int) or -(2**31) <= v < 2**31


@_FORMATS.checks("int64")
def _int64(v: object) -> bool:
    return not isinstance(v, int) or -(2**63) <= v < 2**63


def structural_to_jsonschema(node: Any, *, strict: bool = True) -> Any:
    """A Kubernetes structural schema (OpenAPI v3 subset + x-kubernetes-*) as a Draft 4 JSON
    Schema."""
    if isinstance(node, list):
        return [structural_to_jsonschema(n, strict=strict) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, val in node.items():
        if key == "properties":  # a map of field names, not of keywords
            out[key] = {
                name: structural_to_jsonschema(sub, strict=strict) for name, sub in val.items()
            }
        elif key in ("items", "additionalProperties", "not") and isinstance(val, dict):
            out[key] = structural_to_jsonschema(val, strict=strict)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [structural_to_jsonschema(n, strict=strict) for n in val]
        elif key.startswith("x-kubernetes-") or key in (
            "nullable",
            "description",
            "example",
            "externalDocs",
        ):
            continue
        else:  # type, format, enum, required, pattern, min/max*, default, …
            out[key] = val
    if node.get("x-kubernetes-int-or-string") and "type" not in node and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        strict
        and "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if node.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _crd(kind: str) -> dict[str, Any]:
    path = CRD_DIR / CRD_FILES[kind]
    if not path.exists():
        pytest.skip(
            f"KubeRay CRDs not found at {CRD_DIR}: CI keeps shared/ beside the checkout "
            "(../shared); without it the manifests cannot be checked against their schemas"
        )
    return _load(path)


@functools.cache
def _validator(kind: str, version: str, strict: bool) -> jsonschema.protocols.Validator:
    crd = _crd(kind)
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    if version not in versions or not versions[version].get("served"):
        raise LookupError(
            f"{kind} {crd['spec']['group']}/{version} is not served by the CRD "
            f"(served: {sorted(n for n, v in versions.items() if v.get('served'))})"
        )
    schema = structural_to_jsonschema(versions[version]["schema"]["openAPIV3Schema"], strict=strict)
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema, format_checker=_FORMATS)


_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def k8s_errors(manifest: Any, *, strict: bool = True) -> list[str]:
    """Why ``manifest`` (a RayJob or RayCluster) would be refused, as 'path: message' lines; [] if
    valid."""
    if not isinstance(manifest, dict):
        return [f"<root>: a manifest is a mapping, got {type(manifest).__name__}"]
    kind, api = manifest.get("kind"), str(manifest.get("apiVersion", ""))
    if kind not in CRD_FILES:
        return [f"kind: {kind!r} is not one of {sorted(CRD_FILES)}"]
    group, _, version = api.partition("/")
    crd = _crd(kind)
    if group != crd["spec"]["group"] or crd["spec"]["names"]["kind"] != kind:
        return [f"apiVersion: {api!r} is not in group {crd['spec']['group']!r}"]
    try:
        validator = _validator(kind, version, strict)
    except LookupError as e:
        return [f"apiVersion: {e}"]
    errors = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(manifest)
    ]
    name = (manifest.get("metadata") or {}).get("name")
    if not isinstance(name, str) or len(name) > 63 or not _DNS1123.match(name):
        errors.append(
            f"metadata.name: {name!r} is not a DNS-1123 label (a-z, 0-9, '-', at most 63)"
        )
    return sorted(errors)


# -- helpers over the manifests -------------------------------------------------------------------


def _manifest(key: str) -> dict[str, Any]:
    return _load(MANIFESTS[key])


def _cluster_spec(m: dict[str, Any]) -> dict[str, Any]:
    return m["spec"]["rayClusterSpec"] if m["kind"] == "RayJob" else m["spec"]


def _pod_specs(m: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], int]]:
    """(group name, pod spec, replicas) of the head ('head', replicas 1) and every worker group."""
    cs = _cluster_spec(m)
    yield "head", cs["headGroupSpec"]["template"]["spec"], 1
    for g in cs.get("workerGroupSpecs", []):
        yield g["groupName"], g["template"]["spec"], int(g.get("replicas", g.get("minReplicas", 0)))


def _quantity(q: Any) -> float:
    """A Kubernetes CPU/count quantity ('64', '500m', 8) as a number."""
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile: continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in (DEPLOY / "Dockerfile").read_text(encoding="utf-8").splitlines():
        s = line.strip()
        if not s or s.startswith("#"):  # Docker drops comment lines, also inside a continuation
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        instr, _, rest = (buf + s).partition(" ")
        out.append((instr.upper(), rest.strip()))
        buf = ""
    return out


def _dockerignored(rel: str) -> bool:
    patterns = [
        ln.strip()
        for ln in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    parts = rel.split("/")
    ignored = False
    for p in patterns:
        neg, p = p.startswith("!"), p.lstrip("!").rstrip("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        hit = any(
            fnmatch.fnmatch(pre, p) or fnmatch.fnmatch(pre, p.replace("**/", ""))
            for pre in prefixes
        )
        if hit:
            ignored = not neg
    return ignored


def image_path_source(image_path: str) -> Path | None:
    """The repository file that deploy/Dockerfile's COPY instructions put at ``image_path``."""
    found = None
    for instr, args in _dockerfile():
        if instr != "COPY":
            continue
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        *srcs, dest = words
        for src in srcs:
            if src == ".":
                if image_path.startswith(dest.rstrip("/") + "/"):
                    rel = image_path[len(dest.rstrip("/")) + 1 :]
                    if (ROOT / rel).exists() and not _dockerignored(rel):
                        found = ROOT / rel
            elif (
                dest == image_path or (dest.endswith("/") and dest + Path(src).name == image_path)
            ) and not _dockerignored(src):
                found = ROOT / src
    return found


def _job_gpu():
    from spikeguard.supervisor.job import load_job

    return load_job(DEPLOY / "job-gpu.yaml")


# -- the manifests against the CRDs
# -----------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(MANIFESTS))
def test_manifest_validates_against_crd(key: str) -> None:
    m = _manifest(key)
    assert m["apiVersion"] == "ray.io/v1"
    assert k8s_errors(m) == []


def _break(key: str, edit) -> list[str]:
    m = copy.deepcopy(_manifest(key))
    edit(m)
    return k8s_errors(m)


@pytest.mark.parametrize(
    "key,edit,expect",
    [
        (
            "raycluster",
            lambda m: m["spec"].pop("headGroupSpec"),
            "'headGroupSpec' is a required property",
        ),
        (
            "rayjob",
            lambda m: m["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].__setitem__(
                "replicas", "two"
            ),
            "'two' is not of type 'integer'",
        ),
        (
            "raycluster",
            lambda m: m["spec"]["workerGroupSpecs"][0].pop("groupName"),
            "'groupName' is a required property",
        ),
        (
            "rayjob",
            lambda m: m["spec"].__setitem__("shutdownAfterJobFinish", True),  # a typo
            "Additional properties are not allowed ('shutdownAfterJobFinish' was unexpected)",
        ),
        (
            "raycluster",
            lambda m: m["spec"]["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0),
            "0 is not of type 'string'",
        ),  # rayStartParams values are strings
        (
            "rayjob",
            lambda m: m["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"][
                "containers"
            ][0]["resources"]["limits"].__setitem__("memory", "512 GiB"),
            "does not match",
        ),  # not a quantity
        (
            "raycluster",
            lambda m: m["spec"]["workerGroupSpecs"][0].__setitem__("maxReplicas", 2**31),
            "int32",
        ),
        ("raycluster", lambda m: m.__setitem__("apiVersion", "ray.io/v2"), "not served"),
        ("rayjob", lambda m: m["metadata"].__setitem__("name", "Spikeguard_Job"), "DNS-1123"),
    ],
)
def test_validator_rejects_broken_manifests(key: str, edit, expect: str) -> None:
    errors = _break(key, edit)
    assert any(expect in e for e in errors), errors


def test_int_or_string_and_nullable_translation() -> None:
    schema = structural_to_jsonschema(
        {
            "type": "object",
            "properties": {
                "port": {"x-kubernetes-int-or-string": True},
                "maybe": {"type": "string", "nullable": True},
                "free": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": True,
                    "properties": {"a": {}},
                },
            },
        }
    )
    v = jsonschema.Draft4Validator(schema)
    assert v.is_valid({"port": 8080, "maybe": None, "free": {"a": 1, "anything": 2}})
    assert v.is_valid({"port": "http"})
    assert not v.is_valid({"port": 1.5})
    assert not v.is_valid({"maybe": 3})
    assert not v.is_valid({"unknown": 1})


# -- the example job and how the manifests run it
# ---------------------------------------------------


def test_job_gpu_loads_with_the_real_job_model() -> None:
    from spikeguard.policies import load_policy

    job = _job_gpu()
    assert (job.workers, job.gpus_per_worker, job.backend, job.resolved_backend()) == (
        8,
        1,
        "nccl",
        "nccl",
    )
    assert job.run_dir.startswith(RUN_MOUNT + "/"), "run_dir must be on the shared volume, absolute"
    assert job.policy == "default"
    load_policy(job.policy)
    assert job.notify.slack is not None and job.notify.slack.channel
    assert job.entrypoint.startswith("-m spikeguard."), (
        "runs from any directory, in the image as here"
    )


def test_rayjob_entrypoint_runs_spikeguard_on_a_job_the_image_contains() -> None:
    spec = _manifest("rayjob")["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["spikeguard", "submit"]
    assert argv[argv.index("--address") + 1] == "auto"
    job_path = argv[2]
    src = image_path_source(job_path)
    assert src is not None, f"deploy/Dockerfile puts nothing at {job_path}"
    assert src.resolve() == (DEPLOY / "job-gpu.yaml").resolve()
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0


def test_image_layout_has_what_pip_install_needs() -> None:
    for rel in (
        "pyproject.toml",
        "README.md",
        "workers/session.py",
        "policies/default.yaml",
        "supervisor/cli.py",
        "examples/gpt_diverge.py",
    ):
        assert not _dockerignored(rel), rel
        assert image_path_source("/app/" + rel) == ROOT / rel
    for rel in (
        ".git/HEAD",
        ".venv/bin/python",
        "runs/x/journal.jsonl",
        "spikeguard.egg-info/PKG-INFO",
    ):
        assert _dockerignored(rel), rel


@pytest.mark.parametrize("key", sorted(MANIFESTS))
def test_manifests_agree_with_image_volume_secret_and_job(key: str) -> None:
    m = _manifest(key)
    pvc = _load(DEPLOY / "kuberay" / "pvc.yaml")
    secret = _load(DEPLOY / "kuberay" / "secret.example.yaml")
    job = _job_gpu()
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert job.run_dir.startswith(RUN_MOUNT + "/")
    gpus_total = 0.0
    for group, pod, replicas in _pod_specs(m):
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in pod.get("volumes", [])
            if "persistentVolumeClaim" in v
        }
        for c in pod["containers"]:
            assert c["image"] == IMAGE, (group, c["name"])
            mounts = {vm["mountPath"]: vm["name"] for vm in c.get("volumeMounts", [])}
            assert claims.get(mounts.get(RUN_MOUNT)) == pvc["metadata"]["name"], (
                f"{group}/{c['name']} does not mount the run-dir PVC at {RUN_MOUNT}"
            )
            env = {e["name"]: e for e in c.get("env", [])}
            if "SLACK_BOT_TOKEN" in env:
                assert "value" not in env["SLACK_BOT_TOKEN"], (
                    "the token comes from a Secret, not a literal"
                )
                assert group == "head", (
                    f"{group}: only the supervisor (on the head) needs the Slack token"
                )
            res = c.get("resources", {})
            gpu = res.get("limits", {}).get("nvidia.com/gpu")
            if gpu is not None:
                assert res.get("requests", {}).get("nvidia.com/gpu", gpu) == gpu, (
                    "GPU requests must equal limits"
                )
                per_pod = int(gpu)
                gpus_total += per_pod * replicas
                ranks_per_pod = per_pod // job.gpus_per_worker
                assert _quantity(res["limits"]["cpu"]) >= ranks_per_pod * job.cpus_per_worker, (
                    f"{group}: {per_pod} GPUs but too few CPUs for {ranks_per_pod} ranks of the job"
                )
                mounts_shm = any(vm["mountPath"] == "/dev/shm" for vm in c.get("volumeMounts", []))
                assert mounts_shm, f"{group}: NCCL needs a larger /dev/shm"
        if group == "head":
            ref = {e["name"]: e for e in pod["containers"][0].get("env", [])}["SLACK_BOT_TOKEN"]
            sk = ref["valueFrom"]["secretKeyRef"]
            assert sk["name"] == secret["metadata"]["name"] and sk["key"] in secret["stringData"]
    assert gpus_total >= job.workers * job.gpus_per_worker
    cs = _cluster_spec(m)
    assert cs["headGroupSpec"]["rayStartParams"].get("num-cpus") == "0"
    assert cs["rayVersion"] == _from_tag_version()


# -- the image ------------------------------------------------------------------------------------


def _from_tag_version() -> str:
    froms = [a for i, a in _dockerfile() if i == "FROM"]
    assert len(froms) == 1, froms
    m = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py3\d+-gpu", froms[0])
    assert m, f"FROM {froms[0]}: expected an official rayproject/ray GPU tag"
    return m.group(1)


def test_dockerfile_base_matches_ray_and_installs_non_editable_as_non_root() -> None:
    import ray

    version = _from_tag_version()
    assert version.split(".")[:2] == ray.__version__.split(".")[:2], (version, ray.__version__)
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"#.*tag MUST match the Ray version", text), (
        "say that the tag must match the cluster's Ray"
    )
    instrs = _dockerfile()
    pips = [a for i, a in instrs if i == "RUN" and "pip install" in a]
    assert any(re.search(r"pip install [^&]*/app\b", a) for a in pips)
    assert not any(re.search(r"(\s-e\s|--editable)", a) for a in pips)
    users = [a for i, a in instrs if i == "USER"]
    assert users and users[-1] not in ("root", "0")


# -- the cluster launcher -------------------------------------------------------------------------


def test_ray_cluster_config_is_valid_for_ray_up() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load(DEPLOY / "ray-cluster.yaml")
    validate_config(
        prepare_config(copy.deepcopy(config))
    )  # what `ray up` does before anything else
    setup = " ; ".join(config["setup_commands"])
    assert re.search(r"pip install (-q )?~/spikeguard\b", setup) and "-e " not in setup
    assert f"ray[default]=={_from_tag_version()}" in setup
    broken = dict(config, setup_command=["typo"])
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


# -- every file -----------------------------------------------------------------------------------


def test_every_yaml_file_in_deploy_parses() -> None:
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
    assert len(files) >= 6, files
    for p in files:
        docs = list(yaml.safe_load_all(p.read_text(encoding="utf-8")))
        assert docs and all(isinstance(d, dict) for d in docs), p


_TOKEN = re.compile(r"xox[abposr]-|hooks\.slack\.com/services/", re.I)


def test_no_secret_in_deploy_and_the_secret_example_holds_a_placeholder() -> None:
    for p in sorted(DEPLOY.rglob("*")):
        if p.is_file():
            hit = _TOKEN.search(p.read_text(encoding="utf-8", errors="replace"))
            assert not hit, f"{p.relative_to(ROOT)}: {hit.group(0)!r} looks like a Slack secret"
    secret = _load(DEPLOY / "kuberay" / "secret.example.yaml")
    assert secret["kind"] == "Secret" and "data" not in secret
    assert all("REPLACE" in v for v in secret["stringData"].values())
    assert "PLACEHOLDER" in (DEPLOY / "kuberay" / "secret.example.yaml").read_text()


def test_readme_gives_the_three_ways_and_its_links_exist() -> None:
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    for cmd in (
        "spikeguard submit job.yaml --address auto",
        "ray job submit --address http://HEAD:8265 --working-dir . -- "
        "spikeguard submit job.yaml --address auto",
        "kubectl apply -f deploy/kuberay/rayjob.yaml",
        "kubectl apply -f deploy/kuberay/raycluster.yaml",
        "docker build -f deploy/Dockerfile -t spikeguard:latest .",
        "valueFrom",
    ):
        assert cmd in text, cmd
    for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (DEPLOY / link).exists(), link
