"""The layered settings loader: CLI > environment > recipe > defaults, and its error messages."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from molt.core.config import ServiceSettings, load_settings
from molt.core.errors import ConfigError


class Inner(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    size: int = Field(1, ge=1, description="a size")
    name: str = Field("x", description="a name")


class DemoSettings(ServiceSettings):
    """A settings class shaped like a service's."""

    port: int = Field(10, description="a port")
    inner: Inner = Field(default_factory=Inner, description="nested table")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


def test_layers_apply_in_priority_order(tmp_path: Path) -> None:
    recipe = write(tmp_path, '[run]\nrun_id = "r1"\n[router]\nport = 1\n[router.inner]\nsize = 2\nname = "toml"\n')
    settings, _ = load_settings(DemoSettings, "router", ["--config", str(recipe)], environ={})
    assert (settings.port, settings.inner.size, settings.inner.name, settings.run.run_id) == (1, 2, "toml", "r1")

    env = {"MOLT_ROUTER_PORT": "2", "MOLT_ROUTER_INNER__SIZE": "3"}
    settings, _ = load_settings(DemoSettings, "router", ["--config", str(recipe)], environ=env)
    assert (settings.port, settings.inner.size, settings.inner.name) == (2, 3, "toml")

    argv = ["--config", str(recipe), "--port", "4", "--inner.name", "cli"]
    settings, flags = load_settings(DemoSettings, "router", argv, environ=env)
    assert (settings.port, settings.inner.size, settings.inner.name) == (4, 3, "cli")
    assert flags.dry_run is False


def test_defaults_without_recipe() -> None:
    settings, _ = load_settings(DemoSettings, "router", [], environ={"UNRELATED": "1"})
    assert settings == DemoSettings()


def test_errors_name_key_value_and_origin(tmp_path: Path) -> None:
    recipe = write(tmp_path, "[router]\nbogus = 1\n[router.inner]\nsize = 0\n")
    with pytest.raises(ConfigError) as info:
        load_settings(DemoSettings, "router", ["--config", str(recipe)], environ={"MOLT_ROUTER_PORT": "ten"})
    message = info.value.message
    assert "bogus = 1 (from recipe [router]): Extra inputs are not permitted" in message
    assert "inner.size = 0 (from recipe [router])" in message
    assert 'port = "ten" (from environment)' in message


def test_unknown_recipe_table_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown table\(s\) \['rooter'\]"):
        load_settings(DemoSettings, "router", ["--config", str(write(tmp_path, "[rooter]\nx = 1\n"))], environ={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(DemoSettings, "router", ["--config", str(write(tmp_path, "[router\n"))], environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(DemoSettings, "router", ["--config", str(tmp_path / "missing.toml")], environ={})


def test_settings_are_frozen() -> None:
    settings = DemoSettings()
    with pytest.raises(ValueError, match="frozen"):
        settings.port = 3  # type: ignore[misc]
