"""The public face: ``dist_resume`` (what a training script uses, at most 33 names), ``dist_resume.tools`` (the CLI's
back ends), ``dist_resume.errors`` (every exception); each exported name exists, reports its public module, says
collective or local; the names that moved in 0.3 still work, with a DeprecationWarning naming their new home."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import pickle
import re
import typing
import warnings

import pytest

import dist_resume
import dist_resume.testing
import dist_resume.testing.sim
from dist_resume import errors, tools
from dist_resume._core import errors as _errors

MODULES = (dist_resume, tools, errors)
PUBLIC = [(m, getattr(m, n)) for m in MODULES for n in m.__all__ if n != "__version__"]
OWN = [(m, o) for m, o in PUBLIC if o.__module__ == m.__name__]  # DistResumeError is errors' (dist_resume re-exports)
FUNCTIONS: list[typing.Any] = [o for _, o in OWN if inspect.isfunction(o)]
CLASSES: list[typing.Any] = [o for _, o in OWN if inspect.isclass(o)]
EXCEPTIONS = [c for c in CLASSES if issubclass(c, BaseException) and not issubclass(c, Warning)]
# what a training script needs, set_verbosity (quieting the library's own lines) the last added: the face stays small
NAME_BUDGET = 33


def _name(obj: object) -> str:
    return getattr(obj, "__name__", repr(obj))


def test_every_exported_name_exists_once_and_the_top_level_stays_within_its_budget():
    for module in MODULES:
        assert len(set(module.__all__)) == len(module.__all__), module.__name__
        assert [n for n in module.__all__ if not hasattr(module, n)] == [], module.__name__
    assert len({*dist_resume.__all__, "destroy_distributed"}) <= NAME_BUDGET, dist_resume.__all__
    assert not set(dist_resume.__all__) & set(tools.__all__)
    assert set(dist_resume.__all__) & set(errors.__all__) == {"DistResumeError"}
    assert dist_resume.DistResumeError is errors.DistResumeError
    assert isinstance(dist_resume.__version__, str)


def test_errors_holds_every_exception_and_warning_of_the_hierarchy():
    defined = {
        name
        for name, obj in vars(_errors).items()
        if inspect.isclass(obj) and issubclass(obj, _errors.DistResumeError) and not name.startswith("_")
    }
    assert defined <= set(errors.__all__)
    assert set(errors.__all__) == defined | {"TorchSecurityWarning"}
    assert issubclass(errors.TorchSecurityWarning, UserWarning)
    for name in errors.__all__:
        assert f"{name}" in errors.__doc__, f"the hierarchy in errors' docstring lacks {name}"


def test_tools_holds_the_clis_back_ends_and_their_result_types():
    for name in ("inspect_checkpoint", "verify_archive", "convert_checkpoint", "latest_checkpoint"):
        assert name in tools.__all__
    for name in ("ConvertResult", "ArchiveFinding", "CheckpointInfo", "resolve_checkpoint", "KeyForm", "FindingKind"):
        assert name in tools.__all__
    assert "collective" in (tools.resolve_checkpoint.__doc__ or "")
    for name in ("ResumeResult", "ResumeOptions", "RankInfo", "TrainingObjects", "AsyncSave"):
        assert name in dist_resume.__all__


def test_set_verbosity_is_public_local_and_names_its_environment_variable():
    assert "set_verbosity" in dist_resume.__all__ and dist_resume.set_verbosity.__module__ == "dist_resume"
    doc = dist_resume.set_verbosity.__doc__ or ""
    assert "Local" in doc and "DIST_RESUME_VERBOSITY" in doc and "Example::" in doc


@pytest.mark.parametrize("name", sorted(set(tools.__all__) | set(errors.__all__) - {"DistResumeError"}))
def test_a_name_that_moved_still_works_for_one_release_with_a_warning_naming_its_home(name):
    home = tools if name in tools.__all__ else errors
    with pytest.warns(DeprecationWarning, match=rf"dist_resume\.{name} moved to {home.__name__}\.{name}"):
        old = getattr(dist_resume, name)
    assert old is getattr(home, name)
    assert name not in dist_resume.__all__ and name not in vars(dist_resume)


def test_an_unknown_name_is_an_attribute_error_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'resume_checkpoint'"):
            dist_resume.resume_checkpoint
        assert dist_resume.errors is errors and dist_resume.tools is tools


def test_the_installed_version_is_the_package_version():
    # pyproject.toml reads it from dist_resume/_core/version.py: one owner, never two numbers
    assert importlib.metadata.version("dist-resume") == dist_resume.__version__


@pytest.mark.parametrize(("module", "obj"), PUBLIC, ids=lambda o: _name(o))
def test_exported_objects_show_the_public_path(module, obj):
    assert obj.__module__ in (module.__name__, "dist_resume.errors")
    home = {m.__name__: m for m in MODULES}[obj.__module__]
    assert getattr(home, obj.__qualname__) is obj  # what pickle and tracebacks resolve
    assert obj.__doc__


@pytest.mark.parametrize("fn", FUNCTIONS, ids=_name)
def test_public_functions_say_collective_or_local(fn):
    doc = fn.__doc__.lower()  # "Collective." / "Local." or, for mixed cases, "For a folder: collective ..."
    assert "collective" in doc or "local" in doc


def _flags(fn):
    """Parameters with a bool default or a bool annotation: flags, which must be keyword-only."""
    hints = typing.get_type_hints(fn)
    for p in inspect.signature(fn).parameters.values():
        if isinstance(p.default, bool) or hints.get(p.name) is bool:
            yield p


def _methods(cls):
    """Public methods and the constructor (a dataclass's generated one excepted: a value built by the library)."""
    generated = dataclasses.is_dataclass(cls)
    return [
        m
        for n, m in vars(cls).items()
        if inspect.isfunction(m) and (not n.startswith("_") or (n == "__init__" and not generated))
    ]


@pytest.mark.parametrize("fn", FUNCTIONS + [m for c in CLASSES for m in _methods(c)], ids=lambda f: f.__qualname__)
def test_flags_are_keyword_only_everywhere_in_the_public_api(fn):
    positional = [p.name for p in _flags(fn) if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert positional == [], f"{fn.__qualname__}: {positional} may be passed by position"


def test_resume_takes_eight_parameters_and_its_options_as_one_value():
    params = inspect.signature(dist_resume.resume).parameters
    assert list(params) == [
        "path",
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "dataloader",
        "ema",
        "options",
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for name, p in params.items() if name != "path")
    save = inspect.signature(dist_resume.save_checkpoint).parameters
    assert "dataloader" in save and "sampler" not in save and save["rng"].default is True
    assert inspect.signature(dist_resume.save_checkpoint_async).parameters.keys() == save.keys()
    assert dist_resume.ResumeOptions().rng is True  # the same default on both sides
    manager = inspect.signature(dist_resume.CheckpointManager.save).parameters
    assert list(manager) == ["self", "step", "epoch", "extra", "objects"]


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=_name)
def test_exported_exceptions_pickle_by_their_public_path(cls):
    err = cls("what was found; what to do")
    assert f"cdist_resume.errors\n{cls.__name__}\n".encode() in pickle.dumps(err, protocol=0)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err)
    assert repr(cls) == f"<class 'dist_resume.errors.{cls.__name__}'>"


