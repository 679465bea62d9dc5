"""The TRL ``environment_factory`` class against TRL's own contract, without TRL (it needs torch):
the trainer's probe and tool calls replicated line for line, on real sandboxes of the codefix and
corpus envs, and transformers' ``get_json_schema`` on every generated tool."""

from __future__ import annotations

import gc
import inspect
from typing import Any

import pytest

get_json_schema = pytest.importorskip("transformers.utils").get_json_schema

from fanfold import Fleet  # noqa: E402
from fanfold.errors import InvalidRequest, SandboxNotFound  # noqa: E402
from fanfold.integrations.trl import environment_factory  # noqa: E402
from fanfold.rl.core import AsyncSandboxEnv, Tool  # noqa: E402
from fanfold.rl.envs.codefix import CodeFixEnv  # noqa: E402
from fanfold.rl.envs.corpus import CorpusSearchEnv  # noqa: E402

ROW = {"prompt": [{"role": "user", "content": "Fix the project. "}], "seed": 3}
FIX = {"path": "stats.py", "old": "// len(values)", "new": "/ len(values)"}  # half the tests pass after it


def probe(factory: Any) -> tuple[Any, dict[str, Any], bool]:
    """What trl 1.16's GRPOTrainer.__init__ does with a factory, statement for statement (trl/trainer/
    grpo_trainer.py, lines 684-702: the members listed on the class, since getmembers on the instance
    would evaluate properties; ``reset`` required, ``get_reward`` optional, every other public function a
    tool). Its tools then go into a dict by ``__name__`` (lines 2370-2383) and are rendered with
    ``get_json_schema`` (trl/generation/vllm_client.py, line 594)."""
    instance = factory()
    has_reset = False
    has_reward = False
    methods = []
    for member_name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction):
        if member_name == "reset":
            has_reset = True
        elif member_name == "get_reward":
            has_reward = True
        elif not member_name.startswith("_"):
            methods.append(getattr(instance, member_name))
    assert has_reset, "Each environment instance returned by `environment_factory` must define a callable `reset`."
    return instance, {method.__name__: method for method in methods}, has_reward


def call_tool(tools: dict[str, Any], name: str, arguments: dict[str, Any]) -> Any:
    """How trl 1.16 runs a sync tool call (grpo_trainer.py, lines 1980-1990):

        try:
            if name in sync_tool_dict:
                tool_call_results.append((name, sync_tool_dict[name](**function["arguments"])))
            ...
        except Exception as e:
            result = {"error": str(e)}"""
    try:
        return tools[name](**arguments)
    except Exception as e:
        return {"error": str(e)}


def schema_matches(schema: dict[str, Any], tool: Tool) -> None:
    """``get_json_schema``'s view of a method says what fanfold's schema of the tool says."""
    function = schema["function"]
    assert function["name"] == tool.name and function["description"] == tool.description
    properties = tool.parameters.get("properties", {})
    assert function["parameters"]["properties"].keys() == properties.keys()
    assert set(function["parameters"].get("required", [])) == set(tool.parameters.get("required", []))
    for arg, spec in properties.items():
        assert function["parameters"]["properties"][arg]["type"] == spec["type"], arg
    assert function["return"] == {"type": "string"}


@pytest.fixture(scope="module")
def sync_fleet(config):
    with Fleet(config=config) as fleet:
        yield fleet


def test_trls_probe_reset_tools_and_reward_on_codefix(sync_fleet):
    factory = environment_factory("codefix", fleet=sync_fleet)
    instance, tools, has_reward = probe(factory)
    try:
        assert has_reward and type(instance).__name__ == "CodeFixEnvironment"
        assert sorted(tools) == ["edit_file", "read_file", "run_tests", "submit"]
        for tool in CodeFixEnv.tools:
            schema_matches(get_json_schema(tools[tool.name]), tool)

        prompt = instance.reset(**ROW)  # trl: observation = environment.reset(**reset_kwargs)
        assert isinstance(prompt, str) and "stats.py" in prompt
        first = sync_fleet.get(instance._env.sandbox_id)
        assert first.info.state == "running"
        assert "FAILED (failures=5)" in call_tool(tools, "run_tests", {})
        assert call_tool(tools, "read_file", {"path": "stats.py"}).startswith("   1 ")
        assert call_tool(tools, "edit_file", FIX).startswith("edited stats.py")
        assert instance.get_reward() == 0.0
        assert call_tool(tools, "submit", {}) == "submitted: 4 of 8 tests pass"
        assert instance.get_reward() == 0.5
        assert call_tool(tools, "run_tests", {}) == "the episode has ended; call no more tools"
        assert instance.get_reward() == 0.5

        # TRL pools instances: the next rollout gets a fresh sandbox and task, the old one goes.
        assert "stats.py" in instance.reset(**ROW)
        assert instance.get_reward() == 0.0
        with pytest.raises(SandboxNotFound):
            sync_fleet.get(first.id)
        assert call_tool(tools, "submit", {}) == "submitted: 3 of 8 tests pass"  # the fix is gone with the sandbox
        assert instance.get_reward() == 0.375
        second = instance._env.sandbox_id
    finally:
        instance._close()
    instance._close()
    with pytest.raises(SandboxNotFound):
        sync_fleet.get(second)
    try:  # a closed instance still serves: the next reset makes a new sandbox
        instance.reset(**ROW)
        assert sync_fleet.get(instance._env.sandbox_id).info.state == "running"
    finally:
        instance._close()


