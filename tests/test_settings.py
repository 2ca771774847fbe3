"""One source for every setting: each `serve` flag, SPECSERVE_* variable and YAML key is one field of
ServeSettings with one default, and the engine's defaults are the same ones."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from engine.config import EngineConfig
from server.cli import _parser
from server.settings import ENGINE_DEFAULTS, ServeSettings, cli_fields, flag

FIELDS = ServeSettings.model_fields


def sample(name: str):
    """A valid value for the setting that differs from its default, and its text on a command line."""
    info = FIELDS[name]
    default = info.default
    args = [arg for arg in typing.get_args(info.annotation) if arg is not type(None)]
    if typing.get_origin(info.annotation) is typing.Literal:
        value = next(choice for choice in args if choice != default)
    elif typing.get_origin(info.annotation) is list:  # a repeated flag
        return ["x"], "x"
    elif info.annotation is bool:
        value = not default
        return value, "on" if value else "off"
    elif int in (info.annotation, *args):
        value = default * 2 if default else 3
    elif float in (info.annotation, *args):
        value = default * 2 if default else 0.5
    else:
        value = "ngram,suffix" if name == "stages" else "x"
    return value, str(value)


def serve_actions() -> list:
    commands = next(action for action in _parser()._actions if action.dest == "command")
    return commands.choices["serve"]._actions


def serve_flags() -> dict[str, str]:
    """The `serve` subcommand's flags, each with the destination argparse gives it."""
    return {option: action.dest for action in serve_actions() for option in action.option_strings}


def test_every_flag_is_one_field_and_every_field_a_flag():
    flags = serve_flags()
    assert {flags[flag(name)] for name in cli_fields()} == set(cli_fields())
    assert set(flags) - {"-h", "--help", "--config"} == {flag(name) for name in cli_fields()}
    assert set(FIELDS) - set(cli_fields()) == {"needs"}  # a preset's own key, no flag


@pytest.mark.parametrize("name", sorted(cli_fields()))
def test_a_flag_sets_its_field_and_only_it(name):
    value, text = sample(name)
    args = vars(_parser().parse_args(["serve", flag(name), text]))
    args.pop("command"), args.pop("config")
    assert args == {name: value}
    settings = ServeSettings.load(None, args)
    assert getattr(settings, name) == value
    assert all(getattr(settings, other) == FIELDS[other].default for other in FIELDS if other != name)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_an_environment_variable_and_a_yaml_key_set_the_same_field(name, monkeypatch, tmp_path):
    value, text = sample(name)
    monkeypatch.setenv(f"SPECSERVE_{name.upper()}", text)
    assert getattr(ServeSettings(), name) == value
    monkeypatch.delenv(f"SPECSERVE_{name.upper()}")
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump({name.replace("_", "-"): value}))
    assert getattr(ServeSettings.load(str(preset), {}), name) == value


def test_the_help_names_each_default():
    for name in cli_fields():
        action = next(a for a in serve_actions() if flag(name) in a.option_strings)
        assert "default" in action.help, name


def test_the_engine_and_the_server_share_their_defaults():
    """Every setting the engine reads has one default: the engine config built from default
    settings is the default EngineConfig, the draft aside (the server resolves "auto")."""
    built = ServeSettings(draft="none").engine_config()
    for field in dataclasses.fields(EngineConfig):
        assert getattr(built, field.name) == ENGINE_DEFAULTS[field.name], field.name
    engine_settings = {name for name, info in FIELDS.items() if (info.json_schema_extra or {}).get("engine")}
    assert engine_settings <= set(ENGINE_DEFAULTS)
    assert ServeSettings().drafter == EngineConfig().drafter == "auto"


def test_an_empty_value_is_the_settings_default_from_every_source(monkeypatch, tmp_path):
    """compose passes SPECSERVE_TARGET= where .env leaves it blank: that is the embedded model, as
    no target at all is (it was read as the working directory, and the CPU service crash-looped)."""
    for name in ("TARGET", "DRAFT", "DRAFTER", "NUM_DRAFT_TOKENS", "API_KEY", "PORT"):
        monkeypatch.setenv(f"SPECSERVE_{name}", "")
    from_env = ServeSettings.load(None, {})
    assert from_env == ServeSettings()
    assert from_env.target is None and from_env.drafter == "auto" and from_env.api_key == []
    assert from_env.engine_config().target is None and from_env.resolved_draft == "copy:auto"
    preset = tmp_path / "preset.yaml"
    preset.write_text("target: ''\ndrafter: ' '\n")
    assert ServeSettings.load(str(preset), {"draft": ""}) == ServeSettings()
