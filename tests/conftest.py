"""Shared fixtures: the PostgreSQL-backed Dagster instance and quiet, seeded torch."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PG_URL = os.environ.get("PRODRL_TEST_PG_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs three workers and their servers on two cores: OpenMP threads that spin while they wait
# (libgomp's default) take the cores from everyone else (a torch loop ran 2.4x faster beside two busy
# processes with passive waiting). Set before torch is first loaded here (the xdist workers and every
# subprocess inherit it); the Makefile sets it for the controller too. Results do not change: the same
# threads split the same work.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


@pytest.fixture(scope="session")
def pg_url() -> str:
    """The test database, in a schema of this test session's own (concurrent runs don't collide)."""
    import psycopg2

    from prodrl_pipelines.config.preflight import libpq_dsn

    libpq = libpq_dsn(PG_URL)
    try:
        conn = psycopg2.connect(libpq, connect_timeout=3)
    except Exception as e:  # a hard failure: these tests must run against PostgreSQL
        pytest.fail(f"PostgreSQL not reachable at {PG_URL} ({e}); set PRODRL_TEST_PG_URL (see README)")
    schema = f"prodrl_test_{os.getpid()}"
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}")
    sep = "&" if "?" in PG_URL else "?"
    yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    with conn.cursor() as cur:
        cur.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    conn.close()


@pytest.fixture
def pg_instance(tmp_path, pg_url, monkeypatch):
    """A Dagster instance on PostgreSQL configured by the repo's own dagster.yaml, wiped first."""
    from dagster import DagsterInstance

    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_PG_URL", pg_url)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    instance = DagsterInstance.from_config(str(home))

    def clean():
        instance.wipe()
        for key in instance.get_dynamic_partitions("rounds"):
            instance.delete_dynamic_partition("rounds", key)

    clean()
    yield instance
    clean()  # leave the shared database as we found it
    instance.dispose()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for modules whose servers and engines share the 2 cores with test threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """A tiny lab policy (tokenizer + Qwen3-MoE, 5 SFT steps), built once per session; read-only."""
    from prodrl_pipelines.lab.warmstart import build_base_policy

    return build_base_policy(tmp_path_factory.mktemp("tiny") / "base", size="tiny", sft_steps=5, progress=False)


# the agent-loop warm start of tools_policy_dir: a demo-size model, few steps, every demonstrated turn a
# call (spaced, as the template writes it) then a text answer; ~15 s on one core
TOOLS_POLICY_SFT = dict(agent_loop=True, steps=150, batch_size=16, n_tasks=2000, format_noise=0.0, compact_noise=0.0)


@pytest.fixture(scope="session")
def tools_policy_dir(tmp_path_factory):
    """A lab policy that calls tools: ``arithmetic_tools`` warm-started on the agent loop (an ``add(a,
    b)`` call on each user turn, a text answer after the tool's result; lab.arithmetic_tools), its
    template rendering the tool definitions. Serve it with ``--reply-parser qwen3``. Built once per
    session (seeded: the same weights every build); read-only."""
    from prodrl_pipelines.lab.warmstart import build_base_policy

    return build_base_policy(tmp_path_factory.mktemp("tools_policy") / "base", size="demo", seed=0, progress=False,
                             task="arithmetic_tools", sft=TOOLS_POLICY_SFT)


@pytest.fixture(scope="session")
def tiny_exports(tiny_policy_dir, tmp_path_factory):
    """The tiny policy exported as bf16 and as NVFP4 W4A4 (what managed servers serve in tests)."""
    from prodrl_pipelines.quant.export import export_policy

    root = tmp_path_factory.mktemp("tiny_exports")
    out = {}
    for scheme in ("bf16", "nvfp4-w4a4"):
        out[scheme] = root / scheme
        export_policy(tiny_policy_dir, out[scheme], scheme, calibration_prompts=[[1, 5, 6, 7, 8, 9] * 4] * 4)
    return out


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on a free loopback port, with fake credentials in the environment."""
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                            "AWS_EC2_METADATA_DISABLED", "AWS_SESSION_TOKEN", "AWS_PROFILE")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.pop("AWS_PROFILE", None)
    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                pytest.fail(f"moto_server exited with {proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)
        else:
            pytest.fail("moto_server did not start listening")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def bucket(s3_endpoint) -> str:
    """A fresh bucket on the moto server."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="module")
