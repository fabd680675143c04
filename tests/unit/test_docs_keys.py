"""docs/configuration.md documents every key the parser reads, and nothing else.

Both directions, from the code itself rather than from a list kept here:

* **parser -> docs.** The JSON keys are ``CheckpointingConfig``'s dataclass
  fields (``pipeline.use_reentrant``, every other field under
  ``activation_checkpointing``) and the ``pipeline.*`` keys that the package's
  source names in its errors (``"pipeline.<key>"`` / ``f"{PIPELINE}.<key>"``);
  the ``configure`` keywords are ``OVERRIDE_KEYS`` and its signature; the
  ``PipelineModule`` arguments are its constructor's signature. Each must
  appear, backticked, in docs/configuration.md.
* **docs -> parser.** The convention of docs/configuration.md: a documented
  JSON key is a table row that starts with a backticked dotted key,
  ``| `section.key` |``. Each must be read by the parser: given a value no key
  accepts (a JSON object), parsing raises a ``ConfigError`` naming exactly that
  key, in the documented message shape (``KEY = VALUE is invalid: expected
  ...``); and an ``activation_checkpointing`` key given ``null`` parses (no
  "unknown key"). Table rows with a plain backticked name under the
  "PipelineModule arguments" and "configure keywords" headings must be
  constructor arguments and ``configure`` keywords.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import ds_pipe_ckpt
from ds_pipe_ckpt import config as config_module
from ds_pipe_ckpt.config import CheckpointingConfig
from ds_pipe_ckpt.errors import ConfigError
from ds_pipe_ckpt.planning.planned_partition import partition_from_config

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
TEXT = DOC.read_text()
PACKAGE = ROOT / "ds_pipe_ckpt"
PIPELINE, SECTION = config_module.PIPELINE, config_module.SECTION
BAD = {"not": "a valid value of any key"}  # a JSON object: no key accepts one


def json_keys_of_the_parser() -> set[str]:
    fields = {field.name for field in dataclasses.fields(CheckpointingConfig)}
    keys = {f"{PIPELINE}.use_reentrant"} | {f"{SECTION}.{name}" for name in fields - {"use_reentrant"}}
    pattern = re.compile(r"""["'](?:%s|\{PIPELINE\})\.([a-z_]+)""" % PIPELINE)
    for path in PACKAGE.rglob("*.py"):
        keys |= {f"{PIPELINE}.{name}" for name in pattern.findall(path.read_text())}
    return keys


def documented_rows(heading: str | None = None) -> list[str]:
    """The first backticked cell of each table row (under ``heading`` only, when given)."""
    text = TEXT
    if heading is not None:
        start = TEXT.index(heading)
        following = TEXT.find("\n## ", start + len(heading))
        text = TEXT[start:following if following >= 0 else None]
    return re.findall(r"^\| `([^`]+)` \|", text, flags=re.MULTILINE)


def documented_json_keys() -> list[str]:
    return [name for name in documented_rows() if re.fullmatch(r"[a-z_]+\.[a-z_]+", name)]


def parse(param_dict: dict) -> None:
    """Every parser of the JSON config that can run without a process group."""
    CheckpointingConfig.from_ds_config(param_dict)
    partition_from_config(param_dict)


def config_with(key: str, value) -> dict:
    section, name = key.split(".")
    if section == PIPELINE and name.startswith("partition_"):
        # Read only for the planned cut, which needs a budget and the micro-batches per step.
        config = {"gradient_accumulation_steps": 2, "pipeline": {"use_reentrant": False, "partition_method": "planned"},
                  "activation_checkpointing": {"memory_budget_mb": 64}}
    else:
        config = {"pipeline": {"use_reentrant": False}}
    config.setdefault(section, {})[name] = value
    return config


def test_the_parser_has_keys_to_check():
    keys = json_keys_of_the_parser()
    assert {"pipeline.use_reentrant", "pipeline.activation_checkpoint_interval", "pipeline.partition_method",
            "pipeline.partition_profile", "activation_checkpointing.memory_budget_mb"} <= keys
    assert len(documented_json_keys()) >= len(keys)


@pytest.mark.parametrize("key", sorted(json_keys_of_the_parser()))
def test_every_json_key_the_parser_reads_is_documented(key):
    assert f"| `{key}` |" in TEXT, f"{key} is read by the parser but has no row in {DOC.relative_to(ROOT)}"


@pytest.mark.parametrize("key", documented_json_keys())
def test_every_documented_json_key_is_read_by_the_parser(key):
    with pytest.raises(ConfigError) as raised:
        parse(config_with(key, BAD))
    assert raised.value.key == key, f"a bad {key} was reported as {raised.value.key}: is the documented name right?"
    assert str(raised.value).startswith(f"{key} = {BAD!r} is invalid: expected ")
    if key.startswith(f"{SECTION}."):
        CheckpointingConfig.from_ds_config(config_with(key, None))  # not an unknown key


def test_documented_json_keys_are_unique():
    keys = documented_json_keys()
    assert len(keys) == len(set(keys))


def test_an_unknown_key_is_refused_as_documented():
    with pytest.raises(ConfigError, match="Unknown keys are rejected") as raised:
        CheckpointingConfig.from_ds_config({SECTION: {"memory_budget": 1}})
    assert "Unknown keys are rejected rather than silently ignored" in TEXT
    assert str(raised.value).split(" [")[0] in TEXT


def pipeline_module_arguments() -> set[str]:
    return set(inspect.signature(ds_pipe_ckpt.PipelineModule.__init__).parameters) - {"self"}


def configure_keywords() -> set[str]:
    parameters = inspect.signature(ds_pipe_ckpt.configure).parameters
    named = {name for name, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return named | set(config_module.OVERRIDE_KEYS)


@pytest.mark.parametrize("name", sorted(pipeline_module_arguments()))
def test_every_pipeline_module_argument_is_documented(name):
    assert name in documented_rows("## `PipelineModule` arguments")


@pytest.mark.parametrize("name", sorted(configure_keywords()))
def test_every_configure_keyword_is_documented(name):
    assert name in documented_rows("## `ds_pipe_ckpt.configure` keywords")


def test_documented_arguments_and_keywords_exist():
    assert set(documented_rows("## `PipelineModule` arguments")) <= pipeline_module_arguments()
    assert set(documented_rows("## `ds_pipe_ckpt.configure` keywords")) <= configure_keywords()


@pytest.mark.parametrize("keyword, field", sorted(config_module.OVERRIDE_KEYS.items()))
def test_configure_keywords_map_to_the_documented_json_key(keyword, field):
    key = f"{PIPELINE}.{field}" if field == "use_reentrant" else f"{SECTION}.{field}"
    assert f"| `{keyword}` | `{key}` |" in TEXT
