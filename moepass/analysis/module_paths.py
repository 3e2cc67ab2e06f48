"""Full `state_dict` paths of the modules a graph's nodes came from, also after a graph break.

Dynamo records each node's enclosing modules as `nn_module_stack: {key: (path, class)}`, the path
relative to the compiled frame's local (`L['self'].gate`). After a graph break the resumed frame's
local is an inner module, so every MoE layer reports the same `gate`, and include/exclude globs
written for full paths stop matching. The key is `str(id(module))` (Dynamo's inlined modules), so
while a graph is being rewritten the module itself is alive: this index finds it among the live
modules and climbs its parents to the top module, giving the path a `state_dict` of that model uses.
"""

from __future__ import annotations

import contextlib
import re
import contextvars
import gc

from torch import nn

_current: contextvars.ContextVar[ModuleIndex | None] = contextvars.ContextVar("moepass_module_index", default=None)
# wrappers whose own state_dict hooks drop their attribute name (torch.compile, checkpoint_wrapper, FSDP1)
WRAPPER_ATTRS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


class ModuleIndex:
    """Live modules by id and their parents, gathered once (about 0.1 s) on first use."""

    def __init__(self):
        self._modules: dict[int, nn.Module] | None = None
        self._parents: dict[int, list[tuple[nn.Module, str]]] = {}
        self._paths: dict[int, str | None] = {}
        self._holders: dict[int, list[tuple[nn.Module, str]]] | None = None  # id(parameter) -> (module, name)

    def _scan(self) -> None:
        # type(), not isinstance: a dead weakref proxy among the objects raises on __class__
        self._modules = {id(o): o for o in gc.get_objects() if issubclass(type(o), nn.Module)}
        for module in self._modules.values():
            for name, child in module._modules.items():
                if child is not None:
                    self._parents.setdefault(id(child), []).append((module, name))

    def path(self, key: str) -> str | None:
        """The module's path from the top of its model, or None (not a live module, or owned twice)."""
        try:
            module_id = int(key.split("@")[0])
        except ValueError:
            return None  # a named key (specialised module): the recorded path is all there is
        if module_id not in self._paths:
            if self._modules is None:
                self._scan()
            self._paths[module_id] = self._climb(module_id) if module_id in self._modules else None
        return self._paths[module_id]

    def _climb(self, module_id: int) -> str | None:
        parts, seen = [], {module_id}
        while module_id in self._parents:
            owners = self._parents[module_id]
            if len(owners) != 1:
                return None  # a module registered in two places: its path is ambiguous
            parent, name = owners[0]
            parts.append(name)
            module_id = id(parent)
            if module_id in seen:
                return None
            seen.add(module_id)
        return ".".join(p for p in reversed(parts) if p not in WRAPPER_ATTRS)


    def lineage(self, key: str) -> list[nn.Module]:
        """The live module under `key` and its parents up to the top of its model ([] when not found)."""
        try:
            module_id = int(key.split("@")[0])
        except ValueError:
            return []
        if self._modules is None:
            self._scan()
        found, seen = [], set()
        while module_id in self._modules and module_id not in seen:
            seen.add(module_id)
            found.append(self._modules[module_id])
            owners = self._parents.get(module_id, [])
            if not owners:
                break
            module_id = id(owners[0][0])
        return found

    def holders(self, param) -> list[tuple[nn.Module, str]]:
        """The live modules holding `param` and its name in each (two for a weight tied to an embedding)."""
        if self._modules is None:
            self._scan()
        if self._holders is None:
            self._holders = {}
            for module in self._modules.values():
                for name, p in module._parameters.items():
                    if p is not None:
                        self._holders.setdefault(id(p), []).append((module, name))
        return self._holders.get(id(param), [])

    def module_path(self, module: nn.Module) -> str | None:
        return self.path(str(id(module)))

    def top(self, module: nn.Module) -> nn.Module:
        """The top of the model that holds `module` (its first parent's, where it has two)."""
        found = self.lineage(str(id(module)))
        return found[-1] if found else module


def current() -> ModuleIndex:
    """The index of the running backend call, or a fresh one (a finder called outside a compile, as tests do)."""
    return _current.get() or ModuleIndex()


@contextlib.contextmanager
def indexing():
    """Resolve module paths through the live modules while the block runs (one backend call)."""
    token = _current.set(ModuleIndex())
    try:
        yield
    finally:
        _current.reset(token)


def resolve(key: str) -> str | None:
    index = _current.get()
    return index.path(key) if index is not None else None


def lineage(key: str) -> list[nn.Module]:
    index = _current.get()
    return index.lineage(key) if index is not None else []


_PATH_PREFIX = re.compile(r"^L\[['\"][^'\"]+['\"]\]\.?")
_DICT_ACCESS = re.compile(r"(?:^|\.)__dict__\[['\"]_(?:modules|parameters|buffers)['\"]\]")
# `moe.forward.__closure__[0].cell_contents.__self__`: a module reached through a method wrapped in a closure
# (torchtitan's forward_with_redistribution) or bound as a default argument; its __self__ is that module
_BOUND_METHOD = re.compile(r"\.[A-Za-z_]\w*(?:\.__closure__\.\d+\.cell_contents|\.__kwdefaults__\.\w+|"
                           r"\.__defaults__\.\d+|\.__wrapped__)+\.__self__(?=\.|$)")


def normalize_module_path(raw: str) -> str:
    """`L['self'].layers[0].attention.wq` -> `layers.0.attention.wq` (the state_dict spelling).

    Dynamo spells modules reached through a wrapper as `layers.0.__dict__['_modules']['_checkpoint_wrapped_module']`
    and through a wrapped method as `moe.forward.__closure__[0].cell_contents.__self__`; both become the
    module's own path, and wrapper attributes are dropped as the wrappers' state_dict does.
    """
    path = _PATH_PREFIX.sub("", raw)
    path = _DICT_ACCESS.sub(".", path)
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)
    path = _BOUND_METHOD.sub("", "." + path.lstrip("."))
    parts = [p for p in path.split(".") if p and p not in WRAPPER_ATTRS]
    return ".".join(parts)
