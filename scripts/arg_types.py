"""argparse types the GPU scripts share (scripts/ is on sys.path when one of
them runs: Python puts the script's folder first). Only the standard
library here, so a script's --help and argument errors need no GPU stack."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection


def int_list(allowed: Collection[int]) -> Callable[[str], list[int]]:
    """An argparse `type`: comma-separated integers, each one of `allowed`
    and each once; a bad list raises ArgumentTypeError naming the allowed
    values (or the text that is not integers, or the repeated values);
    argparse puts the option's name before it."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        return _checked(values, allowed, text)

    return parse


def new_file(text: str) -> str:
    """An argparse `type` for an output file written after the GPU work: a
    path that does not exist yet (nothing a user wrote is overwritten) in a
    directory that does; else ArgumentTypeError saying which. Open it with
    mode "x" when writing."""
    import os

    parent = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name, e.g. results.json")
    if os.path.lexists(text):
        raise argparse.ArgumentTypeError(f"{text} exists; give a new file name (nothing is overwritten)")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} does not exist")
    return text


def name_list(allowed: Collection[str]) -> Callable[[str], list[str]]:
    """An argparse `type`: comma-separated names, each one of `allowed`
    (e.g. sorted(moebench.models.PRESETS)) and each once; a bad list raises
    ArgumentTypeError naming the unknown (or repeated) ones and the allowed names."""

    def parse(text: str) -> list[str]:
        return _checked(text.split(","), allowed, text)

    return parse


def positive_int(text: str) -> int:
    """An argparse `type`: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _checked(values: list, allowed: Collection, text: str) -> list:
    """`values` if each is one of `allowed` and none repeats; else
    ArgumentTypeError naming the unknown values and the allowed ones, or the
    repeated ones."""
    bad = [v for v in values if v not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad} not in {list(allowed)}")
    _once(values, text)
    return values


def _once(values: list, text: str) -> None:
    """ArgumentTypeError naming the values `text` repeats (each would be measured twice)."""
    twice = sorted({v for v in values if values.count(v) > 1}, key=values.index)
    if twice:
        raise argparse.ArgumentTypeError(f"{twice} given more than once in {text!r}")
