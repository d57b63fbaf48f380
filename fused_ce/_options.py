"""The ops' options as the Python fronts pass them, built from the ops' schemas.

The options are declared once, in C++ (csrc/options.h): this module reads each op's schema (names, types, defaults)
once at import, builds a call's option arguments by name from a front's keywords (a float from any real number, an
int from an int only, as torch takes them: a wrong type is a TypeError naming the function and the argument), and
checks that every option of a schema has a keyword in its front (an ImportError otherwise).
"""

import inspect
import operator

import torch


def _schema_options(op):
    """An op's options in schema order: (name, type, default) of its arguments after the tensors, the type
    "float", "int", "bool" or "str" (an optional one's: None allowed)."""
    return tuple(
        (a.name, str(a.type).removeprefix("Optional[").removesuffix("]"), a.default_value)
        for a in op.default._schema.arguments
        if "Tensor" not in str(a.type)
    )


# Read once, at import (torch.compile traces the fronts: plain tuples, not the schemas' objects).
_OPTIONS = {
    name: _schema_options(getattr(torch.ops.fused_ce, name))
    for name in (
        "_linear_cross_entropy", "linear_cross_entropy", "linear_log_probs", "linear_policy_loss",
        "linear_distillation_loss",
    )
}  # fmt: skip
_TAKES_CALLER = {op for op, options in _OPTIONS.items() if any(name == "caller" for name, _, _ in options)}
_PUBLIC_LOSS_OPTIONS = tuple(n for n, _, _ in _OPTIONS["linear_cross_entropy"])  # the public op's (saved graphs)


def _integer(function, name, value):
    """An int option as torch takes one: a float, str or bool is a TypeError, as in ``F.cross_entropy`` (never
    rounded)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{function}: {name} must be an int, got {type(value).__name__} {value!r}")
    return operator.index(value)


def _real(function, name, value):
    """A float option from a real number (an int, a numpy or 0-dim torch scalar too): a str is a TypeError, as in
    ``F.cross_entropy`` (never parsed)."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        raise TypeError(f"{function}: {name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def _flag(function, name, value):
    """A bool option from a bool (or a numpy bool, an int: their truth): a str is a TypeError (``"False"`` is
    true)."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{function}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


_CONVERT = {"int": _integer, "float": _real, "bool": _flag, "str": lambda function, name, value: str(value)}


def _option_arguments(op, caller, shard=None, **values):
    """The option arguments of the op named ``op``, by name: each from ``values`` or at its schema default, as
    its schema types it (a float from any real, an int from an int only); ``shard``: (group name, vocab_start,
    shard sizes) or None; ``caller``, the function the errors name."""
    group, vocab_start, sizes = shard if shard is not None else ("", 0, [0])
    values.update(process_group=group, vocab_start=vocab_start, vocab_size=sum(sizes), max_shard_rows=max(sizes))
    if op in _TAKES_CALLER:
        values["caller"] = caller
    arguments = {}
    for name, kind, default in _OPTIONS[op]:
        value = values.pop(name, default)
        if name == "ignore_index" and value is None:
            value = -100  # (as torch)
        if value is not None:
            value = _CONVERT[kind](caller, name, value)
        arguments[name] = value
    if values:  # (a keyword of the front that the op does not declare)
        raise TypeError(f"{caller}: {op} takes no option {sorted(values)}")
    return arguments


# The options a front's own keywords do not name: the shard, the caller, and what a front sets itself.
_SET_BY_THE_FRONT = {"process_group", "vocab_start", "vocab_size", "max_shard_rows", "caller"}


def _check_front(function, op, internal=()):
    """At import: every option of the op is a keyword of its front (or set by the front itself): a new C++ option
    needs a keyword here."""
    missing = [
        name
        for name, _, _ in _OPTIONS[op]
        if name not in inspect.signature(function).parameters and name not in _SET_BY_THE_FRONT | set(internal)
    ]
    if missing:
        raise ImportError(
            f"fused_ce: {function.__name__} has no keyword for the options {missing} of "
            f"fused_ce::{op} (csrc/options.h): give each new option a keyword in fused_ce/functional.py"
        )


_DEFAULT_OPTIONS = _option_arguments("_linear_cross_entropy", "linear_cross_entropy")
