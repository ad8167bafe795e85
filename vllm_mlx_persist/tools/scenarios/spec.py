"""Scenario files: the YAML schema, its validation, and the texts they name.

A scenario is agents (permanent or ephemeral) talking in phases. See docs/scenarios.md for the format;
`load_scenario` turns a file into a validated `Scenario` or raises `ScenarioError` naming the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Union

from ...namespace import MAX_AGENT_ID_LEN, validate_agent_id
from .corpus import CorpusError, document

LIFECYCLES = ("permanent", "ephemeral")
SEES_KEYWORDS = ("phase", "all", "own")
TOP_KEYS = {"name", "description", "params", "max_tokens", "texts", "agents", "phases"}
AGENT_KEYS = {"lifecycle", "system", "document", "fork_from", "description"}
PHASE_KEYS = {"name", "description", "agents", "rounds", "prompt", "prompts", "turns", "sees", "agent_sees",
              "parallel", "max_tokens"}
TURN_KEYS = {"agents", "prompt", "prompts"}
TEXT_KEYS = {"modules", "words"}
# Room left in an agent id for the run id and the phase suffix of ephemeral agents.
MAX_NAME_LEN = 40
PLACEHOLDER = re.compile(r"\{([A-Za-z_]+)(?::([A-Za-z0-9_]+))?\}")
PLAIN_PLACEHOLDERS = ("agent", "phase", "round", "document")


class ScenarioError(ValueError):
    """A scenario file that does not follow the schema; the message names the offending key."""


@dataclass(frozen=True)
class Sees:
    """Which other agents' posts an agent is shown: by author and phase (None = any)."""

    agents: Optional[tuple[str, ...]] = None
    phases: Optional[tuple[str, ...]] = None
    nothing: bool = False  # "own": only the agent's own history


@dataclass(frozen=True)
class Step:
    """One turn of a phase: each agent, in order (or at once when the phase is parallel), speaks once."""

    agents: tuple[str, ...]
    prompt: str = ""
    prompts: dict[str, str] = field(default_factory=dict)

    def prompt_for(self, agent: str) -> str:
        return self.prompts.get(agent, self.prompt)


