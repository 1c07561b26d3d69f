"""The ``fedppl`` command line: one JSON shape, one set of shared options, one-line errors.

Each subcommand's own run is tested beside its experiment (``tests/experiments/``); those tests
check their ``--json`` file with :func:`assert_cli_json`, so every subcommand's output is held to
the one schema without a second run here.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fedppl.cli import JSON_SCHEMA, build_parser, main
from fedppl_experiments.commands import COMMANDS

_TYPES = {"object": dict, "array": list, "string": str}


def _validate(value: Any, schema: dict, where: str = "$") -> None:
    """The part of JSON Schema that :data:`JSON_SCHEMA` uses (type, required, properties,
    additionalProperties, items, minItems), by hand: the check does not depend on a package."""
    kind = schema.get("type")
    assert kind is None or isinstance(value, _TYPES[kind]), f"{where}: not a {kind}: {value!r}"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            assert key in value, f"{where}: missing {key!r}"
        props, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
        for key, v in value.items():
            if key in props:
                _validate(v, props[key], f"{where}.{key}")
            else:
                assert extra is not False, f"{where}: unexpected key {key!r}"
                if isinstance(extra, dict):
                    _validate(v, extra, f"{where}.{key}")
    if isinstance(value, list):
        assert len(value) >= schema.get("minItems", 0), f"{where}: too few items"
        for i, v in enumerate(value):
            _validate(v, schema.get("items", {}), f"{where}[{i}]")


def assert_cli_json(path: str | Path, command: str) -> list[dict]:
    """The file a subcommand's ``--json`` wrote follows :data:`JSON_SCHEMA` (and, where the
    ``jsonschema`` package happens to be installed, passes its validator too); returns the runs."""
    doc = json.loads(Path(path).read_text())  # plain JSON: no NaN or Infinity tokens either
    _validate(doc, JSON_SCHEMA)
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - not a dependency
        pass
    else:
        jsonschema.validate(doc, JSON_SCHEMA)
    assert doc["command"] == command and doc["version"] == importlib.metadata.version("fedppl")
    assert doc["arguments"]["json"] == str(path) and not any(k.startswith("_") for k in doc[
        "arguments"])
    return doc["runs"]


def test_the_hand_validator_refuses_what_the_schema_refuses():
    run = {"method": "m", "config": {}, "summary": {}, "history": {"round": [1]}, "rejected": []}
    good = {"command": "sgp", "version": "0", "arguments": {}, "runs": [run]}
    _validate(good, JSON_SCHEMA)
    bad = [{**good, "runs": []}, {**good, "rows": []}, {k: good[k] for k in ("command", "runs")},
           {**good, "runs": [{**run, "history": {"round": 1}}]},
           {**good, "runs": [{k: v for k, v in run.items() if k != "config"}]},
           {**good, "runs": [{**run, "results": {}}]}]
    for doc in bad:
        with pytest.raises(AssertionError):
            _validate(doc, JSON_SCHEMA)


def test_demo_prints_table_writes_plot_and_json(tmp_path, capsys):
    out, js = tmp_path / "demo.png", tmp_path / "demo.json"
    assert main(["demo", "--clients", "4", "--rounds", "2", "--local-steps", "30", "--out",
                 str(out), "--no-progress", "--json", str(js)]) == 0
    text = capsys.readouterr().out
    for row in ["PVI sequential", "PVI synchronous", "global VI", "client alone"]:
        assert row in text
    assert out.stat().st_size > 10_000
    runs = assert_cli_json(js, "demo")
    assert [r["method"] for r in runs][:3] == ["PVI sequential", "PVI synchronous (damping 0.5)",
                                               "global VI (pooled data)"]
    assert runs[0]["history"]["round"] == [1, 2] and runs[-1]["history"] == {}
    assert runs[-1]["summary"]["elbo"] is None  # NaN is written as null
    assert all(0.8 < r["summary"]["accuracy"] <= 1 for r in runs[:3])


def test_module_entry_point_shows_help():
    proc = subprocess.run([sys.executable, "-m", "fedppl", "--help"], capture_output=True,
                          text=True, check=True)
    assert "demo" in proc.stdout and "--version" in proc.stdout


def test_version_is_the_installed_distribution_s(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedppl {importlib.metadata.version('fedppl')}"


def _options(command: str) -> set[str]:
    sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    return {s for a in sub._actions for s in a.option_strings}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_subcommand_has_the_shared_options(command):
    opts = _options(command)
    assert {"--seed", "--json", "--no-progress", "--debug"} <= opts
    assert ("--method" in opts) == (command in ("sgp", "svgp", "fedbnr", "mogp"))
    assert "--out" not in opts or command == "demo"  # demo's old name of --plot


def test_method_is_a_list_everywhere_with_old_spellings_kept():
    p = build_parser()
    base = ["--data", "."]
    assert p.parse_args(["sgp", *base, "--method", "dpo,global", "cpo"]).method == [
        "dpo", "global", "cpo"]
    assert p.parse_args(["svgp", *base, "--method", "kron", "--method", "tvgp,kron"]).method == [
        "kron", "tvgp"]
    assert p.parse_args(["fedbnr", *base, "--variant", "kd"]).method == ["kd"]
    assert p.parse_args(["fedbnr", *base, "--variant", "kd", "--method", "avg"]).method == [
        "kd", "avg"]
    assert p.parse_args(["mogp", "--method", "all"]).method == [
        "pfed-mul", "pfed-st", "gaussian-vi"]
    assert p.parse_args(["mogp", "--variant", "kernel"]).hyper == "kernel"
    assert p.parse_args(["demo", "--out", "x.png"]).plot == "x.png"
    assert p.parse_args(["svgp", *base]).method == ["tvgp"]


def test_method_names_match_the_experiments():
    from fedppl_experiments import fedbnr_uci, mogp_digits, mogp_synthetic, sgp_uci, svgp
    from fedppl_experiments.commands import fedbnr, mogp, sgp
    from fedppl_experiments.commands import svgp as svgp_cmd

    assert tuple(fedbnr_uci.VARIANTS) == fedbnr.METHODS
    assert sgp.METHODS == sgp_uci.METHODS and svgp_cmd.METHODS == svgp.METHODS
    assert mogp.METHODS == mogp_synthetic.METHODS == mogp_digits.METHODS


# a bad path and a typo per subcommand: each fails while parsing, before anything is computed
USER_ERRORS = {
    "demo-typo": (["demo", "--runtime", "flwr"], "--runtime"),
    "demo-number": (["demo", "--rounds", "ten"], "--rounds"),
    "fedbnr-path": (["fedbnr", "--data", "{missing}"], "no such folder"),
    "fedbnr-typo": (["fedbnr", "--data", "{tmp}", "--method", "avg,kdd"], "'kdd'"),
    "cotrain-path": (["cotrain", "--data", "{missing}"], "no such folder"),
    "cotrain-typo": (["cotrain", "--uncertainty", "ful"], "--uncertainty"),
    "cotrain-number": (["cotrain", "--delta", "2"], "--delta"),
    "sgp-path": (["sgp", "--data", "{missing}"], "no such folder"),
    "sgp-typo": (["sgp", "--data", "{tmp}", "--method", "dpo", "glbal"], "'glbal'"),
    "mogp-typo": (["mogp", "--study", "digit"], "--study"),
    "mogp-method": (["mogp", "--method", "fedavg"], "'fedavg'"),
    "svgp-path": (["svgp", "--data", "{missing}"], "no such folder"),
    "svgp-typo": (["svgp", "--data", "{tmp}", "--method", "kronecker"], "'kronecker'"),
    "json-path": (["mogp", "--json", "{missing}/out.json"], "--json: no such folder"),
    "command-typo": (["sgd"], "invalid choice"),
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_errors_are_one_line_and_exit_2(case, tmp_path, capsys):
    argv, words = USER_ERRORS[case]
    argv = [a.format(tmp=tmp_path, missing=tmp_path / "missing") for a in argv]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err, err


def test_errors_found_while_running_are_one_line_and_debug_shows_the_traceback(tmp_path,
                                                                               capsys):
    argv = ["svgp", "--data", str(tmp_path), "--no-progress"]  # a folder without data.txt
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.txt" in err and "Traceback" not in err
    with pytest.raises(FileNotFoundError, match=r"data\.txt"):
        main(["--debug", *argv])
    with pytest.raises(FileNotFoundError, match=r"data\.txt"):
        main([*argv, "--debug"])


def test_sgp_writes_one_run_per_method(tmp_path, capsys):
    """The one subcommand without a CLI test beside its experiment: the smallest run there is."""
    from tests.experiments.test_svgp import uci_folder

    out = tmp_path / "sgp.json"
    assert main(["sgp", "--data", str(uci_folder(tmp_path)), "--method", "fsgp", "--clients",
                 "2", "--rounds", "2", "--local-steps", "2", "--inducing", "3", "--json",
                 str(out), "--no-progress"]) == 0
    assert "| fsgp |" in capsys.readouterr().out
    (run,) = assert_cli_json(out, "sgp")
    assert run["method"] == "fsgp" and run["config"]["inducing"] == 3
    assert run["history"]["round"] == [1, 2] and run["summary"]["rmse"] > 0
