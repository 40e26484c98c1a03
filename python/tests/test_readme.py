"""The README's Python examples run as printed: the first computes what its comments say it
replaces (PyTorch's module, within the module tests' tolerance); the training examples (README.md
and python/README.md, its module's too) fill the gradients they say they fill."""
import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
PYTHON_README = os.path.join(os.path.dirname(__file__), "..", "README.md")


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


def training_example(path, heading):
    with open(path, encoding="utf-8") as f:
        section = f.read().split(f"\n{heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("path, heading", [(README, "### Training"),
                                           (PYTHON_README, "## Training")])
def test_training_examples_fill_the_gradients(path, heading):
    import mha
    torch.manual_seed(0)
    names = {"torch": torch, "mha": mha}
    exec(compile(training_example(path, heading), path, "exec"), names)  # noqa: S102
    for name in ("q", "k", "v", "bias"):
        if name not in names:
            continue
        leaf = names[name]
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape, name
        assert torch.isfinite(leaf.grad).all() and leaf.grad.abs().max() > 0, name
    if "bias" in names:  # is_causal: the keys after each query have no gradient
        assert torch.all(torch.triu(names["bias"].grad, diagonal=1) == 0)


def test_module_training_example_fills_every_gradient():
    import mha.torch  # noqa: F401  (the example's import)
    torch.manual_seed(0)
    names = {}
    exec(compile(training_example(PYTHON_README, "### The module"), PYTHON_README, "exec"),
         names)  # noqa: S102
    layer = names["layer"]
    assert names["step"] == 2 and torch.isfinite(names["loss"])
    for name, parameter in [("x", names["x"])] + list(layer.named_parameters()):
        assert parameter.grad is not None and parameter.grad.shape == parameter.shape, name
        assert torch.isfinite(parameter.grad).all() and parameter.grad.abs().max() > 0, name
