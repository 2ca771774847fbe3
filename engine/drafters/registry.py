"""The drafters by name: registration, chain validation, and the set an engine builds.

Each strategy's module registers a factory under its name with the drafter class it builds, whose
declared abilities (``Drafter.can_refine``, ...) the registry can read without building one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..errors import ConfigError
from .base import Drafter, DraftResources

DrafterFactory = Callable[[DraftResources], Drafter]
MAX_CHAINS = 16  # staged chains built for requests' own "stages", kept for reuse


@dataclass(frozen=True, slots=True)
class _Entry:
    factory: DrafterFactory
    kind: type  # the class the factory builds: its declared abilities


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, kind: type) -> Callable[[DrafterFactory], DrafterFactory]:
    def add(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = _Entry(factory, kind)
        return factory

    return add


def available() -> list[str]:
    return sorted(_REGISTRY)


def can_refine(name: str) -> bool:
    return name in _REGISTRY and _REGISTRY[name].kind.can_refine


def build(name: str, resources: DraftResources) -> Drafter:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown drafter {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name].factory(resources)


def check_stages(stages: tuple[str, ...]) -> None:
    """The staged drafter's chain: two or more registered drafters, each named once, every stage
    after the first able to check the tokens of the stage before it."""
    chain = ",".join(stages)
    if len(stages) < 2:
        raise ConfigError(f"stages must name at least two drafters, cheapest first (e.g. ngram,model), got {chain!r}")
    for name in stages:
        if name == "staged":
            raise ConfigError(f"stages {chain!r}: the staged drafter cannot contain itself")
        if name not in _REGISTRY:
            raise ConfigError(f"stages {chain!r}: unknown drafter {name!r}; available: {', '.join(available())}")
    repeated = sorted({name for name in stages if stages.count(name) > 1})
    if repeated:
        raise ConfigError(
            f"stages {chain!r}: {repeated[0]!r} appears more than once; each drafter keeps one state (a model "
            "stage its KV cache), so a chain names each drafter once"
        )
    for name in stages[1:]:
        if not can_refine(name):
            raise ConfigError(
                f"stages {chain!r}: {name!r} cannot check another stage's tokens; "
                f"only {', '.join(n for n in available() if can_refine(n))} can follow the first stage"
            )


class DrafterSet:
    """Every registered drafter, built once for one engine's models; what cannot run here (no draft
    model, no heads) is remembered with its reason, so requests can still pick any of the others.
    Chains that requests name are built on first use and a bounded few kept."""

    def __init__(self, resources: DraftResources) -> None:
        self.resources = resources
        self.built: dict[str, Drafter] = {}
        self.problems: dict[str, str] = {}
        self._chains: OrderedDict[tuple[str, ...], Drafter] = OrderedDict()  # recent last
        for name in available():
            try:
                self.built[name] = build(name, resources)
            except ConfigError as exc:
                self.problems[name] = str(exc)

    @property
    def runnable(self) -> list[str]:
        """The drafters a request may ask for here, besides "none" (the target alone)."""
        return sorted(self.built)  # what failed to build is in problems instead

    def check(self, name: str, stages: tuple[str, ...] | None = None) -> None:
        """Raise a ConfigError, naming ``name`` and what can run instead, unless a request may use it.
        Builds nothing, so the serving thread may call it while the engine runs."""
        runnable = ", ".join([*self.runnable, "none"])
        if name not in _REGISTRY:
            raise ConfigError(f"unknown drafter {name!r}; drafters that can run here: {runnable}")
        if stages is not None:
            try:
                check_stages(stages)
            except ConfigError as exc:
                raise ConfigError(f"drafter {name!r}: {exc}") from None
            problems = [f"{stage!r}: {self.problems[stage]}" for stage in stages if stage in self.problems]
            if problems:
                raise ConfigError(f"drafter {name!r} with stages {','.join(stages)} cannot run here: {problems[0]}")
        elif name in self.problems:
            raise ConfigError(
                f"drafter {name!r} cannot run here: {self.problems[name]}; drafters that can run here: {runnable}"
            )

    def get(self, name: str, stages: tuple[str, ...] | None = None) -> Drafter:
        """The drafter registered as ``name`` (for ``staged``, over ``stages`` or the configured chain)."""
        self.check(name, stages)
        if stages is None:
            return self.built[name]
        if stages not in self._chains:
            config = replace(self.resources.config, stages=stages)
            self._chains[stages] = build(name, replace(self.resources, config=config))
            if len(self._chains) > MAX_CHAINS:  # requests choose chains: keep a bounded few
                self._chains.popitem(last=False)
        self._chains.move_to_end(stages)
        return self._chains[stages]

    def park(self) -> dict[int, tuple]:
        """Every built drafter's per-sequence state (``Drafter.park``), while another sequence runs."""
        return {id(drafter): drafter.park() for drafter in self._instances()}

    def resume(self, parked: dict[int, tuple]) -> None:
        for drafter in self._instances():
            if id(drafter) in parked:
                drafter.resume(parked[id(drafter)])

    def _instances(self) -> list[Drafter]:
        return [*self.built.values(), *self._chains.values()]

    def target_layer_sets(self) -> list[tuple[int, ...]]:
        """The layer subsets of the target that the built drafters run, each once."""
        found = [layers for drafter in self.built.values() for layers in drafter.target_layer_sets()]
        return list(dict.fromkeys(found))
