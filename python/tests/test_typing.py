"""Typing and documentation as installed: the PEP 561 marker, the extension's stub
(nanobind's stubgen) naming every function and class of the extension with the
arguments they really take, type annotations on every public Python function, and a
docstring on everything public."""
import ast
import inspect
import os

import pytest

import mha
from mha import _mha

PACKAGE_DIR = os.path.dirname(os.path.realpath(mha.__file__))


def stub_definitions():
    """{name: ast node} of the top-level functions and classes of the installed _mha.pyi."""
    with open(os.path.join(PACKAGE_DIR, "_mha.pyi"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {node.name: node for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def argument_names(function):
    return [a.arg for a in function.args.posonlyargs + function.args.args
            + function.args.kwonlyargs]


def runtime_argument_names(nb_function):
    """The arguments of a nanobind function, from the signature it reports."""
    (text, *_), *_ = nb_function.__nb_signature__
    return argument_names(ast.parse(text + ": ...").body[0])


def public_extension_names():
    return sorted(name for name, value in vars(_mha).items()
                  if not name.startswith("_") and (callable(value) or inspect.isclass(value)))


def test_marker_and_stub_are_installed():
    assert os.path.isfile(os.path.join(PACKAGE_DIR, "py.typed"))
    assert os.path.isfile(os.path.join(PACKAGE_DIR, "_mha.pyi"))


def test_stub_names_every_function_and_class_of_the_extension():
    stub = stub_definitions()
    assert sorted(stub) == public_extension_names()
    for name in public_extension_names():
        if inspect.isclass(getattr(_mha, name)):
            continue
        assert argument_names(stub[name]) == runtime_argument_names(getattr(_mha, name)), name


def test_stub_declares_the_error_and_the_module_class():
    stub = stub_definitions()
    error = stub["Error"]
    assert [base.id for base in error.bases] == ["RuntimeError"]
    assert any(isinstance(node, ast.AnnAssign) and node.target.id == "status"
               for node in error.body)
    methods = {node.name: node for node in stub["Module"].body
               if isinstance(node, ast.FunctionDef)}
    for name in ("set_weights", "forward", "backward"):
        runtime = getattr(_mha.Module, name)
        assert argument_names(methods[name]) == runtime_argument_names(runtime), name


def public_python_callables():
    """(qualified name, function) of every public Python function and method of mha."""
    for name in mha.__all__:
        value = getattr(mha, name)
        if getattr(value, "__module__", "").startswith("mha._mha") or value is mha.Error:
            continue  # the extension's: typed by the stub
        if inspect.isclass(value):
            for member_name, member in vars(value).items():
                if member_name == "__init__" or not member_name.startswith("_"):
                    if isinstance(member, property):
                        member = member.fget
                    elif isinstance(member, classmethod):
                        member = member.__func__
                    if inspect.isfunction(member):
                        yield f"{name}.{member_name}", member
        else:
            yield name, value


def test_every_name_in_all_is_typed():
    stub = stub_definitions()
    python = {name.split(".")[0] for name, _ in public_python_callables()}
    for name in mha.__all__:
        assert name in stub or name in python, name


@pytest.mark.parametrize("name,function", list(public_python_callables()),
                         ids=[name for name, _ in public_python_callables()])
def test_python_functions_are_annotated(name, function):
    signature = inspect.signature(function)
    for parameter in signature.parameters.values():
        if parameter.name in ("self", "cls"):
            continue
        assert parameter.annotation is not inspect.Parameter.empty, f"{name}({parameter.name})"
    assert signature.return_annotation is not inspect.Signature.empty, name


def test_everything_public_has_a_docstring():
    import_torch = pytest.importorskip("torch")  # noqa: F841  (mha.torch needs it)
    import mha.torch
    documented = [mha, mha.torch] + [getattr(mha, name) for name in mha.__all__]
    documented += [function for _, function in public_python_callables()]
    documented += [getattr(_mha, name) for name in public_extension_names()]
    for value in documented:
        assert (inspect.getdoc(value) or "").strip(), value
