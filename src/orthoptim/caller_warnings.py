"""Warnings attributed to the user's line that called into orthoptim, not to a line inside it.

A fixed ``stacklevel`` miscounts: ``step()`` goes through torch.optim's hook wrapper, ``no_grad`` and
``torch.compiler.disable`` frames, and the same check is reached from ``step``, ``add_param_group``
or a constructor. Here the level is counted: the first frame outside the library (its ``train`` and
``cli`` packages count as callers) and outside torch, so ``filterwarnings(module=...)`` and the
reported file and line are the caller's.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

_LIBRARY = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CALLERS = tuple(os.path.join(_LIBRARY, name) + os.sep for name in ("train", "cli"))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _inside(filename: str) -> bool:
    if filename.startswith("<"):  # <stdin>, <string>: the user's (abspath would join it to the cwd)
        return False
    path = os.path.abspath(filename)
    if path.startswith(_LIBRARY):
        return not path.startswith(_CALLERS)
    return path.startswith(_TORCH)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` pointed at the first frame outside orthoptim and torch."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _inside(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    # Called from nothing but library frames (a test of one function): the frame that called this one.
    warnings.warn(message, category, stacklevel=level + 1 if frame is not None else 2)
