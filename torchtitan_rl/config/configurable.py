"""torchtitan's component pattern, reused as is.

Every component is a class with a nested ``@dataclass(kw_only=True, slots=True) class Config``;
``Config.build(**runtime)`` constructs the owner with runtime objects (meshes, tokenizers) that do not
belong in a config file. torchtitan enforces the dataclass form in ``__init_subclass__``.
"""

from torchtitan.config.configurable import Configurable

__all__ = ["Configurable"]
