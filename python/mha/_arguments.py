"""Checks of scalar arguments, shared by the public functions and classes.

Each returns the value as the extension takes it, or raises TypeError (the
wrong Python type) or ValueError (a value out of range) naming the argument.
"""
import numbers

import numpy as np


def real(x, name):
    """x as a float; TypeError unless it is a real number (bool is not one)."""
    if type(x) is float:
        return x
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, not {type(x).__name__}")
    return float(x)


def flag(x, name):
    """x as a bool; TypeError unless it is a Python or NumPy bool."""
    if x is False or x is True:
        return x
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, not {type(x).__name__}")
    return bool(x)


def integer(x, name, lowest, highest=None):
    """x as an int in [lowest, highest]; TypeError unless it is an integer (bool is not one)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(x).__name__}")
    if x < lowest or (highest is not None and x > highest):
        bounds = f">= {lowest}" if highest is None else f"in [{lowest}, {highest}]"
        raise ValueError(f"{name} must be {bounds}, not {x}")
    return int(x)


def call_settings(backend, threads):
    """(backend, threads) of one call, checked: None each, or a str and an int in [1, 4096]."""
    if backend is not None and type(backend) is not str:
        raise TypeError(f"backend must be a str, not {type(backend).__name__}")
    return backend, None if threads is None else integer(threads, "threads", 1, 4096)


def activations_argument(x):
    """activations= of the module's calls as a flag: "float32" (the default: everything
    between the products in float32) or "input" (True: a bfloat16 or float16 query's
    projections and heads rounded to its dtype, as PyTorch's module in that dtype keeps
    them)."""
    if not isinstance(x, str):
        raise TypeError(f"activations must be 'float32' or 'input', not {type(x).__name__}")
    if x not in ("float32", "input"):
        raise ValueError(f"activations must be 'float32' or 'input', not {x!r}")
    return x == "input"