def test_cli_report_builder_does_not_shadow_the_public_name():
    from dist_resume.cli.inspect import _report

    assert not hasattr(_report, "inspect_checkpoint") and callable(_report.describe_checkpoint)


def test_testing_module_is_public_and_documented():
    assert dist_resume.testing.__all__[:5] == [
        "RankFailure",
        "run_ranks",
        "kill_process_group",
        "kill_tree",
        "check_resume",
    ]
    assert {"ResumeCheck", "StepDifference", "Cause"} <= set(dist_resume.testing.__all__)
    for name in ("run_ranks", "check_resume"):
        assert "Local" in (getattr(dist_resume.testing, name).__doc__ or "")
    assert "Example" in (dist_resume.testing.__doc__ or "") and "Example" in (dist_resume.testing.sim.__doc__ or "")
    for name in dist_resume.testing.__all__:  # reprs, tracebacks and pickles name the public module
        assert getattr(dist_resume.testing, name).__module__ == "dist_resume.testing", name


def _members(obj):
    yield obj
    if inspect.isclass(obj) and not issubclass(obj, BaseException):
        for name, member in vars(obj).items():
            if (not name.startswith("_") or name == "__init__") and inspect.isfunction(member):
                yield member
            elif isinstance(member, property) and member.fget is not None:
                yield member.fget


def _named_types(hint):
    if inspect.isclass(hint):
        yield hint
    for arg in typing.get_args(hint):
        yield from _named_types(arg)


PUBLIC_MODULES = {m.__name__ for m in MODULES} | {"dist_resume.testing"}


@pytest.mark.parametrize("obj", FUNCTIONS + CLASSES, ids=_name)
def test_annotations_resolve_and_name_only_exported_types(obj):
    # typing.get_type_hints resolves a class's string annotations in sys.modules[cls.__module__]:
    # after the rename to the public module they must still resolve, and every toolkit type a public
    # signature mentions must be importable from a public module
    private = set()
    for member in _members(obj):
        for hint in typing.get_type_hints(member).values():
            for t in _named_types(hint):
                if t.__module__.startswith("dist_resume") and t.__module__ not in PUBLIC_MODULES:
                    private.add(f"{t.__module__}.{t.__qualname__}")
    assert private == set()


def _resolves(name: str) -> bool:
    """``name`` (``x``, ``tools.x``, ``dist_resume.errors.X``, ``CheckpointManager.save``) names a public object."""
    parts = name.removeprefix("dist_resume.").split(".")
    for module in MODULES:
        if parts[0] == module.__name__.rpartition(".")[2] and module is not dist_resume:
            parts = parts[1:]
            break
    else:
        found = next((m for m in MODULES if parts[0] in m.__all__), None)
        if found is None:
            return False
        module = found
    if not parts or parts[0] not in module.__all__:
        return False
    obj = getattr(module, parts[0])
    return all(hasattr(obj, attr) for attr in parts[1:])


@pytest.mark.parametrize("obj", FUNCTIONS + CLASSES, ids=_name)
def test_docstrings_cite_only_public_names(obj):
    # a reader of help(dist_resume.x) can follow every :func:/:class: reference: an exported
    # name (of dist_resume, tools or errors), a method of the same class, or torch's own
    own = set(vars(obj)) if inspect.isclass(obj) else set()
    cited = set()
    for member in _members(obj):
        cited.update(re.findall(r":(?:func|class|meth|attr|mod):`~?([\w.]+)`", inspect.getdoc(member) or ""))
    private = {
        name
        for name in cited
        if not name.startswith("torch.")
        and name not in ("dist_resume.tools", "dist_resume.errors")
        and name.split(".")[-1] not in own
        and not _resolves(name)
    }
    assert private == set()
