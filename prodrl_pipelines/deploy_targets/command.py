"""``pointer`` and ``command``: deploy targets that manage no process of their own.

``pointer`` only moves the registry's live pointer: whoever serves reads it (the lab's loop, or
``prodrl up``'s deployment, restarts its own server). ``command`` runs the user's template, e.g. a
``kubectl set image`` or a script, with ``{export_dir}``, ``{policy_version}`` and ``{port}`` filled
in; a non-zero exit is a failed deploy with its stderr in the message. Its endpoint
(``target_endpoint``, ``{port}`` filled in) is health-checked and probed; a rollback runs the
template again on the previous export.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

from prodrl_pipelines.deploy_targets.base import DeployError, Endpoint, Switch, wait_healthy
from prodrl_pipelines.deploy_targets.endpoint_store import endpoint_file


class PointerTarget:
    name = "pointer"

    def __init__(self, settings, home: str | os.PathLike) -> None:
        self.settings = settings

    def switch(self, export_dir: Path, policy_version: str) -> Switch:
        return Switch(self.name, policy_version, str(export_dir), None, policy_version)

    def commit(self, switch: Switch) -> None:
        pass

    def rollback(self, switch: Switch) -> str:
        return "the live pointer was left on the previous version"


COMMAND_FIELDS = ("export_dir", "policy_version", "port")


def check_command_template(template: str) -> None:
    """A template that names an unknown field fails at settings time, not at the first deploy."""
    import string

    for _, name, _, _ in string.Formatter().parse(template):
        if name is not None and name not in COMMAND_FIELDS:
            raise ValueError(f"target_command names {{{name}}}; it may use {', '.join('{' + f + '}' for f in COMMAND_FIELDS)}")


class CommandTarget:
    name = "command"

    def __init__(self, settings, home: str | os.PathLike) -> None:
        self.settings = settings
        self.deploy = settings.deploy
        if not self.deploy.target_command:
            raise DeployError("deploy target 'command' needs target_command (a template with {export_dir}, "
                              "{policy_version}, {port})")
        self.home = Path(home)
        self.endpoints = endpoint_file(home, self.deploy)

    def _endpoint(self) -> str | None:
        ep = self.deploy.target_endpoint.format(port=self.deploy.target_port) if self.deploy.target_endpoint else ""
        return ep.rstrip("/") or None

    def run(self, export_dir: Path, policy_version: str) -> float:
        argv = shlex.split(self.deploy.target_command.format(export_dir=str(export_dir), policy_version=policy_version,
                                                             port=self.deploy.target_port))
        t0 = time.monotonic()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.deploy.health_timeout_s)
        except FileNotFoundError:
            raise DeployError(f"deploy command not found: {argv[0]!r} (target_command)") from None
        except subprocess.TimeoutExpired:
            raise DeployError(f"deploy command {argv[0]!r} ran past health_timeout_s={self.deploy.health_timeout_s:g}") from None
        if done.returncode != 0:
            err = (done.stderr or done.stdout or "").strip()[-2000:]
            raise DeployError(f"deploy command {' '.join(argv)!r} exited {done.returncode}: {err or '(no output)'}")
        return time.monotonic() - t0

    def switch(self, export_dir: Path, policy_version: str) -> Switch:
        t0 = time.monotonic()
        previous = self.endpoints.read()
        command_s = self.run(export_dir, policy_version)
        url = self._endpoint()
        if url:
            wait_healthy(url, self.deploy.health_timeout_s)
        prev = {"policy_version": previous.policy_version, "export_dir": previous.export_dir} if previous else None
        return Switch(self.name, policy_version, str(export_dir), url, policy_version,
                      seconds=time.monotonic() - t0, previous=prev, detail={"command_seconds": command_s})

    def commit(self, switch: Switch) -> None:
        if switch.endpoint:
            self.endpoints.write(Endpoint(switch.endpoint, switch.served_model_name or switch.policy_version,
                                          switch.policy_version, self.name, switch.export_dir))

    def rollback(self, switch: Switch) -> str:
        prev = switch.previous
        if not prev:
            return "no previous deployment to restore"
        self.run(Path(prev["export_dir"]), prev["policy_version"])
        return f"ran the deploy command again for {prev['policy_version']}"
