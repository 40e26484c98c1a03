"""The README's Python example runs as printed, and computes what its comments say it
replaces (PyTorch's module, within the module tests' tolerance)."""
import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def python_example():
    with open(README, encoding="utf-8") as f:
        section = f.read().split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs_and_matches_torch():
    torch.manual_seed(0)
    names = {}
    exec(compile(python_example(), "README.md", "exec"), names)  # noqa: S102 (our own README)
    with torch.no_grad():
        want, _ = names["attention"](names["x"], names["x"], names["x"], need_weights=False)
    assert names["weights"] is None and names["out"].shape == want.shape
    scale = max(1.0, want.abs().max().item())
    assert np.abs((names["out"] - want).numpy()).max() <= 1e-5 * scale