def model_dir(tiny_policy_dir):
    """The tiny policy's directory (modules may override it)."""
    return tiny_policy_dir


@pytest.fixture(scope="module")
def engine(model_dir):
    """A LocalEngine on ``model_dir``, one per module (servers under test may swap its weights)."""
    from prodrl_pipelines.engines.local import LocalEngine

    return LocalEngine.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def vllm_exports(tmp_path_factory):
    """A tiny dense lab policy (head_dim 32) and its exports in every scheme vLLM serves on CPU, a
    second dense policy (other weights, same architecture: reload targets) and the tiny MoE in bf16."""
    from prodrl_pipelines.lab.warmstart import build_base_policy
    from prodrl_pipelines.quant.export import export_policy

    root = tmp_path_factory.mktemp("vllm_exports")
    out = {}
    for name, size, seed in (("dense", "tiny-dense", 0), ("dense2", "tiny-dense", 1), ("moe", "tiny", 0)):
        ckpt = build_base_policy(root / name, size=size, seed=seed, sft_steps=5, progress=False)
        out[name] = ckpt
        out[f"{name}-bf16"] = root / f"{name}-bf16"
        export_policy(ckpt, out[f"{name}-bf16"], "bf16")
    calib = [[1, 5, 6, 7, 8, 9, 10, 11, 12] * 3] * 8
    for scheme in ("nvfp4-w4a16", "nvfp4-w4a4"):
        out[f"dense-{scheme}"] = root / f"dense-{scheme}"
        export_policy(out["dense"], out[f"dense-{scheme}"], scheme, calibration_prompts=calib)
    return out


