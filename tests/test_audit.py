"""Every method's messages carry no raw record and no sign of how many records a client has
(:mod:`fedppl.audit`), and the audit catches both leaks when they are there."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import fedppl
from fedppl.audit import audit_messages, raw_records_in, size_changes
from tests.infer.test_front import METHODS


# GlobalVI is the pooled reference: its data sit on one machine and nothing is sent
@pytest.mark.parametrize("name", [m for m in METHODS if m != "GlobalVI"])
def test_no_method_sends_raw_records_or_its_size(name):
    method, clients, kwargs, _ = METHODS[name]()
    if name == "FederatedSGP":  # pseudo-inputs away from the data (see fedppl.audit)
        method = fedppl.FederatedSGP("dpo", num_inducing=5, local_steps=5, pseudo_init="prior")
    report = audit_messages(method, jax.random.key(0), clients, 2, **kwargs)
    assert report.fields, "no message field was inspected"
    findings = report.findings
    if name == "FederatedSGP":
        # the known leak: DPO sends pseudo_fraction * N_k pseudo-observations (the paper's
        # rule), padded to the largest client's count, so their number follows client size
        assert {f.kind for f in findings} == {"size"}
        assert {f.leaf for f in findings} == {".pseudo.V", ".pseudo.m", ".pseudo.s_raw"}
        findings = ()
    assert not findings, findings


def test_the_audit_finds_copies_and_size_leaks():
    X = np.arange(12.0).reshape(6, 2) + 0.5
    y = np.linspace(0.1, 0.9, 6)
    labels = np.array([0, 1, 1, 0, 1, 0, 0, 1, 1])
    assert raw_records_in([("m", np.zeros((3, 2)))], (X, y)) == []
    kinds = {k for k, _, _ in raw_records_in([("m", np.stack([np.zeros(2), X[4]]))], (X, y))}
    assert kinds == {"input row"}
    assert [k for k, _, _ in raw_records_in([("m", np.r_[0.0, y[2]])], (X, y))] == [
        "target value"]
    # single labels occur anywhere; a run of eight of them is a copy
    assert raw_records_in([("m", np.array([0.0, 1.0, 1.0]))], (labels,)) == []
    assert [k for k, _, _ in raw_records_in([("m", np.r_[5.0, labels[1:]])], (labels,))] == [
        "integer run"]
    full, fewer = [("a", np.zeros((3, 4))), ("b", np.zeros((3, 2)))], [
        ("a", np.zeros((3, 4))), ("b", np.zeros((3, 1)))]
    assert [f for f, _ in size_changes(full, fewer)] == ["b"]


def test_shrink_must_leave_records():
    method, clients, _, _ = METHODS["PVI"]()
    with pytest.raises(ValueError, match="shrink"):
        audit_messages(method, jax.random.key(0), clients, shrink=1.0)


@pytest.mark.parametrize("privacy", [
    fedppl.DPOptimisation(clip=1.0, noise_multiplier=1.0, sampling_rate=0.5),
    fedppl.DPLocalAveraging(clip=1.0, noise_multiplier=1.0, shards=3)],
    ids=["dp-optimisation", "local-averaging"])
def test_private_pvi_sends_its_noised_factor_and_nothing_that_depends_on_the_data(privacy):
    _, clients, _, _ = METHODS["PVI"]()
    from fedppl.models import logistic_regression as model
    method = fedppl.PVI(model, fedppl.PVIGuide(model), "synchronous", privacy=privacy,
                        local_steps=5, num_particles=2)
    report = audit_messages(method, jax.random.key(0), clients, 1)
    assert report.fields and report.clean, report.findings
    state, _ = method.update(method.init(jax.random.key(0), clients))
    msgs = state.log.last_messages  # the diagnostics a non-private client sends are constants
    assert np.all(np.isnan(np.asarray(msgs.free_energy)))
    assert np.all(np.asarray(msgs.converged)) and np.all(np.asarray(msgs.iterations) == 5)
