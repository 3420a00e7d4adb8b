"""Each service's settings: recipe errors name the key; its console script's --dry-run prints the settings;
every service reads the one shared [rollout] table, and a key that moved there is refused naming it."""

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
        'agent = "arithmetic.py:ArithmeticEnv"\ndata = { path = "prompts.jsonl" }\ntokenizer_path = "models/tiny"',
        "groups_in_flight",
    ),
    Service("learner", "LearnerSettings", "learner", 'model_path = "models/tiny"', "checkpoint_every"),
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


# One key of each service's table that moved into [rollout], as an old recipe would write it.
MOVED = {
    "router": ("[router.sampling]\ntemperature = 0.7", "router.sampling.temperature"),
    "agent_pool": ("group_size = 4", "agent_pool.group_size"),
    "learner": ("max_staleness = 2", "learner.max_staleness"),
    "broadcaster": ('pause_mode = "drain"', "broadcaster.pause_mode"),
}


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.section)
def test_every_service_reads_the_shared_rollout_table(service: Service, tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(f"[rollout]\ngroup_size = 5\ntemperature = 0.7\n[{service.section}]\n{service.required}\n")
    settings, _ = load_settings(service.settings_class(), service.section, ["--config", str(path)], environ={})
    assert (settings.rollout.group_size, settings.rollout.temperature) == (5, 0.7)


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.section)
def test_a_key_that_moved_to_rollout_is_refused_naming_its_new_place(service: Service, tmp_path: Path) -> None:
    extra, key = MOVED[service.section]
    with pytest.raises(ConfigError, match=rf"{key} \(from recipe \[{service.section}\]\) moved to \[rollout\]"):
        load_settings(service.settings_class(), service.section, service.recipe(tmp_path, extra), environ={})


def test_an_old_key_from_the_environment_is_refused_too(tmp_path: Path) -> None:
    learner = SERVICES[2]
    argv = learner.recipe(tmp_path, "")
    with pytest.raises(ConfigError, match=r"learner.group_size \(from environment\) moved to \[rollout\] group_size"):
        load_settings(learner.settings_class(), "learner", argv, environ={"MOLT_LEARNER_GROUP_SIZE": "4"})
    settings, _ = load_settings(
        learner.settings_class(), "learner", argv, environ={"MOLT_LEARNER_ROLLOUT__GROUP_SIZE": "4"}
    )
    assert settings.rollout.group_size == 4  # the new place, set for this one service


def test_a_services_own_rollout_table_is_refused(tmp_path: Path) -> None:
    learner = SERVICES[2]
    path = tmp_path / "recipe.toml"
    path.write_text(f"[learner]\n{learner.required}\n[learner.rollout]\ntemperature = 0.7\n")
    with pytest.raises(ConfigError, match=r"\[learner.rollout\] moved to the top-level \[rollout\] table"):
        load_settings(learner.settings_class(), "learner", ["--config", str(path)], environ={})
