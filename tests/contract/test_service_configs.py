"""Each service's settings: recipe errors name the key; its console script's --dry-run prints the settings."""

from __future__ import annotations

import importlib
import json
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

from molt.core.config import ServiceSettings, load_settings
from molt.core.errors import ConfigError


@dataclass(frozen=True)
class Service:
    package: str  # molt.<package>
    settings: str  # class name in molt.<package>.config
    section: str  # recipe table
    required: str  # TOML lines a valid table needs
    int_key: str  # an integer setting, to give a wrong type

    def settings_class(self) -> type[ServiceSettings]:
        return getattr(importlib.import_module(f"molt.{self.package}.config"), self.settings)

    def recipe(self, tmp_path: Path, extra: str) -> list[str]:
        path = tmp_path / "recipe.toml"
        path.write_text(f"[{self.section}]\n{extra}\n{self.required}\n")
        return ["--config", str(path)]


SERVICES = [
    Service("router", "RouterSettings", "router", '[router.engine]\nmodel_path = "models/tiny"', "max_message_bytes"),
    Service(
        "agent_pool",
        "AgentPoolSettings",
        "agent_pool",
        'agent = "arithmetic.py:ArithmeticEnv"\nprompts_path = "prompts.jsonl"\ntokenizer_path = "models/tiny"',
        "group_size",
    ),
    Service("learner", "LearnerSettings", "learner", 'model_path = "models/tiny"', "groups_per_step"),
    Service("broadcaster", "BroadcasterSettings", "broadcaster", "", "bucket_bytes"),
]


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.section)
def test_unknown_key_is_named(service: Service, tmp_path: Path) -> None:
    expected = rf"no_such_knob = 1 \(from recipe \[{service.section}\]\): Extra inputs are not permitted"
    with pytest.raises(ConfigError, match=expected):
        load_settings(
            service.settings_class(), service.section, service.recipe(tmp_path, "no_such_knob = 1"), environ={}
        )


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.section)
def test_wrong_type_is_named(service: Service, tmp_path: Path) -> None:
    argv = service.recipe(tmp_path, f'{service.int_key} = "lots"')
    with pytest.raises(ConfigError, match=rf'{service.int_key} = "lots" \(from recipe \[{service.section}\]\)'):
        load_settings(service.settings_class(), service.section, argv, environ={})


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.section)
def test_dry_run_prints_resolved_settings(service: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(f"molt.{service.package}.__main__").main
    main([*service.recipe(tmp_path, ""), "--metrics_port", "1234", "--dry-run"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["metrics_port"] == 1234
    assert printed["run"]["run_id"] == "molt"


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.section)
def test_bad_config_exits_2(service: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(f"molt.{service.package}.__main__").main
    with pytest.raises(SystemExit) as info:
        main([*service.recipe(tmp_path, "no_such_knob = 1"), "--dry-run"])
    assert info.value.code == 2
    assert "no_such_knob" in capsys.readouterr().err


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.section)
def test_a_port_in_use_is_refused_before_the_service_starts(
    service: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked first, so that a router does not start its engines (a minute) only to fail to listen."""
    main = importlib.import_module(f"molt.{service.package}.__main__").main
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            main([*service.recipe(tmp_path, ""), "--listen", f"127.0.0.1:{port}", "--metrics_port", "0"])
    assert info.value.code == 1
    assert f"listen: port {port} is in use" in capsys.readouterr().err