def test_the_models_mistakes_are_observations_or_trls_errors(sync_fleet):
    instance, tools, _ = probe(environment_factory("codefix", fleet=sync_fleet))
    try:
        assert "reset" in call_tool(tools, "run_tests", {})["error"]  # a tool before reset()
        instance.reset(prompt=[])
        missing = call_tool(tools, "edit_file", {"path": "stats.py", "old": "no such text", "new": "x"})
        assert missing.startswith("error: `old` occurs 0 times in stats.py")
        outside = call_tool(tools, "read_file", {"path": "../etc/passwd"})
        assert outside.startswith("error: ../etc/passwd is outside the project")
        assert "unexpected keyword argument 'force'" in call_tool(tools, "submit", {"force": True})["error"]
        assert "missing a required argument: 'path'" in call_tool(tools, "read_file", {})["error"]
        assert instance.get_reward() == 0.0 and not instance.done
    finally:
        instance._close()


def test_corpus_options_from_the_row_optional_and_list_arguments(sync_fleet):
    instance, tools, _ = probe(environment_factory("corpus", fleet=sync_fleet, max_steps=5))
    try:
        for tool in CorpusSearchEnv.tools:
            schema_matches(get_json_schema(tools[tool.name]), tool)
        prompt = instance.reset(prompt=[], options={"question": "runbook-billing"})
        assert prompt.startswith("Which document is the runbook of the billing service?")
        assert "billing/runbook.md" in call_tool(tools, "search", {"pattern": "billing runbook"})
        assert call_tool(tools, "read_file", {"path": "/corpus/billing/runbook.md", "end_line": 1}) \
            == "# billing runbook\n"
        assert call_tool(tools, "submit", {"paths": ["billing/runbook.md"]}).endswith("(F1 1.00)")
        assert instance.get_reward() == 1.0
        with pytest.raises(InvalidRequest, match="options must be a dict"):
            instance.reset(options="runbook-billing")
    finally:
        instance._close()


def test_an_embedded_fleet_of_the_class_own_and_sandboxes_freed_with_their_instance(config, sync_fleet):
    factory = environment_factory("codefix", config=config, max_steps=2)
    instance = factory()
    try:
        instance.reset()
        sandbox_id = instance._env.sandbox_id
        instance.run_tests()
        instance.run_tests()  # max_steps reached: truncated
        assert instance.done and instance.run_tests() == "the episode has ended; call no more tools"
        other = factory()
        other.reset()  # the image the first reset built is reused, not built again
        assert other._env.inner.image is factory._shared.env_kwargs["image"] is instance._env.inner.image
        other_id = other._env.sandbox_id
        del instance
        gc.collect()
        with pytest.raises(SandboxNotFound):
            sync_fleet.get(sandbox_id)
        assert sync_fleet.get(other_id).info.state == "running"
    finally:
        factory._close_fleet()
    with pytest.raises(SandboxNotFound):
        sync_fleet.get(other_id)


class Gadgets(AsyncSandboxEnv):
    """An env with every argument type a tool schema may use; never run."""

    name = "gadgets"
    tools = (Tool("tune", "Tune the gadget.", {"type": "object", "properties": {
        "level": {"type": "integer", "minimum": 1, "maximum": 9, "description": "How hard."},
        "ratio": {"type": "number", "exclusiveMinimum": 0},
        "mode": {"type": "string", "enum": ["fast", "safe"], "description": "Which way."},
        "tags": {"type": "array", "items": {"type": "integer"}},
        "dry": {"type": "boolean"},
    }, "required": ["mode", "level"]}),)


def test_schemas_of_every_argument_type_and_names_that_cannot_be_tools():
    instance, tools, _ = probe(environment_factory(Gadgets))
    assert list(inspect.signature(tools["tune"]).parameters) == ["level", "mode", "ratio", "tags", "dry"]
    schema = get_json_schema(tools["tune"])["function"]["parameters"]
    assert schema["required"] == ["level", "mode"]
    assert schema["properties"] == {
        "level": {"type": "integer", "description": "How hard. (at least 1, at most 9)"},
        "mode": {"type": "string", "enum": ["fast", "safe"], "description": "Which way."},
        "ratio": {"type": "number", "nullable": True, "description": "The `ratio` argument. (more than 0)"},
        "tags": {"type": "array", "items": {"type": "integer"}, "nullable": True,
                 "description": "The `tags` argument."},
        "dry": {"type": "boolean", "nullable": True, "description": "The `dry` argument."},
    }
    for bad in (Tool("reset", "", {"type": "object", "properties": {}}),
                Tool("_hidden", "", {"type": "object", "properties": {}}),
                Tool("go", "", {"type": "object", "properties": {"class": {"type": "string"}}})):
        env = type("Bad", (Gadgets,), {"tools": (bad,)})
        with pytest.raises(InvalidRequest, match="cannot be"):
            environment_factory(env)
    with pytest.raises(InvalidRequest, match="unknown env"):
        environment_factory("nope")
    with pytest.raises(InvalidRequest, match="not both"):
        environment_factory("codefix", fleet=object(), url="http://x")