@dataclass(frozen=True)
class Phase:
    name: str
    steps: tuple[Step, ...]
    sees: dict[str, Sees]  # per participating agent
    parallel: bool = False
    max_tokens: Optional[int] = None
    description: str = ""

    @property
    def agents(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for step in self.steps:
            seen.update(dict.fromkeys(step.agents))
        return tuple(seen)


@dataclass(frozen=True)
class Agent:
    name: str
    lifecycle: str = "permanent"
    system: str = ""
    document: Optional[str] = None
    fork_from: Optional[str] = None
    description: str = ""

    @property
    def ephemeral(self) -> bool:
        return self.lifecycle == "ephemeral"


@dataclass(frozen=True)
class Scenario:
    name: str
    agents: dict[str, Agent]
    phases: tuple[Phase, ...]
    texts: dict[str, str]  # name -> generated text
    params: dict[str, int]
    max_tokens: int = 32
    description: str = ""


def shipped_scenarios() -> dict[str, Path]:
    """Scenario files shipped in the package: name -> path."""
    root = resources.files(__package__) / "shipped"
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def resolve_path(name_or_path: Union[str, Path]) -> Path:
    """A path to a scenario file, or the name of a shipped scenario."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_scenarios()
    if str(name_or_path) in shipped:
        return shipped[str(name_or_path)]
    raise ScenarioError(f"no scenario file {str(name_or_path)!r}; shipped scenarios: {', '.join(sorted(shipped))}")


def load_scenario(source: Union[str, Path, dict], params: Optional[dict[str, int]] = None) -> Scenario:
    """Parse and validate a scenario (a file path, a shipped name, or an already-parsed mapping).

    `params` override the file's `params` (each must exist there)."""
    if isinstance(source, dict):
        raw, where = source, "scenario"
    else:
        import yaml

        path = resolve_path(source)
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise ScenarioError(f"{path}: not valid YAML: {e}") from None
        where = str(path)
    try:
        return _parse(raw, params or {})
    except ScenarioError as e:
        raise ScenarioError(f"{where}: {e}") from None


def _check_keys(obj: Any, allowed: set[str], where: str) -> dict:
    if not isinstance(obj, dict):
        raise ScenarioError(f"{where} must be a mapping, got {type(obj).__name__}")
    unknown = sorted(set(map(str, obj)) - allowed)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    return obj


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ScenarioError(f"{where} must be a string, got {type(value).__name__}")
    try:
        validate_agent_id(value, where)
    except ValueError as e:
        raise ScenarioError(str(e)) from None
    if len(value) > MAX_NAME_LEN:
        raise ScenarioError(f"{where} must be at most {MAX_NAME_LEN} characters: {value[:50]!r}")
    return value


def _int(value: Any, where: str, params: dict[str, int], minimum: int = 1) -> int:
    if isinstance(value, str) and value in params:
        value = params[value]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(f"{where} must be an integer or the name of a param, got {value!r}")
    if value < minimum:
        raise ScenarioError(f"{where} must be >= {minimum}, got {value}")
    return value


def _str(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ScenarioError(f"{where} must be a string, got {type(value).__name__}")
    return value


def _names(value: Any, where: str, known: dict, kind: str = "agent") -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ScenarioError(f"{where} must be a non-empty list of {kind} names")
    for v in value:
        if v not in known:
            raise ScenarioError(f"{where}: unknown {kind} {v!r}; known: {', '.join(map(str, known))}")
    if len(set(value)) != len(value):
        raise ScenarioError(f"{where}: an {kind} is listed twice")
    return tuple(value)


def _check_template(text: str, where: str, texts: dict[str, str]) -> None:
    for m in PLACEHOLDER.finditer(text):
        key, arg = m.group(1), m.group(2)
        if key == "text":
            if arg not in texts:
                raise ScenarioError(f"{where}: {m.group(0)} names no text; texts: {', '.join(texts) or 'none'}")
        elif key not in PLAIN_PLACEHOLDERS or arg is not None:
            raise ScenarioError(f"{where}: unknown placeholder {m.group(0)}; use {{agent}}, {{phase}}, "
                                "{round}, {document} or {text:NAME}")


def render(template: str, *, agent: str, phase: str, round: int, texts: dict[str, str],
           doc: Optional[str]) -> str:
    """Fill a prompt template; inserted texts are not scanned again."""
    def sub(m: re.Match) -> str:
        key, arg = m.group(1), m.group(2)
        if key == "text":
            return texts[arg]
        if key == "document":
            return texts[doc] if doc else ""
        return {"agent": agent, "phase": phase, "round": str(round)}[key]

    return PLACEHOLDER.sub(sub, template)


def _sees(value: Any, where: str, phase: str, agents: dict, phase_names: set[str]) -> Sees:
    if value is None or value == "phase":
        return Sees(phases=(phase,))
    if value == "all":
        return Sees()
    if value == "own":
        return Sees(nothing=True)
    if isinstance(value, dict):
        _check_keys(value, {"agents", "phases"}, where)
        who = _names(value["agents"], f"{where}.agents", agents) if "agents" in value else None
        when = None
        if "phases" in value:
            when = _names(value["phases"], f"{where}.phases", dict.fromkeys(phase_names), kind="phase")
        return Sees(agents=who, phases=when)
    raise ScenarioError(f"{where} must be one of {', '.join(SEES_KEYWORDS)} or a mapping with agents/phases, "
                        f"got {value!r}")


def _parse(raw: Any, overrides: dict[str, int]) -> Scenario:
    top = _check_keys(raw, TOP_KEYS, "the top level")
    if "name" not in top:
        raise ScenarioError("missing key: name")
    name = _name(top["name"], "name")

    params_raw = _check_keys(top.get("params") or {}, set(map(str, top.get("params") or {})), "params")
    params = {str(k): _int(v, f"params.{k}", {}, minimum=0) for k, v in params_raw.items()}
    for k, v in overrides.items():
        if k not in params:
            raise ScenarioError(f"unknown param {k!r}; this scenario's params: {', '.join(params) or 'none'}")
        params[k] = _int(v, f"param {k}", {}, minimum=0)
    max_tokens = _int(top.get("max_tokens", 32), "max_tokens", params)

    texts: dict[str, str] = {}
    for tname, spec in (_check_keys(top.get("texts") or {}, set(map(str, top.get("texts") or {})), "texts")).items():
        spec = _check_keys(spec, TEXT_KEYS, f"texts.{tname}")
        if "modules" not in spec or "words" not in spec:
            raise ScenarioError(f"texts.{tname} needs modules and words")
        modules = spec["modules"] if isinstance(spec["modules"], list) else [spec["modules"]]
        try:
            texts[str(tname)] = document([str(m) for m in modules], _int(spec["words"], f"texts.{tname}.words", params))
        except CorpusError as e:
            raise ScenarioError(f"texts.{tname}: {e}") from None

    if "agents" not in top or not top["agents"]:
        raise ScenarioError("missing key: agents (a mapping of agent names)")
    agents_raw = _check_keys(top["agents"], set(map(str, top["agents"])), "agents")
    agents: dict[str, Agent] = {}
    for aname, spec in agents_raw.items():
        aname = _name(aname, "agent name")
        spec = _check_keys(spec or {}, AGENT_KEYS, f"agents.{aname}")
        lifecycle = spec.get("lifecycle", "permanent")
        if lifecycle not in LIFECYCLES:
            raise ScenarioError(f"agents.{aname}.lifecycle must be one of {', '.join(LIFECYCLES)}, got {lifecycle!r}")
        doc = spec.get("document")
        if doc is not None and doc not in texts:
            raise ScenarioError(f"agents.{aname}.document: no text {doc!r}; texts: {', '.join(texts) or 'none'}")
        system = _str(spec.get("system"), f"agents.{aname}.system")
        _check_template(system, f"agents.{aname}.system", texts)
        agents[aname] = Agent(aname, lifecycle, system, doc, spec.get("fork_from"),
                              _str(spec.get("description"), f"agents.{aname}.description"))
    for a in agents.values():
        if a.fork_from is None:
            continue
        if a.fork_from not in agents or a.fork_from == a.name:
            raise ScenarioError(f"agents.{a.name}.fork_from: {a.fork_from!r} is not another agent")
        if a.system:
            raise ScenarioError(f"agents.{a.name}: a forked agent inherits its parent's system prompt; drop system")

    if "phases" not in top:
        raise ScenarioError("missing key: phases (a list of phases)")
    if not isinstance(top["phases"], list) or not top["phases"]:
        raise ScenarioError("phases must be a non-empty list")
    phase_names = [p.get("name") if isinstance(p, dict) else None for p in top["phases"]]
    phases: list[Phase] = []
    for i, p in enumerate(top["phases"]):
        where = f"phases[{i}]"
        p = _check_keys(p, PHASE_KEYS, where)
        if "name" not in p:
            raise ScenarioError(f"{where}: missing key: name")
        pname = _name(p["name"], f"{where}.name")
        where = f"phases[{i}] ({pname})"
        if pname in phase_names[:i]:
            raise ScenarioError(f"{where}: phase name used twice")
        steps: list[Step] = []
        if "turns" in p:
            if {"agents", "rounds", "prompt", "prompts"} & set(p):
                raise ScenarioError(f"{where}: give either turns, or agents/rounds/prompt(s), not both")
            if not isinstance(p["turns"], list) or not p["turns"]:
                raise ScenarioError(f"{where}.turns must be a non-empty list")
            for j, t in enumerate(p["turns"]):
                t = _check_keys(t, TURN_KEYS, f"{where}.turns[{j}]")
                if "agents" not in t:
                    raise ScenarioError(f"{where}.turns[{j}]: missing key: agents")
                steps.append(_step(t, f"{where}.turns[{j}]", agents, texts))
        else:
            if "agents" not in p:
                raise ScenarioError(f"{where}: missing key: agents (or turns)")
            step = _step(p, where, agents, texts)
            steps += [step] * _int(p.get("rounds", 1), f"{where}.rounds", params)
        participants = tuple(dict.fromkeys(a for s in steps for a in s.agents))
        default = _sees(p.get("sees"), f"{where}.sees", pname, agents, set(filter(None, phase_names)))
        sees = dict.fromkeys(participants, default)
        per_agent = _check_keys(p.get("agent_sees") or {}, set(participants), f"{where}.agent_sees")
        for a, spec in per_agent.items():
            sees[a] = _sees(spec, f"{where}.agent_sees.{a}", pname, agents, set(filter(None, phase_names)))
        parallel = p.get("parallel", False)
        if not isinstance(parallel, bool):
            raise ScenarioError(f"{where}.parallel must be true or false")
        mt = _int(p["max_tokens"], f"{where}.max_tokens", params) if "max_tokens" in p else None
        phases.append(Phase(pname, tuple(steps), sees, parallel, mt, _str(p.get("description"), f"{where}.description")))

    _check_fork_order(agents, phases)
    spoken = {a for ph in phases for a in ph.agents}
    idle = sorted(set(agents) - spoken)
    if idle:
        raise ScenarioError(f"agent(s) {', '.join(idle)} never speak in any phase")
    longest = max(len(a) + len(ph.name) + 1 for ph in phases for a in ph.agents)
    if longest > MAX_AGENT_ID_LEN - 24:  # the run id prefix needs the rest
        raise ScenarioError("agent plus phase names are too long for an agent id")
    return Scenario(name, agents, tuple(phases), texts, params, max_tokens, _str(top.get("description"), "description"))


def _step(obj: dict, where: str, agents: dict[str, Agent], texts: dict[str, str]) -> Step:
    who = _names(obj["agents"], f"{where}.agents", agents)
    prompt = _str(obj.get("prompt"), f"{where}.prompt")
    _check_template(prompt, f"{where}.prompt", texts)
    prompts_raw = _check_keys(obj.get("prompts") or {}, set(who), f"{where}.prompts")
    prompts = {}
    for a, t in prompts_raw.items():
        prompts[a] = _str(t, f"{where}.prompts.{a}")
        _check_template(prompts[a], f"{where}.prompts.{a}", texts)
    return Step(who, prompt, prompts)


def _check_fork_order(agents: dict[str, Agent], phases: list[Phase]) -> None:
    """A forked agent may only speak after its parent has spoken (it starts from the parent's history)."""
    spoken: set[str] = set()
    for ph in phases:
        for step in ph.steps:
            for a in step.agents:
                parent = agents[a].fork_from
                if parent is not None and parent not in spoken:
                    raise ScenarioError(f"phase {ph.name}: {a} forks from {parent}, who has not spoken yet")
                if not ph.parallel:
                    spoken.add(a)
            spoken.update(step.agents)
