"""The Cyberwave cloud node, installed with pip.

The node itself is one static binary, `cyberwave-cloud-node`, which this package puts on PATH.
This module keeps the documented Python API of the original node (``CloudNode``,
``CloudNodeConfig``) as a thin layer over that binary: ``run()`` starts it with the equivalent
settings, forwards SIGINT and SIGTERM to it and returns its exit code (as a container's PID 1 it
becomes the node instead: see ``run``). Nothing of the node runs in Python.

    import sys
    from cyberwave_cloud_node import CloudNode, CloudNodeConfig

    node = CloudNode.from_config_file(slug="my-gpu-node")     # ./cyberwave.yml
    # node = CloudNode.from_env()                             # CYBERWAVE_* variables
    # node = CloudNode(config=CloudNodeConfig(inference="python infer.py --params {body}"),
    #                  slug="my-gpu-node")
    sys.exit(node.run())                                      # the node's exit code
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, NoReturn, Optional, Sequence

__all__ = ["CloudNode", "CloudNodeConfig", "binary", "__version__"]

__version__ = "@VERSION@"

BINARY_NAME = "cyberwave-cloud-node"
DEFAULT_HEARTBEAT_INTERVAL = 30
DEFAULT_MQTT_HOST = "mqtt.cyberwave.com"
DEFAULT_MQTT_PORT = 8883


def binary() -> str:
    """The node binary: ``CYBERWAVE_NODE_BIN``, else the one this package installed (the
    environment's scripts folder), else the first on PATH."""
    explicit = os.environ.get("CYBERWAVE_NODE_BIN")
    if explicit:
        return explicit
    for scheme_dir in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        if scheme_dir:
            candidate = os.path.join(scheme_dir, BINARY_NAME)
            if os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which(BINARY_NAME)
    if found:
        return found
    raise FileNotFoundError(
        f"{BINARY_NAME} not found: reinstall the package (pip install cyberwave-cloud-node) "
        "or set CYBERWAVE_NODE_BIN"
    )


@dataclass
class CloudNodeConfig:
    """The documented settings of a node (the keys of ``cyberwave.yml``). ``None`` leaves a
    setting to the manifest, the environment or the default, as the binary resolves it."""

    install_script: Optional[str] = None
    inference: Optional[str] = None
    simulate: Optional[str] = None
    training: Optional[str] = None
    profile_slug: Optional[str] = None
    heartbeat_interval: Optional[float] = None
    mqtt_host: Optional[str] = None
    mqtt_port: Optional[int] = None
    mqtt_username: Optional[str] = None
    mqtt_password: Optional[str] = None
    extra: Dict[str, object] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> "CloudNodeConfig":
        """The settings the ``CYBERWAVE_*`` variables give (the binary reads the same ones)."""
        env = os.environ.get
        interval = env("CYBERWAVE_HEARTBEAT_INTERVAL")
        port = env("CYBERWAVE_MQTT_PORT")
        return cls(
            install_script=env("CYBERWAVE_INSTALL_SCRIPT"),
            inference=env("CYBERWAVE_INFERENCE_CMD"),
            simulate=env("CYBERWAVE_SIMULATE_CMD"),
            training=env("CYBERWAVE_TRAINING_CMD"),
            profile_slug=env("CYBERWAVE_PROFILE_SLUG"),
            heartbeat_interval=float(interval) if interval else None,
            mqtt_host=env("CYBERWAVE_MQTT_HOST"),
            mqtt_port=int(port) if port else None,
            mqtt_username=env("CYBERWAVE_MQTT_USERNAME"),
            mqtt_password=env("CYBERWAVE_MQTT_PASSWORD"),
        )

    def to_env(self) -> Dict[str, str]:
        """The environment that gives the binary these settings (command templates set this way
        win over a manifest's; broker host, port and profile go as flags, see ``to_args``)."""
        out: Dict[str, str] = {}
        pairs = [
            ("CYBERWAVE_INSTALL_SCRIPT", self.install_script),
            ("CYBERWAVE_INFERENCE_CMD", self.inference),
            ("CYBERWAVE_SIMULATE_CMD", self.simulate),
            ("CYBERWAVE_TRAINING_CMD", self.training),
            ("CYBERWAVE_MQTT_USERNAME", self.mqtt_username),
            ("CYBERWAVE_MQTT_PASSWORD", self.mqtt_password),
        ]
        if self.heartbeat_interval is not None:
            pairs.append(("CYBERWAVE_HEARTBEAT_INTERVAL", str(self.heartbeat_interval)))
        for key, value in pairs:
            if value is not None:
                out[key] = str(value)
        return out

    def to_args(self) -> List[str]:
        """The flags that give the binary these settings (flags win over everything)."""
        args: List[str] = []
        if self.profile_slug is not None:
            args += ["--profile", self.profile_slug]
        if self.mqtt_host is not None:
            args += ["--mqtt-host", self.mqtt_host]
        if self.mqtt_port is not None:
            args += ["--mqtt-port", str(int(self.mqtt_port))]
        return args


class CloudNode:
    """A node to run: ``run()`` blocks until the node exits and returns its exit code (0 stopped,
    1 runtime failure, 2 configuration error, 3 credentials rejected; see the README)."""

    def __init__(
        self,
        config: Optional[CloudNodeConfig] = None,
        slug: Optional[str] = None,
        config_path: Optional[os.PathLike] = None,
        args: Sequence[str] = (),
    ) -> None:
        self.config = config
        self.slug = slug
        self.config_path = Path(config_path) if config_path is not None else None
        self.args = list(args)
        self.returncode: Optional[int] = None

    @classmethod
    def from_config_file(
        cls,
        path: Optional[os.PathLike] = None,
        slug: Optional[str] = None,
        args: Sequence[str] = (),
    ) -> "CloudNode":
        """The node of a manifest: ``path``, else ``./cyberwave.yml`` as the binary finds it."""
        return cls(config=None, slug=slug, config_path=path, args=args)

    @classmethod
    def from_env(cls, slug: Optional[str] = None, args: Sequence[str] = ()) -> "CloudNode":
        """The node the ``CYBERWAVE_*`` environment describes."""
        return cls(config=CloudNodeConfig.from_env(), slug=slug, args=args)

    def command(self) -> List[str]:
        """The command line ``run()`` executes."""
        cmd = [binary(), "start"]
        if self.config_path is not None:
            cmd += ["--config", os.fspath(self.config_path)]
        if self.slug:
            cmd += ["--slug", self.slug]
        if self.config is not None:
            cmd += self.config.to_args()
        return cmd + self.args

    def environment(self) -> Dict[str, str]:
        env = dict(os.environ)
        if self.config is not None:
            env.update(self.config.to_env())
        return env

    def run(self, *args: str) -> int:
        """Runs the node in the foreground; SIGINT and SIGTERM are passed on to it (the node then
        shuts down gracefully). Returns its exit code (128 + N when a signal N ended it): pass it
        on, ``sys.exit(node.run())``, so that a configuration error (2) or a rejected token (3)
        is the script's exit code too.

        As PID 1 (a container's command) this process becomes the node (``exec``) and ``run()``
        never returns: the node as PID 1 stops and reports its workloads on ``docker stop``
        (which would otherwise end with this process) and reaps orphans."""
        cmd = self.command() + list(args)
        env = self.environment()
        if os.getpid() == 1:
            _become(cmd, env)
        proc = subprocess.Popen(cmd, env=env)

        def forward(signum, _frame):
            if proc.poll() is None:
                proc.send_signal(signum)

        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[sig] = signal.signal(sig, forward)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
        try:
            while True:
                try:
                    code = proc.wait()
                    break
                except KeyboardInterrupt:
                    forward(signal.SIGINT, None)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.returncode = 128 - code if code < 0 else code
        return self.returncode


def _become(cmd: List[str], env: Dict[str, str]) -> NoReturn:
    """Replaces this process with the node (never returns): the signals Python ignores for itself
    are given back their defaults first, as ``subprocess`` does for a child."""
    for name in ("SIGPIPE", "SIGXFSZ"):
        try:
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        except (AttributeError, ValueError):  # not this platform's, or not the main thread
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)


def main() -> int:
    """``python -m cyberwave_cloud_node ARGS`` runs the binary with ARGS."""
    os.execv(binary(), [BINARY_NAME] + sys.argv[1:])
    return 1  # not reached
