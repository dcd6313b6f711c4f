"""ReasoningGymTask: reasoning-gym's procedural datasets as a `SupervisedTask`, scored by their own verifiers.

    [task]
    type = "reasoning_gym"
    turns = 1                                        # > 1: a follow-up question per turn
    [[task.datasets]]
    name = "spell_backward"                          # any reasoning_gym.create_dataset name
    weight = 1.0
    config = { min_word_len = 3, max_word_len = 5 }  # that dataset's own config fields

    controller: task = ReasoningGymTask.Config(...).build()
    controller: episode = task.dataset(split)[i]     entries drawn from reasoning-gym's CompositeDataset
    Rollouter:  env = task.make_env(episode)         one question per turn
                env.step(reply) -> score_answer(answer, entry) of that turn's entry, unchanged
    WarmStart:  task.solved_conversation(episode)    the entries' own answers

Held out by question: a question belongs to the validation split when a hash of its text falls in
the lowest ``validation_fraction`` of the range, so no validation question is ever trained on,
however many episodes either split has. Each split draws from its own seeds and skips the other
split's questions.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import importlib.util
import types
import typing
import warnings
from typing import Any

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.rollout.message_env import EnvStep, Message, MessageEnv
from torchtitan_rl.task import EpisodeSplit, Split, TaskConfig

EXTRA_HINT = "pip install -e '.[envs]' (scripts/setup_env.sh installs it)"
MAX_DRAWS = 200
"""Draws per slot before a split gives up finding a question of its own (a dataset whose every
question hashes into the other split)."""
_VALIDATION_SEED_OFFSET = 1_000_003
_TASK_OWNED_FIELDS = ("seed", "size")


@dataclasses.dataclass(kw_only=True, slots=True)
class DatasetSpec:
    """One reasoning-gym dataset of the mix (reasoning_gym.composite.DatasetSpec's fields)."""

    name: str
    """A name `reasoning_gym.create_dataset` knows (`spell_backward`, `chain_sum`, ...)."""
    weight: float = 1.0
    """Its share of the questions, relative to the other datasets' weights (> 0)."""
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """That dataset's own config fields (e.g. {min_word_len = 3}); seed and size are the task's."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReasoningGymEpisode:
    episode_id: str
    entries: tuple[dict[str, Any], ...]
    """One reasoning-gym entry (question, answer, metadata) per turn."""


def import_reasoning_gym() -> Any:
    """``reasoning_gym``, imported without the SyntaxWarnings some of its dependencies' modules
    raise when Python first compiles them (console noise, not the user's concern)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        import reasoning_gym
    return reasoning_gym


def is_validation_question(question: str, validation_fraction: float) -> bool:
    """Whether ``question`` belongs to the validation split (a hash of its text, so the same
    question lands in the same split whatever seed or index drew it)."""
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") < validation_fraction * 2**64


def reply_answer(reply: str, answer_tag: str | None) -> str | None:
    """The answer a reply gives: inside its last ``<answer_tag>`` block (None without one), or the
    whole reply stripped when ``answer_tag`` is None."""
    if answer_tag is None:
        return reply.strip()
    return import_reasoning_gym().utils.extract_answer(reply, tag_name=answer_tag)


def dataset_fields(name: str) -> dict[str, tuple[Any, Any]]:
    """The fields of dataset ``name``'s own config dataclass that a ``config`` table may set:
    {field: (type hint, default)}; ``seed`` and ``size`` are the task's, so they are left out."""
    config_cls = import_reasoning_gym().factory.DATASETS[name][1]
    hints = typing.get_type_hints(config_cls)
    return {f.name: (hints.get(f.name, Any), f.default)
            for f in dataclasses.fields(config_cls) if f.name not in _TASK_OWNED_FIELDS}


def check_dataset_config(name: str, config: dict[str, Any], key: str) -> None:
    """Raise ValueError naming ``key`` when reasoning-gym would refuse ``config`` for dataset
    ``name``: a field its config dataclass lacks ("did you mean"), a value of neither the field's
    type nor its default's (some datasets annotate ``int`` and default to a float), or a value
    its own ``validate()`` rejects (its assertion's message)."""
    fields = dataset_fields(name)
    for field, value in config.items():
        if field not in fields:
            near = difflib.get_close_matches(field, list(fields), n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(f"{key}: {name} has no config field {field!r}; {hint}its fields: "
                             f"{', '.join(fields) or 'none'} (python -m "
                             f"torchtitan_rl.envs.reasoning_gym --fields {name})")
        expected, default = fields[field]
        if not (_is_instance(value, expected)
                or isinstance(default, float) and _is_instance(value, float)):
            raise ValueError(f"{key}.{field}: expected {_type_name(expected)}, got {value!r} "
                             f"({type(value).__name__})")
    config_cls = import_reasoning_gym().factory.DATASETS[name][1]
    try:
        dataset_config = config_cls(**config, seed=0, size=1)
        if hasattr(dataset_config, "validate"):
            dataset_config.validate()
    except (AssertionError, TypeError, ValueError, KeyError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"{key}: reasoning-gym's {name} refused it: {message}") from None


def _is_instance(value: Any, hint: Any) -> bool:
    """Whether ``value`` (a TOML value) fits ``hint``; hints other than the plain scalars,
    their Optional and a tuple/list of them are left to the dataset's own ``validate()``."""
    if hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_instance(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if origin in (list, tuple):
        return isinstance(value, list | tuple)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


class ReasoningGymSplit(EpisodeSplit[ReasoningGymEpisode]):
    """The episodes of one split: episode i asks the questions of slots i * turns, ..."""

    def __init__(self, composite: Any, *, split: Split, turns: int, num_episodes: int,
                 validation_fraction: float) -> None:
        super().__init__(split, num_episodes)
        self._composite = composite
        self._turns = turns
        self._validation_fraction = validation_fraction

    def episode(self, index: int) -> ReasoningGymEpisode:
        entries = tuple(self._entry(index * self._turns + turn) for turn in range(self._turns))
        return ReasoningGymEpisode(episode_id=f"{self.split}/{index}", entries=entries)

    def _entry(self, slot: int) -> dict[str, Any]:
        stride = len(self) * self._turns
        want_validation = self.split == "validation"
        for draw in range(MAX_DRAWS):
            entry = self._composite[slot + draw * stride]
            if is_validation_question(entry["question"], self._validation_fraction) == want_validation:
                return entry
        raise ValueError(f"task.datasets: {MAX_DRAWS} draws gave no question of the {self.split} "
                         f"split (validation_fraction={self._validation_fraction}); the datasets "
                         f"have too few distinct questions")


class ReasoningGymEnv(MessageEnv):
    """One episode: turn t asks entry t's question; the reply is scored by its dataset."""

    def __init__(self, episode: ReasoningGymEpisode, composite: Any, *,
                 answer_tag: str | None, system_prompt: str | None) -> None:
        self.episode = episode
        self._composite = composite
        self._answer_tag = answer_tag
        self._system_prompt = system_prompt
        self._turn = 0

    async def init(self) -> list[Message]:
        self._turn = 0
        messages: list[Message] = []
        if self._system_prompt:
            messages.append({"role": "system", "content": self._system_prompt})
        messages.append({"role": "user", "content": self.episode.entries[0]["question"]})
        return messages

    async def step(self, assistant_message: Message) -> EnvStep:
        entry = self.episode.entries[self._turn]
        answer = reply_answer(assistant_message.get("content") or "", self._answer_tag)
        score = self._composite.score_answer(answer, entry)
        self._turn += 1
        parts = {"score": score}
        if self._turn >= len(self.episode.entries):
            return EnvStep(done=True, reward_parts=parts)
        question = self.episode.entries[self._turn]["question"]
        return EnvStep(messages=[{"role": "user", "content": question}], reward_parts=parts)

    def score(self, replies: list[str], reward_parts: list[dict[str, Any]]) -> float:
        """The mean of the turns' scores; a turn never reached scores 0."""
        return sum(self.turn_rewards(replies, reward_parts)) / len(self.episode.entries)

    def turn_rewards(self, replies: list[str], reward_parts: list[dict[str, Any]]) -> list[float]:
        return [parts.get("score", 0.0) for parts in reward_parts]


class ReasoningGymTask(Configurable):
    """Questions from reasoning-gym datasets, one per turn, rewarded by ``score_answer``."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TaskConfig):
        warm_start_independent_fields = ("num_validation_episodes",)

        datasets: list[DatasetSpec] = dataclasses.field(
            default_factory=lambda: [DatasetSpec(name="spell_backward")])
        """The datasets to mix, each with its weight and own config ([[task.datasets]] tables)."""
        turns: int = 1
        """Questions per episode: turn 1 asks one, each later turn asks the next (>= 1)."""
        seed: int = 0
        """Seeds the mix and every dataset (validation draws from seeds of its own)."""
        validation_fraction: float = 0.2
        """Share of the questions (by a hash of their text) reserved for validation, in (0, 1)."""
        num_train_episodes: int = 100_000
        """Episodes of the training split (>= 1)."""
        num_validation_episodes: int = 256
        """Episodes of the held-out split (>= 1); validation.num_prompts takes the first ones."""
        answer_tag: str | None = None
        """The reply's answer is inside its last <answer_tag>...</answer_tag> block (reasoning-gym's
        convention with "answer"); None: the whole reply, stripped, is the answer."""
        system_prompt: str | None = None
        """A system message opening every episode; None: the question comes first."""

        def __post_init__(self) -> None:
            if importlib.util.find_spec("reasoning_gym") is None:
                raise ValueError(f"reasoning-gym is not installed: {EXTRA_HINT}")
            for name in ("turns", "num_train_episodes", "num_validation_episodes"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if not 0.0 < self.validation_fraction < 1.0:
                raise ValueError(f"validation_fraction must be in (0, 1), got "
                                 f"{self.validation_fraction}")
            if not self.datasets:
                raise ValueError("datasets: name at least one reasoning-gym dataset")
            known = sorted(import_reasoning_gym().factory.DATASETS)
            for i, spec in enumerate(self.datasets):
                if spec.name not in known:
                    near = difflib.get_close_matches(spec.name, known, n=1)
                    hint = f"; did you mean {near[0]!r}?" if near else ""
                    raise ValueError(f"datasets[{i}].name: no reasoning-gym dataset "
                                     f"{spec.name!r}{hint} (python -m "
                                     f"torchtitan_rl.envs.reasoning_gym --list)")
                if not spec.weight > 0:
                    raise ValueError(f"datasets[{i}].weight must be > 0, got {spec.weight}")
                reserved = {"seed", "size"} & set(spec.config)
                if reserved:
                    raise ValueError(f"datasets[{i}].config: {sorted(reserved)} are the task's "
                                     f"(task.seed, task.num_*_episodes)")
                check_dataset_config(spec.name, spec.config, f"datasets[{i}].config")

    def __init__(self, config: Config) -> None:
        self.config = config
        train = self._composite(config.seed, config.num_train_episodes)
        self._scorer = train  # score_answer dispatches by the entry's dataset: any split's does
        self._splits = {
            "train": ReasoningGymSplit(
                train, split="train",
                turns=config.turns, num_episodes=config.num_train_episodes,
                validation_fraction=config.validation_fraction),
            "validation": ReasoningGymSplit(
                self._composite(config.seed + _VALIDATION_SEED_OFFSET,
                                config.num_validation_episodes),
                split="validation", turns=config.turns,
                num_episodes=config.num_validation_episodes,
                validation_fraction=config.validation_fraction),
        }

    def _composite(self, seed: int, num_episodes: int) -> Any:
        composite = import_reasoning_gym().composite
        specs = [composite.DatasetSpec(name=s.name, weight=s.weight, config=dict(s.config))
                 for s in self.config.datasets]
        size = num_episodes * self.config.turns * MAX_DRAWS
        try:
            return composite.CompositeDataset(
                composite.CompositeConfig(datasets=specs, seed=seed, size=size))
        except (AssertionError, TypeError, ValueError, KeyError) as e:
            names = ", ".join(s.name for s in self.config.datasets)
            raise ValueError(f"task.datasets ({names}): reasoning-gym refused the config: "
                             f"{type(e).__name__}: {e}") from e

    def dataset(self, split: Split) -> ReasoningGymSplit:
        if split not in self._splits:
            raise ValueError(f"split must be one of {sorted(self._splits)}, got {split!r}")
        return self._splits[split]

    def make_env(self, episode: ReasoningGymEpisode) -> ReasoningGymEnv:
        return ReasoningGymEnv(episode, self._scorer, answer_tag=self.config.answer_tag,
                               system_prompt=self.config.system_prompt)

    def solved_conversation(self, episode: ReasoningGymEpisode) -> list[Message]:
        messages: list[Message] = []
        if self.config.system_prompt:
            messages.append({"role": "system", "content": self.config.system_prompt})
        for entry in episode.entries:
            answer = str(entry["answer"])
            if self.config.answer_tag is not None:
                answer = f"<{self.config.answer_tag}>{answer}</{self.config.answer_tag}>"
            messages += [{"role": "user", "content": entry["question"]},
                         {"role": "assistant", "content": answer}]
        return messages


def main(argv: list[str] | None = None) -> int:
    """``python -m torchtitan_rl.envs.reasoning_gym --list | --fields NAME``: the dataset names a
    ``[[task.datasets]]`` table takes, or one dataset's config fields with their types and
    defaults (what its ``config`` table may set)."""
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_rl.envs.reasoning_gym",
        description="reasoning-gym's datasets, for [[task.datasets]] tables (docs/environments.md)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", action="store_true", help="every dataset name, one a line")
    what.add_argument("--fields", metavar="NAME", help="the config fields of dataset NAME")
    args = parser.parse_args(argv)
    known = sorted(import_reasoning_gym().factory.DATASETS)
    if args.list:
        print("\n".join(known))
        return 0
    if args.fields not in known:
        near = difflib.get_close_matches(args.fields, known, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        parser.exit(2, f"error: no reasoning-gym dataset {args.fields!r}{hint} (--list lists "
                       f"them)\n")
    config_cls = import_reasoning_gym().factory.DATASETS[args.fields][1]
    doc = (config_cls.__doc__ or "").strip().splitlines()
    lines = [f"{args.fields}: {doc[0]}" if doc else args.fields]
    lines += [f"  {field} = {default!r}  ({_type_name(hint)})"
              for field, (hint, default) in dataset_fields(args.fields).items()]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
