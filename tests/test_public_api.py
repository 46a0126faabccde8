"""The public face: every exported name exists, reports ``dist_resume`` as its module, says collective or local."""

from __future__ import annotations

import importlib.metadata
import inspect
import pickle
import re
import typing

import pytest

import dist_resume
import dist_resume.testing

PUBLIC = [getattr(dist_resume, n) for n in dist_resume.__all__ if n != "__version__"]
FUNCTIONS = [o for o in PUBLIC if inspect.isfunction(o)]
CLASSES = [o for o in PUBLIC if inspect.isclass(o)]
EXCEPTIONS = [c for c in CLASSES if issubclass(c, BaseException)]


def test_every_exported_name_exists_once():
    assert len(set(dist_resume.__all__)) == len(dist_resume.__all__)
    missing = [n for n in dist_resume.__all__ if not hasattr(dist_resume, n)]
    assert missing == []
    assert isinstance(dist_resume.__version__, str)


def test_the_installed_version_is_the_package_version():
    # pyproject.toml reads it from dist_resume/_core/version.py: one owner, never two numbers
    assert importlib.metadata.version("dist-resume") == dist_resume.__version__


@pytest.mark.parametrize("obj", FUNCTIONS + CLASSES, ids=lambda o: o.__name__)
def test_exported_objects_show_the_public_path(obj):
    assert obj.__module__ == "dist_resume"
    assert getattr(dist_resume, obj.__qualname__) is obj  # what pickle and tracebacks resolve
    assert obj.__doc__


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda o: o.__name__)
def test_public_functions_say_collective_or_local(fn):
    doc = fn.__doc__.lower()  # "Collective." / "Local." or, for mixed cases, "For a folder: collective ..."
    assert "collective" in doc or "local" in doc


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda o: o.__name__)
def test_exported_exceptions_pickle_by_their_public_path(cls):
    err = cls("what was found; what to do")
    assert f"cdist_resume\n{cls.__name__}\n".encode() in pickle.dumps(err, protocol=0)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err)
    assert repr(cls) == f"<class 'dist_resume.{cls.__name__}'>"


def test_result_types_of_public_functions_are_exported():
    for name in ("ConvertResult", "ArchiveFinding", "ResumeResult", "CheckpointInfo", "RankInfo", "resolve_checkpoint"):
        assert name in dist_resume.__all__
    assert "collective" in dist_resume.resolve_checkpoint.__doc__


def test_cli_report_builder_does_not_shadow_the_public_name():
    from dist_resume.cli import _inspect

    assert not hasattr(_inspect, "inspect_checkpoint") and callable(_inspect.describe_checkpoint)


def test_testing_module_is_public_and_documented():
    assert dist_resume.testing.__all__ == ["RankFailure", "run_ranks", "kill_process_group"]
    assert "Local" in dist_resume.testing.run_ranks.__doc__ and "Example" in dist_resume.testing.__doc__


def _members(obj):
    yield obj
    if inspect.isclass(obj) and not issubclass(obj, BaseException):
        for name, member in vars(obj).items():
            if not name.startswith("_") and inspect.isfunction(member):
                yield member
            elif isinstance(member, property) and member.fget is not None:
                yield member.fget


def _named_types(hint):
    if inspect.isclass(hint):
        yield hint
    for arg in typing.get_args(hint):
        yield from _named_types(arg)


@pytest.mark.parametrize("obj", FUNCTIONS + CLASSES, ids=lambda o: o.__name__)
def test_annotations_resolve_and_name_only_exported_types(obj):
    # typing.get_type_hints resolves a class's string annotations in sys.modules[cls.__module__]:
    # after the rename to "dist_resume" they must still resolve, and every toolkit type a public
    # signature mentions must be importable from the package
    private = set()
    for member in _members(obj):
        for hint in typing.get_type_hints(member).values():
            for t in _named_types(hint):
                if t.__module__.startswith("dist_resume.") and t.__module__ != "dist_resume.testing":
                    private.add(f"{t.__module__}.{t.__qualname__}")
    assert private == set()


def _public_member(name: str) -> bool:
    owner, _, attr = name.partition(".")
    return owner in dist_resume.__all__ and bool(attr) and hasattr(getattr(dist_resume, owner), attr)


@pytest.mark.parametrize("obj", FUNCTIONS + CLASSES, ids=lambda o: o.__name__)
def test_docstrings_cite_only_public_names(obj):
    # a reader of help(dist_resume.x) can follow every :func:/:class: reference: an exported
    # name, a method of the same class, or torch's own
    own = set(vars(obj)) if inspect.isclass(obj) else set()
    cited = set()
    for member in _members(obj):
        cited.update(re.findall(r":(?:func|class|meth|attr|mod):`~?([\w.]+)`", inspect.getdoc(member) or ""))
    private = {
        name
        for name in cited
        if not name.startswith("torch.")
        and name.removeprefix("dist_resume.") not in dist_resume.__all__
        and name.split(".")[-1] not in own
        and not _public_member(name.removeprefix("dist_resume."))
    }
    assert private == set()
