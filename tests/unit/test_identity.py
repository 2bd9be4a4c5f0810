"""The progress channel's identity: shared RBAC per namespace, a per-run binding only for a
user-named account, and an admission policy that covers every status field but progress."""

from __future__ import annotations

from tests.unit.test_status import finetune
from tpuft_operator.api.cli import progress_policy_template
from tpuft_operator.api.models import TPUFineTuneStatus
from tpuft_operator.render import naming, render_run
from tpuft_operator.render.identity import PROGRESS_ROLE, namespace_objects, progress_policy


def test_runs_have_no_rbac_objects_of_their_own_and_pods_use_the_namespace_account() -> None:
    run = render_run(finetune())
    assert [o["kind"] for o in run.objects] == ["JobSet"]
    pod = run.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == naming.TRAINER_SERVICE_ACCOUNT
    assert run.namespace_objects == namespace_objects("ns")


def test_the_namespace_role_allows_only_patch_of_status() -> None:
    account, role, binding = namespace_objects("ns")
    assert account["metadata"]["name"] == naming.TRAINER_SERVICE_ACCOUNT
    # No get: a status GET returns the whole object, and the reporter only patches.
    assert role["rules"] == [
        {"apiGroups": ["tpuft.dev"], "resources": ["tpufinetunes/status"], "verbs": ["patch"]}
    ]
    assert binding["roleRef"]["name"] == PROGRESS_ROLE
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": naming.TRAINER_SERVICE_ACCOUNT, "namespace": "ns"}
    ]
    # Shared objects belong to no run: deleting a run must not delete them.
    assert all("ownerReferences" not in o["metadata"] for o in (account, role, binding))


def test_a_user_named_account_gets_a_binding_owned_by_the_run() -> None:
    run = render_run(finetune(serviceAccountName="fine-tuner"))
    (binding,) = run.identity
    assert binding["kind"] == "RoleBinding" and binding["roleRef"]["name"] == PROGRESS_ROLE
    assert binding["subjects"][0]["name"] == "fine-tuner"
    assert binding["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert [o["kind"] for o in run.objects] == ["RoleBinding", "JobSet"]


def test_the_policy_freezes_every_status_field_but_progress() -> None:
    policy, binding = progress_policy()
    frozen = policy["spec"]["validations"][-1]["expression"]
    for name, field in TPUFineTuneStatus.model_fields.items():
        alias = field.alias or name
        assert (f"object.status.{alias} ==" in frozen) == (alias != "progress"), alias
    exempt = policy["spec"]["matchConditions"][0]["expression"]
    assert (
        "subresource('status')" in exempt and "check('operate')" in exempt and "check('list')" not in exempt
    )
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


def test_the_chart_template_is_named_after_the_release() -> None:
    text = progress_policy_template()
    # Policy name, binding name and the binding's policyName: two releases never collide.
    assert text.count('{{ include "tpuft.fullname" . }}-progress') == 3