@pytest.fixture(scope="session")
def vllm_server(vllm_exports, tmp_path_factory):
    """One real vLLM for the session (dev mode: in-place reloads; the nccl weight-transfer backend),
    serving the dense bf16 export as ``dense-bf16``. Its users are one unit of the schedule (``GROUPS``)."""
    from tests.vllm_support import WEIGHT_TRANSFER_ARGS, VLLMServer, vllm_python

    srv = VLLMServer(vllm_python(), vllm_exports["dense-bf16"], "dense-bf16",
                     tmp_path_factory.mktemp("vllm") / "vllm.log", extra_args=WEIGHT_TRANSFER_ARGS)
    try:
        yield srv.wait()
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def mlflow_server(s3_endpoint, tmp_path_factory):
    """A real `mlflow server` as `prodrl up` starts it: runs and registry in a PostgreSQL schema of
    this session's own, artifacts proxied to a bucket on the S3 endpoint. Yields its URL."""
    import boto3
    import psycopg2

    from prodrl_pipelines.config.preflight import libpq_dsn
    from prodrl_pipelines.stack.postgres import with_schema
    from prodrl_pipelines.deploy_targets.processes import pick_port
    from prodrl_pipelines.stack.stack import mlflow_server_command
    from tests.helpers import wait_healthy

    schema = f"prodrl_test_{os.getpid()}_mlflow"
    conn = psycopg2.connect(libpq_dsn(PG_URL))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}")
    bucket = f"mlflow-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    port = pick_port()
    log = tmp_path_factory.mktemp("mlflow") / "mlflow.log"
    env = {**os.environ, "MLFLOW_S3_ENDPOINT_URL": s3_endpoint, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(mlflow_server_command(with_schema(PG_URL, schema), f"s3://{bucket}/mlflow", port),
                                env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, f"{url}/health", timeout_s=180, what="mlflow server", log=log, kill=False)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        with conn.cursor() as cur:
            cur.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        conn.close()


# files one worker runs in a row, as one unit: they share an expensive fixture (the Ray cluster, up
# only while they run; the session's vLLM server) that a second worker would start again
GROUPS = {"tests/test_ray_*.py": lambda name: name.startswith("test_ray_"),
          "tests/test_vllm.py+test_weight_transfer.py": lambda name: name in ("test_vllm.py", "test_weight_transfer.py")}


def _group(path) -> str:
    """The unit a worker runs whole: the test's file, or its group (``GROUPS``)."""
    name = Path(str(path)).name
    return next((g for g, member in GROUPS.items() if member(name)), str(path))


def pytest_collection_modifyitems(session, config, items):
    """Groups with long end-to-end tests (``@pytest.mark.long(seconds=N)``) first, longest first:
    ``make test`` hands whole groups (``_group``) to its xdist workers in this order, so the long ones
    start at once instead of ending the run alone (longest-processing-time-first scheduling)."""
    longest: dict[str, float] = {}
    for item in items:
        m = item.get_closest_marker("long")
        if m is not None:
            g = _group(item.path)
            longest[g] = max(longest.get(g, 0.0), float(m.kwargs.get("seconds", 60)))
    order = {id(item): i for i, item in enumerate(items)}
    first = {}
    for item in items:
        first.setdefault(_group(item.path), order[id(item)])
    items.sort(key=lambda it: (-longest.get(_group(it.path), 0.0), first[_group(it.path)], order[id(it)]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with each of ``GROUPS`` as one unit."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::", 1)[0])

    return LoadGroupScheduling(config, log)


# --- one local Ray cluster (two nodes), up only while the Ray tests run ----------------------------
# The controller names a directory before the workers start. The worker that runs the Ray group
# (``_group``: one worker runs it whole) starts the cluster there, under a file lock, in a process of
# its own, when the first test needs it, and stops it after the group's last test: the rest of the
# run does not share two cores with an idle cluster. The controller stops whatever is left at the end.
RAY_ROOT_ENV = "PRODRL_TEST_RAY_ROOT"


def pytest_configure(config):
    from prodrl_pipelines.cluster.local import LOOPBACK_ENV

    # Ray reads these once, when it is first imported: set before any test imports it
    os.environ.update(LOOPBACK_ENV)
    if not hasattr(config, "workerinput") and RAY_ROOT_ENV not in os.environ:
        import tempfile

        os.environ[RAY_ROOT_ENV] = tempfile.mkdtemp(prefix="prodrl-test-ray-")
        config._prodrl_ray_owner = True


def pytest_unconfigure(config):
    if getattr(config, "_prodrl_ray_owner", False):
        import shutil

        root = Path(os.environ.pop(RAY_ROOT_ENV))
        _stop_test_ray(root)
        shutil.rmtree(root, ignore_errors=True)


# Dagster's in-process execution ends by mapping SIGTERM to SIGINT's disposition, which the workers
# ignore when the suite runs as a background job (``make test &``, a CI step in a non-interactive
# shell): from then on every process the worker starts (a server, a stand-in ``sleep``) would
# ignore SIGTERM and wait out each stop's grace period before SIGKILL. The product keeps it
# (lab.demo.keeping_sigterm); here the worker's own disposition is put back after every phase.
_SIGTERM_AT_START = signal.getsignal(signal.SIGTERM)


def pytest_runtest_logreport(report):
    """After each phase of a test (setup, call, teardown), before the next one starts."""
    if _SIGTERM_AT_START is not None and signal.getsignal(signal.SIGTERM) is not _SIGTERM_AT_START:
        signal.signal(signal.SIGTERM, _SIGTERM_AT_START)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # after the test's own fixtures (a module's Ray connection) are torn down
    if _group(item.path) == "tests/test_ray_*.py" and (nextitem is None or _group(nextitem.path) != _group(item.path)):
        _stop_test_ray(Path(os.environ[RAY_ROOT_ENV]))


def _stop_test_ray(root: Path) -> None:
    import json
    import time

    info = root / "cluster.json"
    if not info.exists():
        return
    pid = json.loads(info.read_text())["pid"]
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(120):  # its own shutdown: raylets, GCS, workers
            try:  # the worker that started it is its parent: reap it, or it stays a zombie
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
            except ChildProcessError:
                os.kill(pid, 0)
            time.sleep(0.5)
        else:
            os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    info.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """The run's local Ray cluster: two nodes on 127.0.0.1, two CPUs each (``cluster.local``), started
    on first use; yields its ``LocalRayCluster`` (``dashboard_url`` for job submission, ``gcs_address``)."""
    import fcntl
    import json

    from prodrl_pipelines.cluster.local import LocalRayCluster

    root = Path(os.environ[RAY_ROOT_ENV])
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cluster = LocalRayCluster(root, nodes=2, cpus_per_node=2)
        if (root / "cluster.json").exists():
            cluster.info = json.loads((root / "cluster.json").read_text())
        else:
            cluster.start()
            cluster.proc = None  # stopped after the Ray group (or by the controller), not by this fixture
    yield cluster
